"""Promises about the package's source that hold for every line, not only the lines a test happens to run."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _asserts(paths):
    found = []
    for path in paths:
        tree = ast.parse(path.read_text(), filename=str(path))
        found += [f"{path.relative_to(ROOT)}:{node.lineno}" for node in ast.walk(tree) if isinstance(node, ast.Assert)]
    return found


def test_no_code_outside_test_modules_checks_with_assert():
    # `python -O` strips assert statements: pipeopt validates input and state with exceptions, and the tests' helper
    # modules and scripts (which pytest does not rewrite) check subprocess results with an explicit raise.
    helpers = [p for p in (ROOT / "tests").rglob("*.py") if not p.name.startswith(("test_", "conftest"))]
    assert _asserts(sorted((ROOT / "pipeopt").rglob("*.py")) + helpers) == []
