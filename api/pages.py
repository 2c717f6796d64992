"""What kiln's server-rendered pages (a job's, a batch's) share: the Jinja2 environment their
templates (``api/templates``) render in, and the frame around their ``<main>`` (``page.html``:
the header with the key form, the stylesheet, the shared scripts and the page's own).

Autoescape is on for every template: the pages show user text (prompts, errors, metadata, webhook
URLs), and a value reaches the HTML escaped unless a template or this module marks it as markup.
``macros.html`` holds what the pages' templates share (times, state chips).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from jinja2 import Environment, FileSystemLoader, StrictUndefined
from markupsafe import Markup


def seconds(s: float) -> str:
    """A duration as the pages show it: seconds up to two minutes, minutes beyond."""
    return f"{s:.1f} s" if s < 120 else f"{s / 60:.1f} min"


def _finalize(value: Any) -> Any:
    # A missing value (a column or an event's detail that is None) shows as nothing.
    return "" if value is None else value


templates = Environment(
    loader=FileSystemLoader(Path(__file__).resolve().parent / "templates"),
    autoescape=True,
    undefined=StrictUndefined,  # a misspelt name fails the render instead of showing nothing
    finalize=_finalize,
    # A line that holds only a block tag ({% if %}, {% for %}, ...) leaves nothing in the page.
    trim_blocks=True,
    lstrip_blocks=True,
)
templates.filters["seconds"] = seconds


def render(name: str, **context: Any) -> str:
    """The template ``name`` rendered with ``context``."""
    return templates.get_template(name).render(**context)


def page(main: str | None, *, title: str, heading: str, script: str) -> str:
    """The whole page around ``main`` (the HTML of a rendered ``<main>``; None: the shell that
    loads the page with the stored key), titled ``title``, with ``heading`` beside kiln's name
    and ``script`` (a name under ``/dashboard/assets/``) as its own script."""
    return render("page.html", main=None if main is None else Markup(main), title=title,
                  heading=heading, script=script)
