"""What the adaptation experiments share: running one job of _worker.py, the table cells, the
plots."""
from __future__ import annotations

import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Iterator, List

REPO = Path(__file__).resolve().parents[2]


def run_job(launcher: List[str], worker: List[str], env: dict, what: str) -> List[dict]:
    """`kungfu-run -q LAUNCHER... python _worker.py WORKER... --out FILE` with this repository's
    kungfu and the KUNGFU_* variables of `env` only; returns rank 0's records (JSON lines)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "rank0.jsonl"
        full = {k: v for k, v in os.environ.items() if not k.startswith("KUNGFU_")}
        full.update(PYTHONPATH=str(REPO), TF_CPP_MIN_LOG_LEVEL="3", OMP_NUM_THREADS="1")
        full.update(env)
        cmd = [sys.executable, "-m", "kungfu.cmd", "-q", "-timeout", "900s", *launcher,
               sys.executable, str(REPO / "benchmarks/adaptation/_worker.py"), *worker,
               "--out", str(out)]
        r = subprocess.run(cmd, capture_output=True, text=True, env=full, timeout=1000)
        if r.returncode != 0:
            log = Path(tempfile.mkstemp(prefix="kungfu-adaptation-", suffix=".log")[1])
            log.write_text(r.stdout + "\n--- stderr ---\n" + r.stderr)
            raise RuntimeError(f"{what} failed ({r.returncode}; its whole output: {log}):\n"
                               f"{r.stderr[-3000:]}")
        return [json.loads(line) for line in out.read_text().splitlines()]


@contextlib.contextmanager
def busy(n: int) -> Iterator[None]:
    """`n` processes spinning on a core each while the block runs: a machine loaded by others
    (the load average rises by about n)."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    try:
        yield
    finally:
        for p in procs:
            p.kill()
            p.wait()


def cell(vals, fmt: str = "{:.3f}") -> str:
    """median [min, max]"""
    return (fmt + " [" + fmt + ", " + fmt + "]").format(statistics.median(vals), min(vals),
                                                         max(vals))


def pyplot():
    """matplotlib.pyplot drawing to files, or None (and a line saying so) without matplotlib."""
    try:
        import matplotlib
    except ImportError:
        print("plots need matplotlib (pip install matplotlib); no plot drawn")
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save(fig, path: str) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot: {path}")
