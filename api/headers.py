"""Headers on every response: no MIME sniffing and no Referer, and on every HTML page a
Content-Security-Policy that lets it load and run only kiln's own files.

The pages show user text (prompts, errors, metadata) and hold the user's key in local storage, so
the policy is the second line behind escaping: scripts, stylesheets, fetches and form posts only
from the API's own origin, no plugins, no ``<base>``, no framing. Thumbnails, previews and videos
are fetched with the key and shown from ``blob:`` URLs; the pages' progress bars set their widths
in ``style`` attributes, hence ``style-src-attr 'unsafe-inline'`` (attributes only: a ``<style>``
element or a foreign stylesheet stays refused). A page with needs of its own (``/docs``) sets its
own policy, which is kept.

With an S3 output store the job routes answer with redirects to presigned URLs on the store's
host, so that one origin (`store_origin`) is added to ``connect-src``, ``img-src`` and
``media-src``.
"""

from __future__ import annotations

import logging
from urllib.parse import urlsplit

from starlette.datastructures import MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from storage.outputs import OutputStore, video_key

log = logging.getLogger(__name__)


def page_policy(store_origin: str | None = None) -> str:
    """The pages' Content-Security-Policy; ``store_origin``: where the output store's presigned
    URLs point, allowed to be fetched and shown."""
    store = f" {store_origin}" if store_origin else ""
    return "; ".join([
        "default-src 'self'",
        "script-src 'self'",
        "style-src 'self'",
        "style-src-attr 'unsafe-inline'",
        f"img-src 'self'{store} blob: data:",  # data: for the pages' empty favicon
        f"media-src 'self'{store} blob:",
        f"connect-src 'self'{store}",
        "object-src 'none'",
        "base-uri 'none'",
        "form-action 'self'",
        "frame-ancestors 'none'",
    ])


PAGE_POLICY = page_policy()


def store_origin(store: OutputStore) -> str | None:
    """``scheme://host[:port]`` of the URLs the store hands out for its files (an S3 store's
    presigned URLs; its client decides the host, path- or virtual-hosted style); None for a
    store whose files the API serves itself. Presigning is computed locally: no request is made.
    """
    try:
        url = store.url(video_key("0" * 20))
    except Exception:  # botocore without credentials, say: the downloads fail the same way
        log.warning("could not presign a URL of the output store; the pages' policy names "
                    "no store origin", exc_info=True)
        return None
    if url is None:
        return None
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.netloc}"
# On every response, pages and API answers alike.
COMMON = {"X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer"}


class SecurityHeaders:
    """Adds `COMMON` to every response, and ``policy`` (by default `PAGE_POLICY`) to an HTML one
    that sets no policy."""

    def __init__(self, app: ASGIApp, policy: str = PAGE_POLICY) -> None:
        self.app = app
        self.policy = policy

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = list(message.get("headers", []))
                headers = MutableHeaders(scope=message)
                for name, value in COMMON.items():
                    headers.setdefault(name, value)
                if headers.get("content-type", "").startswith("text/html"):
                    headers.setdefault("Content-Security-Policy", self.policy)
            await send(message)

        await self.app(scope, receive, send_with_headers)
