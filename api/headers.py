"""Headers on every response: no MIME sniffing and no Referer, and on every HTML page a
Content-Security-Policy that lets it load and run only kiln's own files.

The pages show user text (prompts, errors, metadata) and hold the user's key in local storage, so
the policy is the second line behind escaping: scripts, stylesheets, fetches and form posts only
from the API's own origin, no plugins, no ``<base>``, no framing. Thumbnails, previews and videos
are fetched with the key and shown from ``blob:`` URLs; the pages' progress bars set their widths
in ``style`` attributes, hence ``style-src-attr 'unsafe-inline'`` (attributes only: a ``<style>``
element or a foreign stylesheet stays refused). A page with needs of its own (``/docs``) sets its
own policy, which is kept.
"""

from __future__ import annotations

from starlette.datastructures import MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

PAGE_POLICY = "; ".join([
    "default-src 'self'",
    "script-src 'self'",
    "style-src 'self'",
    "style-src-attr 'unsafe-inline'",
    "img-src 'self' blob: data:",  # data: for the pages' empty favicon
    "media-src 'self' blob:",
    "connect-src 'self'",
    "object-src 'none'",
    "base-uri 'none'",
    "form-action 'self'",
    "frame-ancestors 'none'",
])
# On every response, pages and API answers alike.
COMMON = {"X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer"}


class SecurityHeaders:
    """Adds `COMMON` to every response, and `PAGE_POLICY` to an HTML one that sets no policy."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

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
                    headers.setdefault("Content-Security-Policy", PAGE_POLICY)
            await send(message)

        await self.app(scope, receive, send_with_headers)
