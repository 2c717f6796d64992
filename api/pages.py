"""What kiln's server-rendered pages (a job's, a batch's) share: escaping and formatting, and
the frame around their ``<main>`` (``page.html``: the header with the key form, the stylesheet,
the shared scripts and the page's own)."""

from __future__ import annotations

from datetime import datetime
from html import escape
from pathlib import Path
from typing import Any

_FRAME = Path(__file__).resolve().parent / "page.html"

# Without a key the page is this shell; its script loads the page again with the stored key.
SHELL_MAIN = ('<main data-shell="true"><p class="empty" id="shell">Loading… (this page needs '
              "your API key: enter it above; it is kept in this browser)</p></main>")


def e(value: Any) -> str:
    """``value`` as text safe in HTML, attributes included."""
    return escape("" if value is None else str(value), quote=True)


def time(at: datetime | None) -> str:
    if at is None:
        return '<span class="dim">—</span>'
    iso = at.isoformat()
    return f'<time datetime="{e(iso)}">{e(at.strftime("%Y-%m-%d %H:%M:%S UTC"))}</time>'


def seconds(s: float) -> str:
    return f"{s:.1f} s" if s < 120 else f"{s / 60:.1f} min"


def page(main: str | None, *, title: str, heading: str, script: str) -> str:
    """The whole page around ``main`` (None: the shell), titled ``title``, with ``heading``
    beside kiln's name and ``script`` (a name under ``/dashboard/assets/``) as its own script."""
    frame = _FRAME.read_text(encoding="utf-8")
    for marker, value in (("<!--TITLE-->", e(title)), ("<!--HEADING-->", e(heading)),
                          ("<!--SCRIPT-->", e(script)), ("<!--MAIN-->", main or SHELL_MAIN)):
        frame = frame.replace(marker, value)
    return frame
