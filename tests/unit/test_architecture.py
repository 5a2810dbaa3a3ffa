"""The package's structure as tests (docs/architecture.md): the layer contracts in pyproject.toml
(import-linter), no import cycle among the modules, one door to the native module, and no module
or function too big to read."""
from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import grimp

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "kungfu"
MAX_MODULE_LINES = 700
MAX_FUNCTION_LINES = 80


def _sources():
    return sorted(PACKAGE.rglob("*.py"))


def test_the_layer_contracts_are_kept():
    lint = pathlib.Path(sys.executable).parent / "lint-imports"
    got = subprocess.run([str(lint), "--config", str(ROOT / "pyproject.toml")], cwd=ROOT,
                         capture_output=True, text=True)
    assert got.returncode == 0, got.stdout[-4000:] + got.stderr[-2000:]
    assert "0 broken" in got.stdout, got.stdout[-4000:]


def _cycles(edges):
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index, low, stack, on, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_cycles_are_found_where_they_are():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_among_the_modules():
    graph = grimp.build_graph("kungfu")
    edges = {m: set(graph.find_modules_directly_imported_by(m)) for m in graph.modules}
    cycles = _cycles(edges)
    details = []
    for component in cycles:
        for a in component:
            for b in sorted(edges[a] & set(component)):
                lines = [d["line_number"] for d in graph.get_import_details(importer=a,
                                                                             imported=b)]
                details.append(f"{a} -> {b} (lines {lines})")
    assert not cycles, "\n".join(details)


def _imports_native(tree: ast.AST) -> bool:
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (
                (node.module or "").endswith("_kungfu")
                or any(a.name == "_kungfu" for a in node.names)):
            return True
        if isinstance(node, ast.Import) and any(a.name.endswith("._kungfu") for a in node.names):
            return True
        if isinstance(node, ast.Constant) and node.value == "kungfu._kungfu":
            return True
    return False


def test_one_module_opens_the_native_module():
    openers = [p.relative_to(ROOT).as_posix() for p in _sources()
               if _imports_native(ast.parse(p.read_text()))]
    assert openers == ["kungfu/_native.py"]
    assert _imports_native(ast.parse("from kungfu import _kungfu"))
    assert not _imports_native(ast.parse("from kungfu import _native"))


def test_no_module_or_function_is_too_big():
    big = []
    for p in _sources():
        text = p.read_text()
        name = p.relative_to(ROOT).as_posix()
        if len(text.splitlines()) > MAX_MODULE_LINES:
            big.append(f"{name}: {len(text.splitlines())} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    big.append(f"{name}:{node.lineno} {node.name}: {length} lines")
    assert not big, f"over {MAX_MODULE_LINES} lines a module or {MAX_FUNCTION_LINES} a " \
                    f"function: " + "; ".join(big)


def test_the_version_is_stated_once_in_the_package_and_matches_pyproject():
    import tomllib

    import kungfu

    with open(ROOT / "pyproject.toml", "rb") as f:
        assert tomllib.load(f)["project"]["version"] == kungfu.__version__
