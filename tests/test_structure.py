"""House rules the import-linter contract (pyproject.toml) does not cover.

``python tests/test_structure.py [ROOT]`` lists every import inside a function body of the
packages under ROOT (this checkout by default) and counts them.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("common", "kiln", "api", "scheduler", "runtime", "storage", "migrations")


def _function_imports(path: Path) -> list[tuple[int, list[str]]]:
    """(line, the lines above it back to the enclosing statement) of each import inside a
    function body."""
    lines = path.read_text().splitlines()
    found = []
    for fn in ast.walk(ast.parse("\n".join(lines))):
        if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        for node in ast.walk(fn):
            if isinstance(node, ast.Import | ast.ImportFrom):
                found.append((node.lineno, lines[fn.lineno - 1:node.lineno]))
    return found


def _says_why(context: list[str]) -> bool:
    """An import says why it is not at the top in a comment on its own line, or on a comment or
    ``try:`` line just above the block of imports it belongs to."""
    *above, line = context
    if "#" in line and "noqa" not in line.split("#", 1)[1][:5]:
        return True
    for prev in reversed(above):
        text = prev.strip()
        if text.startswith(("import ", "from ")) or not text:
            continue
        return text.startswith("#") or (text.startswith("try:") and "#" in text)
    return False


def test_imports_inside_functions_say_why_they_are_not_at_the_top() -> None:
    unexplained = [
        f"{path.relative_to(ROOT)}:{lineno}"
        for package in PACKAGES
        for path in sorted((ROOT / package).rglob("*.py"))
        for lineno, context in _function_imports(path)
        if not _says_why(context)
    ]
    assert unexplained == [], (
        "an import inside a function must say why it is not at the top (a heavy or optional "
        "library kept out of processes that never need it): " + ", ".join(unexplained))


if __name__ == "__main__":
    root = Path(sys.argv[1]).resolve() if len(sys.argv) > 1 else ROOT
    count = 0
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            for lineno, context in _function_imports(path):
                count += 1
                reason = "" if _says_why(context) else "   <- no reason given"
                print(f"{path.relative_to(root)}:{lineno}: {context[-1].strip()}{reason}")
    print(f"{count} imports inside function bodies")
