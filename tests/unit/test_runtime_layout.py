"""The C++ runtime's structure as tests (docs/architecture.md, "The runtime's layers"): includes
that run down the layers declared in pyproject.toml, no include cycle, no file over 700 lines and
no function over 80, one format. scripts/runtime_layout.py holds the checks; each is also shown
to find what it is for, on a small tree of its own."""
from __future__ import annotations

import importlib.util
import pathlib
import textwrap

ROOT = pathlib.Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("runtime_layout", ROOT / "scripts" / "runtime_layout.py")
layout = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(layout)


def test_the_runtime_includes_run_down_its_layers():
    assert layout.layer_violations() == []


def test_every_runtime_file_is_in_a_layer_and_the_table_names_real_paths():
    table = layout.layer_table()
    assert [name for name, _ in table][:2] == ["base", "op"]
    for _, prefixes in table:
        for prefix in prefixes:
            assert (ROOT / prefix).exists(), prefix


def test_no_runtime_file_over_700_lines():
    assert layout.long_files(layout.sources()) == []


def test_no_runtime_function_over_80_lines():
    assert layout.long_functions(layout.sources()) == []


def test_the_runtime_is_formatted():
    assert layout.clang_format() is not None, "clang-format: scripts/install.sh installs it"
    assert layout.format_violations() == []


def _tree(tmp_path, files):
    for rel, text in files.items():
        p = tmp_path / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(textwrap.dedent(text))
    return sorted(p for p in tmp_path.rglob("*") if p.suffix in (".cc", ".h"))


_TABLE = """
[tool.kungfu.runtime-layers]
layers = [
  { name = "low", paths = ["srcs/go-free-runtime/include/kungfu/low.h"] },
  { name = "high", paths = ["srcs/go-free-runtime/include/kungfu/high.h", "srcs/go-free-runtime/src"] },
]
"""


def test_an_include_up_the_layers_and_a_cycle_are_found(tmp_path):
    paths = _tree(tmp_path, {
        "pyproject.toml": _TABLE,
        "srcs/go-free-runtime/include/kungfu/low.h": '#include "kungfu/high.h"\n',
        "srcs/go-free-runtime/include/kungfu/high.h": '#include "kungfu/low.h"\n',
        "srcs/go-free-runtime/src/a.h": '#include "b.h"\n',
        "srcs/go-free-runtime/src/b.h": '#include "a.h"\n',
        "srcs/go-free-runtime/src/ok.cc": '#include "kungfu/low.h"\n#include "kungfu/high.h"\n',
    })
    found = layout.layer_violations(tmp_path, paths)
    up = [v for v in found if "a layer above it" in v]
    assert up == ["srcs/go-free-runtime/include/kungfu/low.h (low) includes "
                  "srcs/go-free-runtime/include/kungfu/high.h (high), a layer above it"]
    loops = [v for v in found if v.startswith("include cycle")]
    assert any("src/a.h" in v and "src/b.h" in v for v in loops), found
    assert not any("ok.cc" in v for v in found)


def test_a_file_outside_every_layer_is_named(tmp_path):
    paths = _tree(tmp_path, {"pyproject.toml": _TABLE, "srcs/other/x.cc": "int x;\n"})
    assert layout.layer_violations(tmp_path, paths) == [
        "srcs/other/x.cc is in no layer of [tool.kungfu.runtime-layers]"]


_CODE = """\
namespace kungfu {
// a { in a comment
struct S {
  S(int x) : a_(x), b_{x} {
    a_ += 1;
  }
  int Get() const { return a_; }
  int a_, b_;
};
int Long(int n) {
  const char* s = "}{";
  auto f = [&](int k) {
    return k + 1;
  };
  return f(n);
}
enum class E { kA, kB };
}  // namespace kungfu
"""


def test_functions_are_measured_from_signature_to_closing_brace():
    got = {name: (first, count) for name, first, count in layout.functions(_CODE)}
    assert got == {"S": (4, 3), "Get": (7, 1), "Long": (10, 7)}


def test_a_long_function_and_a_long_file_are_found(tmp_path):
    body = "".join(f"  x += {i};\n" for i in range(85))
    paths = _tree(tmp_path, {"big.cc": "int F(int x) {\n" + body + "  return x;\n}\n" + "\n" * 650})
    assert layout.long_functions(paths) == [f"{paths[0]}:1 F is 88 lines (limit 80)"]
    assert layout.long_files(paths) == [f"{paths[0]} is 738 lines (limit 700)"]


def test_a_misformatted_file_is_found(tmp_path):
    paths = _tree(tmp_path, {"bad.cc": "int  F( int x ){return x;}\n", "good.cc": "int F(int x) { return x; }\n"})
    found = layout.format_violations(paths)
    assert len(found) == 1 and "bad.cc is not formatted" in found[0], found
