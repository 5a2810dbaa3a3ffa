"""Which of kungfu's modules a resize request crosses, on the deciding worker.

    python benchmarks/resize_path.py [--tree DIR]

Runs `kungfu-run -w -np 1 -H 127.0.0.1:2` with tests/integration/elastic_train.py (a policy asks
for 2 workers) under a profiler that records, on rank 0, every call that crosses from one kungfu
module into another while a resize-related function is on the stack (kf.resize, the round's
agreement, the membership's apply/switch/sync), from the policy's kf.resize call until the
switch refreshes the trainer's sizes. Prints the modules crossed, the distinct crossings, and
those that go up the layers of docs/architecture.md (a lower layer calling a higher one: only
through an interface such as kungfu.elastic.Trainer, never an import). `--tree` measures another
checkout of kungfu (with its native modules built or linked in place).
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import socket
import subprocess
import sys
import tempfile

REPO = pathlib.Path(__file__).resolve().parents[1]

_PROFILER = r'''
import json, os, sys
RESIZE = {"resize", "apply_resize", "apply_elastic", "_switch", "_sync", "_check_pending",
          "_apply_resize", "_apply_elastic", "_resize", "before_agree", "agree",
          "_agree_and_apply"}
state = {"on": False, "moves": [], "done": False}
def _rel(fn):
    i = fn.rfind("/kungfu/")
    return fn[i + 1:] if i >= 0 and "/tests/" not in fn else None
def _inside(frame):
    for _ in range(60):
        if frame is None:
            return False
        if frame.f_code.co_name in RESIZE:
            return True
        frame = frame.f_back
    return False
def prof(frame, event, arg):
    if state["done"] or event != "call":
        return
    code = frame.f_code
    here = _rel(code.co_filename)
    if here is None:
        return
    if not state["on"]:
        if code.co_name != "resize" or not ("elastic" in here or "policy" in here):
            return
        state["on"] = True
    caller = frame.f_back
    there = _rel(caller.f_code.co_filename) if caller else None
    if there != here and _inside(frame):
        state["moves"].append([there, here, code.co_name])
    if code.co_name == "refresh_sizes" and caller and caller.f_code.co_name == "_switch":
        state["done"] = True
        with open(os.environ["KF_TRACE_OUT"], "w") as f:
            json.dump(state["moves"], f)
if os.environ.get("KUNGFU_ELASTIC_JOINING") != "1":
    sys.setprofile(prof)
'''


def layer(path: str) -> float:
    """The layer of docs/architecture.md a module is in (higher: nearer the user)."""
    parts = path.split("/")
    if path == "kungfu/__init__.py":
        return 6
    top = parts[1] if len(parts) > 2 else parts[1][:-3]
    return {"tensorflow": 5, "python": 4.5, "policy": 4, "elastic": 3, "_strategy": 2,
            "_collective": 2, "_process_set": 2, "_peer": 2}.get(top, 1)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tree", default=str(REPO), help="the kungfu checkout to measure")
    args = p.parse_args()
    tree = pathlib.Path(args.tree).resolve()
    with tempfile.TemporaryDirectory() as tmp:
        (pathlib.Path(tmp) / "sitecustomize.py").write_text(_PROFILER)
        out = os.path.join(tmp, "moves.json")
        env = dict(os.environ, KF_TRACE_OUT=out, PYTHONPATH=f"{tmp}:{tree}",
                   TF_CPP_MIN_LOG_LEVEL="3")
        base = free_port()
        cmd = [sys.executable, "-m", "kungfu.cmd", "-w", "-np", "1", "-H", "127.0.0.1:2",
               "-builtin-config-port", str(free_port()), "-port-range", f"{base}-{base + 1}",
               sys.executable, str(tree / "tests/integration/elastic_train.py"), "--schedule",
               "2", "--out", os.path.join(tmp, "records")]
        os.mkdir(os.path.join(tmp, "records"))
        run = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=300)
        if run.returncode != 0:
            sys.stderr.write(run.stdout[-3000:] + run.stderr[-3000:])
            return run.returncode
        moves = json.load(open(out))
    files = sorted({m[1] for m in moves} | {m[0] for m in moves if m[0]})
    crossings = {(m[0] or "(caller)", m[1]) for m in moves}
    up = sorted({(m[0], m[1], m[2]) for m in moves if m[0] and layer(m[1]) > layer(m[0])})
    print(json.dumps({"tree": str(tree), "modules": len(files), "crossings": len(crossings),
                      "upward_calls": len(up)}))
    for f in files:
        print("  module", f)
    for a, b, fn in up:
        print(f"  up     {a} -> {b}.{fn}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
