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


#: The rooms from the bottom up: a room imports only rooms below it (anywhere in a module, inside functions too).
#: Shared vocabulary and seams first; then measuring, judging, deciding, applying (DALI is one more way to apply:
#: the loader switcher knows it only through ``apply.loader.LoaderSource``), reporting, and the two front doors.
ROOMS = ["_version", "files", "config", "cache", "_dataloader", "_torchvision", "_lightning", "measure", "verdict",
         "tuning", "apply", "dali", "report", "callbacks", "cli", "__main__", "__init__"]


def _room(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _imports(path: Path) -> list[tuple[int, str]]:
    module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level:  # relative: resolved against this module's package
            keep = -node.level if path.name != "__init__.py" else -node.level + 1  # a package is its own base
            base = module.split(".")[:keep] if keep else module.split(".")
            found.append((node.lineno, ".".join(base + ([node.module] if node.module else []))))
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [f"{node.module}.{a.name}" for a in node.names] if node.module == "pipeopt" else [node.module]
            found += [(node.lineno, name) for name in names]
    return [(line, name) for line, name in found if name == "pipeopt" or name.startswith("pipeopt.")]


def test_rooms_import_one_way():
    wrong = []
    for path in sorted((ROOT / "pipeopt").rglob("*.py")):
        here = _room(".".join(path.relative_to(ROOT).with_suffix("").parts))
        for line, name in _imports(path):
            there = _room(name)
            if there != here and ROOMS.index(there) > ROOMS.index(here):
                wrong.append(f"{path.relative_to(ROOT)}:{line}: {here} imports {name} (a room above it)")
    assert wrong == []


def test_every_room_is_placed():
    rooms = {p.stem if p.is_file() else p.name for p in (ROOT / "pipeopt").iterdir()
             if (p.suffix == ".py" or (p / "__init__.py").exists())}
    assert rooms == set(ROOMS)


def test_the_callback_stays_thin_and_no_class_or_function_grows_past_its_size():
    """The sizes issue #14 set: the callback module under 200 lines, no class over 250, no function over 60."""
    assert len((ROOT / "pipeopt" / "callbacks" / "pipeopt.py").read_text().splitlines()) < 200
    too_big = []
    for path in sorted((ROOT / "pipeopt").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            limit = 250 if isinstance(node, ast.ClassDef) else 60 if isinstance(node, ast.FunctionDef) else None
            if limit is not None and node.end_lineno - node.lineno + 1 > limit:
                too_big.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}")
    assert too_big == []
