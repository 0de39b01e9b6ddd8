"""Facts about the code as a whole: no import circles among our modules, no function longer
than a screen and a half, no formatter exemption on a call."""

from __future__ import annotations

import ast
import importlib
import io
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TREES = ("core", "engine", "stages", "kv", "models", "bench", "train", "tests", "scripts")
FILES = ("server.py", "api.py", "page.py", "infill.py", "client.py", "structured.py", "setup.py")
LONGEST = 80  # lines a function may take


def sources(root: Path = ROOT) -> dict[str, str]:
    """module name -> source, for every file of ours."""
    paths = [root / f for f in FILES if (root / f).exists()]
    paths += [p for tree in TREES for p in sorted((root / tree).rglob("*.py"))]
    return {_module(p.relative_to(root)): p.read_text() for p in paths}


def _module(path: Path) -> str:
    return ".".join(path.with_suffix("").parts).removesuffix(".__init__")


def imports(source: str, modules: set[str]) -> set[str]:
    """Our modules a source imports, at any depth (`from a import b` may import module a.b)."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
    return found & modules


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import graph's strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = [stack.pop()]
            while component[-1] != v:
                component.append(stack.pop())
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def long_functions(source: str) -> list[tuple[str, int]]:
    return [
        (node.name, node.end_lineno - node.lineno + 1)
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and node.end_lineno is not None
        and node.end_lineno - node.lineno + 1 > LONGEST
    ]


def skipped_calls(source: str) -> list[int]:
    """Lines where `# fmt: skip` keeps the formatter off a call (tables may keep their shape)."""
    marked = {
        token.start[0]
        for token in tokenize.generate_tokens(io.StringIO(source).readline)
        if token.type == tokenize.COMMENT and token.string.strip() == "# fmt: skip"
    }
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.stmt) and node.end_lineno in marked:
            value = getattr(node, "value", None)
            if isinstance(value, ast.Call) or isinstance(value, ast.Await):
                found.append(node.end_lineno)
    return found


def test_no_import_circles():
    files = sources()
    graph = {name: imports(source, set(files)) for name, source in files.items()}
    assert circles(graph) == []


def test_the_circle_check_finds_a_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert circles(graph) == [["a", "b", "c"]]
    assert imports("def f():\n    from a import b\n", {"a", "a.b"}) == {"a", "a.b"}


def test_no_function_is_longer_than_80_lines():
    found = [
        f"{name}: {function} ({lines} lines)"
        for name, source in sources().items()
        for function, lines in long_functions(source)
    ]
    assert found == []


def test_no_call_is_kept_from_the_formatter():
    found = [
        f"{name}:{line}" for name, source in sources().items() for line in skipped_calls(source)
    ]
    assert found == []


def test_the_checks_see_what_they_look_for():
    body = "\n".join(f"    x = {i}" for i in range(LONGEST))
    assert long_functions(f"def f():\n{body}\n") == [("f", LONGEST + 1)]
    assert skipped_calls("f(1,\n  2)  # fmt: skip\nx = (1,\n  2)  # fmt: skip\n") == [2]
    assert skipped_calls("y = g(1,\n      2)  # fmt: skip\n") == [2]


def test_every_tool_module_imports():
    """The benchmarks and training scripts are outside the type check: an import they lost
    (a renamed function) shows here rather than when someone next runs them."""
    tools = [name for name in sources() if name.split(".")[0] in ("bench", "train")]
    failed = []
    for name in tools:
        try:
            importlib.import_module(name)
        except ImportError as e:
            failed.append(f"{name}: {e}")
    assert failed == []
