"""The layering: each layer imports only the layers below it (server/api/client -> engine ->
stages -> models -> kv; core, the plain shared types, below all but kv, which needs nothing
of ours), imports inside functions included."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# layer: the layers of ours it may import (itself always)
ALLOWED = {
    "core": set(),
    "kv": set(),
    "models": {"core", "kv"},
    "stages": {"core", "models", "kv"},
    "engine": {"core", "stages", "models", "kv"},
}
OURS = {
    "core",
    "kv",
    "models",
    "stages",
    "engine",
    "api",
    "page",
    "infill",
    "server",
    "client",
    "train",
    "bench",
    "tests",
}


def imported_modules(source: str) -> set[str]:
    """Every absolute module a file imports, at any depth of the file."""
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
    return names


def crossings(root: Path) -> set[tuple[str, str]]:
    """(file, module) for each import of a layer that the file's layer may not import."""
    found = set()
    for layer, allowed in ALLOWED.items():
        for path in sorted((root / layer).rglob("*.py")):
            for module in imported_modules(path.read_text()):
                top = module.split(".")[0]
                if top in OURS and top != layer and top not in allowed:
                    found.add((path.relative_to(root).as_posix(), module))
    return found


def test_each_layer_imports_only_the_layers_below_it():
    assert crossings(ROOT) == set()


def test_the_check_sees_a_crossing_inside_a_function(tmp_path):
    (tmp_path / "kv").mkdir()
    (tmp_path / "kv" / "pages.py").write_text("def f():\n    from engine.config import X\n")
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "llama.py").write_text("import kv.pages\nimport stages.pack\n")
    (tmp_path / "core").mkdir()
    (tmp_path / "core" / "step.py").write_text("from kv.table import PageTable\n")
    assert crossings(tmp_path) == {
        ("kv/pages.py", "engine.config"),
        ("models/llama.py", "stages.pack"),
        ("core/step.py", "kv.table"),
    }


def test_no_test_module_imports_another():
    """Shared test code lives in helper modules (tests/*.py not named test_*) and conftest."""
    found = set()
    for path in sorted((ROOT / "tests").rglob("test_*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            found |= {
                (path.relative_to(ROOT).as_posix(), name)
                for name in names
                if name.startswith("tests.") and name.split(".")[-1].startswith("test_")
            }
    assert found == set()
