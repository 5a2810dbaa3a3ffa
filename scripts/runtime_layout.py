"""The C++ runtime's rules, read off the sources (docs/architecture.md, "The runtime's layers"):
includes that run one way through the layers declared in pyproject.toml
([tool.kungfu.runtime-layers]), no include cycle, no file over 700 lines, no function over 80,
and one format (clang-format with the project's .clang-format).

`python scripts/runtime_layout.py` prints every violation and exits 1 if there is one;
tests/unit/test_runtime_layout.py runs the same checks in CI."""
from __future__ import annotations

import pathlib
import re
import shutil
import subprocess
import sys
import tomllib

ROOT = pathlib.Path(__file__).resolve().parents[1]
SOURCES = ("srcs",)
MAX_FILE_LINES = 700
MAX_FUNCTION_LINES = 80
_CONTAINERS = re.compile(r"\b(namespace|class|struct|union|enum)\b|extern\s+\"C\"")


def sources(root: pathlib.Path = ROOT) -> list[pathlib.Path]:
    found = []
    for top in SOURCES:
        found += [p for p in (root / top).rglob("*") if p.suffix in (".cc", ".h")]
    return sorted(found)


def strip(text: str) -> str:
    """`text` with comments, string and character literals blanked (newlines kept)."""
    out, i, n = [], 0, len(text)
    while i < n:
        c = text[i]
        if text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            out.append(" " * (j - i))
            i = j
        elif text.startswith("/*", i):
            j = text.find("*/", i + 2)
            j = n if j < 0 else j + 2
            out.append(re.sub(r"[^\n]", " ", text[i:j]))
            i = j
        elif text.startswith('R"', i) and (i == 0 or not text[i - 1].isalnum()):
            m = re.match(r'R"([^(]*)\(', text[i:])
            end = text.find(")" + m.group(1) + '"', i) if m else -1
            j = n if end < 0 else end + len(m.group(1)) + 2
            out.append(re.sub(r"[^\n]", " ", text[i:j]))
            i = j
        elif c in "\"'" and not (c == "'" and i > 0 and text[i - 1].isalnum()):
            j = i + 1
            while j < n and text[j] != c and text[j] != "\n":
                j += 2 if text[j] == "\\" else 1
            out.append(" " * (min(j + 1, n) - i))
            i = j + 1
        else:
            out.append(c)
            i += 1
    return "".join(out)


_FUNCTION_HEAD_END = re.compile(
    r"(\)|\bconst|\boverride|\bnoexcept|\bfinal|\bmutable|\}|->\s*[\w:<>,\s*&]+)\s*$")


def functions(text: str) -> list[tuple[str, int, int]]:
    """(name, first line, line count) of every function body at namespace or class level (a
    lambda or a block inside a function is part of that function)."""
    code = strip(text)
    found, stack, start = [], [], 0  # stack: "container", "other" or (name, first line)
    for i, c in enumerate(code):
        at_top = all(k == "container" for k in stack)
        if c == ";" and at_top:
            start = i + 1
        elif c == "{":
            head = code[start:i]
            if not at_top:
                stack.append("other")
            elif "(" in head and _FUNCTION_HEAD_END.search(head) and not _CONTAINERS.search(
                    head.split("(")[0]) and not head.lstrip().startswith("#"):
                names = re.findall(r"([~\w:]+)\s*\(", head)
                lead = len(head) - len(head.lstrip())
                first = code.count("\n", 0, start + lead) + 1
                stack.append((names[0] if names else "?", first))
            elif _CONTAINERS.search(head) or not head.strip() or head.strip().endswith(":"):
                stack.append("container")
            else:
                stack.append("other")  # an initializer
            if stack[-1] == "container":
                start = i + 1
        elif c == "}" and stack:
            top = stack.pop()
            if isinstance(top, tuple):
                found.append((top[0], top[1], code.count("\n", 0, i) + 2 - top[1]))
            if top != "other" and all(k == "container" for k in stack):
                start = i + 1
    return found


def _shown(p: pathlib.Path) -> str:
    return str(p.relative_to(ROOT)) if p.is_relative_to(ROOT) else str(p)


def long_functions(paths, limit: int = MAX_FUNCTION_LINES) -> list[str]:
    out = []
    for p in paths:
        for name, first, count in functions(p.read_text()):
            if count > limit:
                out.append(f"{_shown(p)}:{first} {name} is {count} lines (limit {limit})")
    return out


def long_files(paths, limit: int = MAX_FILE_LINES) -> list[str]:
    out = []
    for p in paths:
        count = len(p.read_text().splitlines())
        if count > limit:
            out.append(f"{_shown(p)} is {count} lines (limit {limit})")
    return out


def layer_table(root: pathlib.Path = ROOT) -> list[tuple[str, list[str]]]:
    """The layers, lowest first, as (name, [path prefixes])."""
    table = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["kungfu"]["runtime-layers"]
    return [(layer["name"], layer["paths"]) for layer in table["layers"]]


def _layer_of(rel: str, table) -> int | None:
    best, index = -1, None
    for k, (_, prefixes) in enumerate(table):
        for prefix in prefixes:
            if (rel == prefix or rel.startswith(prefix.rstrip("/") + "/")) and len(prefix) > best:
                best, index = len(prefix), k
    return index


_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)
_INCLUDE_DIRS = ("srcs/go-free-runtime/include", "srcs/go-free-runtime/src", "srcs/cpp")


def includes(root: pathlib.Path, paths) -> dict[str, list[str]]:
    """Project-relative path -> the project files it includes (quoted includes that resolve)."""
    graph = {}
    for p in paths:
        rel = str(p.relative_to(root))
        targets = []
        for name in _INCLUDE.findall(p.read_text()):
            for base in (str(p.parent.relative_to(root)),) + _INCLUDE_DIRS:
                candidate = root / base / name
                if candidate.is_file():
                    targets.append(str(candidate.resolve().relative_to(root.resolve())))
                    break
        graph[rel] = targets
    return graph


def layer_violations(root: pathlib.Path = ROOT, paths=None) -> list[str]:
    paths = sources(root) if paths is None else paths
    table, out = layer_table(root), []
    graph = includes(root, paths)
    for rel, targets in sorted(graph.items()):
        mine = _layer_of(rel, table)
        if mine is None:
            out.append(f"{rel} is in no layer of [tool.kungfu.runtime-layers]")
            continue
        for t in targets:
            theirs = _layer_of(t, table)
            if theirs is not None and theirs > mine:
                out.append(f"{rel} ({table[mine][0]}) includes {t} ({table[theirs][0]}), "
                           "a layer above it")
    return out + [f"include cycle: {' -> '.join(c)}" for c in cycles(graph)]


def cycles(graph: dict[str, list[str]]) -> list[list[str]]:
    """Include cycles (a file's own header including it back counts)."""
    seen, found = {}, []

    def visit(v, path):
        seen[v] = 1
        for w in graph.get(v, ()):
            if seen.get(w) == 1:
                found.append(path[path.index(w):] + [w])
            elif w not in seen:
                visit(w, path + [w])
        seen[v] = 2

    for v in sorted(graph):
        if v not in seen:
            visit(v, [v])
    return found


def clang_format() -> str | None:
    """The clang-format the checks use: the PyPI wheel's in this Python's environment (pinned in
    scripts/install.sh, so every machine formats alike), else one on PATH."""
    here = pathlib.Path(sys.executable).parent / "clang-format"
    return str(here) if here.exists() else shutil.which("clang-format")


def format_violations(paths=None) -> list[str]:
    tool = clang_format()
    if tool is None:
        return ["clang-format not found (scripts/install.sh installs it)"]
    paths = sources() if paths is None else paths
    got = subprocess.run([tool, "--dry-run", "--Werror", f"--style=file:{ROOT / '.clang-format'}",
                          *map(str, paths)], capture_output=True, text=True)
    if got.returncode == 0:
        return []
    files = sorted(set(re.findall(r"^(\S+?):\d+:\d+: error", got.stderr, re.M)))
    return [f"{f} is not formatted (run: {tool} --style=file:.clang-format -i {f})"
            for f in files] or [got.stderr[-2000:]]


def main() -> int:
    paths = sources()
    problems = (layer_violations(ROOT, paths) + long_files(paths) + long_functions(paths)
                + format_violations(paths))
    for line in problems:
        print(line)
    print(f"{len(paths)} files: {len(problems)} problems")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
