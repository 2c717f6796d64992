"""docs/security.md names, for each promise, the tests that hold it: every one of them exists, as
a test function at the top of its file that the suite runs (not only under ``make chaos``, not
skipped), and the page covers each party of the threat model."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "security.md"
# `tests/api/test_headers.py::test_every_route_and_page_carries_the_security_headers`
NAMED = re.compile(r"\b(tests/[\w/]+\.py)::(test_\w+)\b")


def named_tests() -> list[tuple[str, str]]:
    """(file, test name) of every test the page names, in order, each once."""
    return list(dict.fromkeys(NAMED.findall(PAGE.read_text())))


def _marks(node: ast.expr) -> set[str]:
    """The attribute names in a decorator or ``pytestmark`` value: ``skip``, ``chaos``, ..."""
    return {n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute)}


def _why_not_run(path: Path, name: str) -> str | None:
    """Why the suite would not run test ``name`` of ``path``; None when it does."""
    if not path.is_file():
        return "no such file"
    module = ast.parse(path.read_text())
    module_marks: set[str] = set()
    for node in module.body:
        if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "pytestmark" for t in node.targets):
            module_marks |= _marks(node.value)
    found = [node for node in module.body
             if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name == name]
    if not found:
        return "no such test function at the top of the file"
    marks = module_marks.union(*(_marks(d) for d in found[0].decorator_list))
    held_back = marks & {"chaos", "skip", "skipif", "xfail"}
    return f"marked {', '.join(sorted(held_back))}" if held_back else None


def test_every_test_the_security_page_names_exists_and_runs_in_the_suite() -> None:
    named = named_tests()
    assert len(named) >= 40, named
    missing = [f"{file}::{name}: {why}" for file, name in named
               if (why := _why_not_run(ROOT / file, name)) is not None]
    assert missing == [], "docs/security.md names tests the suite does not run:\n" + \
        "\n".join(missing)


def test_the_page_covers_every_party_and_what_is_not_promised() -> None:
    text = PAGE.read_text()
    parties = re.findall(r"^\| (\w[\w ,]*?) \|", text, re.MULTILINE)
    assert {"operator", "admin", "user", "webhook receiver", "browser", "network, inside",
            "network, client to API", "network, to receivers"} <= set(parties), parties
    assert "## What kiln does not promise" in text and "**TLS.**" in text


def test_a_name_that_is_not_a_test_is_reported() -> None:
    here = Path(__file__)
    assert _why_not_run(here, "test_a_name_that_is_not_a_test_is_reported") is None
    assert _why_not_run(here, "test_nothing_by_this_name") is not None
    assert _why_not_run(ROOT / "tests" / "nowhere.py", "test_x") == "no such file"
    assert _why_not_run(ROOT / "tests" / "test_cli_up_supervision.py",
                        "test_a_killed_api_and_private_redis_come_back_on_the_same_address"
                        ) == "marked chaos"
