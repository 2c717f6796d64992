"""``/docs``: FastAPI's Swagger UI page for the OpenAPI document, with a policy of its own.

The page loads Swagger UI's script and stylesheet from jsDelivr (FastAPI's default) and starts it
with one inline script. Its Content-Security-Policy allows exactly those two files by their full
URLs, the inline script by its SHA-256 (computed from the page as served, so the two cannot
drift apart), and fetches from the API only ("Try it out" included). Swagger UI sets inline styles
and ``data:`` images of its own, so styles may be inline here; the page shows no user text. The
favicon is an empty ``data:`` URL, so no third party but jsDelivr is asked for anything, and
with ``Referrer-Policy: no-referrer`` (`api.headers`) jsDelivr is not told where from. ReDoc is
not served: it would need inline ``<style>`` elements, workers from ``blob:`` and Google's fonts,
and one browser of the document is enough.
"""

from __future__ import annotations

import base64
import hashlib
import re

from fastapi import APIRouter, Request
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import HTMLResponse

router = APIRouter()

SWAGGER_JS = "https://cdn.jsdelivr.net/npm/swagger-ui-dist@5/swagger-ui-bundle.js"
SWAGGER_CSS = "https://cdn.jsdelivr.net/npm/swagger-ui-dist@5/swagger-ui.css"
_INLINE_SCRIPT = re.compile(r"<script>(.*?)</script>", re.DOTALL)


def _sha256(text: str) -> str:
    return base64.b64encode(hashlib.sha256(text.encode()).digest()).decode()


def policy(html: str) -> str:
    """The Content-Security-Policy for the Swagger UI page ``html``."""
    inline = " ".join(f"'sha256-{_sha256(s)}'" for s in _INLINE_SCRIPT.findall(html))
    return "; ".join([
        "default-src 'self'",
        f"script-src {SWAGGER_JS} {inline}",
        f"style-src 'self' {SWAGGER_CSS} 'unsafe-inline'",
        "img-src 'self' data:",
        "connect-src 'self'",
        "object-src 'none'",
        "base-uri 'none'",
        "form-action 'self'",
        "frame-ancestors 'none'",
    ])


@router.get("/docs", response_class=HTMLResponse, include_in_schema=False)
def swagger_ui(request: Request) -> HTMLResponse:
    app = request.app
    page = get_swagger_ui_html(openapi_url=app.openapi_url, title=f"{app.title} - Swagger UI",
                               swagger_js_url=SWAGGER_JS, swagger_css_url=SWAGGER_CSS,
                               swagger_favicon_url="data:,")
    html = bytes(page.body).decode()
    return HTMLResponse(html, headers={"Content-Security-Policy": policy(html),
                                       "Cache-Control": "no-cache"})
