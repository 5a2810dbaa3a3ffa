"""Allreduce benchmark: a float32 size sweep and a model-shaped gradient set (ResNet50).

Run every worker under the launcher:

    kungfu-run -np 4 python benchmarks/allreduce.py                      # sweep + resnet50, AUTO
    kungfu-run -np 4 python benchmarks/allreduce.py --model resnet50 --strategy all --compare
    kungfu-run -np 2 python benchmarks/allreduce.py --sizes 4B..256MiB --factor 2 --iters 50

Rank 0 prints one JSON line per measurement on stdout, then tables. Each measurement: the
result is checked once against the exact expected sum (every worker, before any timing), then
warm-up calls, a barrier, and timed calls. An iteration's time is the slowest worker's time for
it; `time_s` is the median over the timed iterations. algbw = bytes / time,
busbw = algbw * 2(n-1)/n (the per-link traffic of a bandwidth-optimal allreduce).

--compare times torch.distributed's gloo backend in the same run, on the same workers, right
after kungfu on each case (never concurrently); --compare-first times it before kungfu instead.

--plot PNG (rank 0, needs matplotlib) draws the sweep's median time and busbw against the size,
log-log, one line per strategy (and gloo), one column per np, and the model case as bars of
time per implementation and mode. --from-json PATH... measures nothing: it prints the tables
(and --plot) of saved --json files, which may come from runs at different np.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import time
from typing import Callable, List, Optional, Sequence, Tuple

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
try:
    import kungfu as kf
except ImportError:  # run from a source checkout without installing
    sys.path.insert(0, os.path.dirname(HERE))
    import kungfu as kf
from kungfu import _env

if HERE not in sys.path:  # imported from elsewhere (a test): the helpers beside this file
    sys.path.insert(0, HERE)
from _common import read_json_lines  # noqa: E402
from _plot import pyplot, save  # noqa: E402

MODELS = {"resnet50": os.path.join(HERE, "resnet50_sizes.json")}
DEFAULT_SIZES = "4B..256MiB"
_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mb": 1 << 20,
          "mib": 1 << 20, "g": 1 << 30, "gb": 1 << 30, "gib": 1 << 30}


# ---------------------------------------------------------------------------------------------
# Arguments

def parse_bytes(text: str) -> int:
    """'4B', '64KiB', '1M', '256MiB', '4096' -> bytes (binary units)."""
    m = re.fullmatch(r"\s*(\d+)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"bad size {text!r} (examples: 4B, 64KiB, 256MiB)")
    return int(m.group(1)) * _UNITS[m.group(2).lower()]


def parse_sizes(spec: str, factor: int) -> List[int]:
    """'LO..HI' (every LO*factor^k up to HI) or a comma list; float32, so multiples of 4 B."""
    out: List[int] = []
    for part in spec.split(","):
        if ".." in part:
            lo, hi = (parse_bytes(p) for p in part.split("..", 1))
            if lo <= 0 or hi < lo:
                raise argparse.ArgumentTypeError(f"bad size range {part!r}")
            s = lo
            while s <= hi:
                out.append(s)
                s *= factor
        else:
            out.append(parse_bytes(part))
    for s in out:
        if s <= 0 or s % 4:
            raise argparse.ArgumentTypeError(f"size {s} B is not a positive multiple of 4 (float32)")
    return sorted(set(out))


def human_bytes(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale}{unit}"
    if n >= 1 << 20:
        return f"{n / (1 << 20):.1f}MiB"
    return f"{n}B"


def human_time(s: float) -> str:
    if s < 1e-3:
        return f"{s * 1e6:.0f}us"
    if s < 1.0:
        return f"{s * 1e3:.2f}ms"
    return f"{s:.3f}s"


def strategy_names() -> List[str]:
    from kungfu import _kungfu

    names, k = [], 0
    while True:
        name = _kungfu.strategy_name(k)
        if name == "UNKNOWN":
            return names
        names.append(name)
        k += 1


MODES = ("fused", "per-tensor", "fresh")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(
        description="kungfu allreduce benchmark (run each worker under kungfu-run)",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--sizes", default=None,
                    help=f"float32 buffer sizes: LO..HI stepping by --factor, or a comma list "
                         f"(default when neither --sizes nor --model is given: {DEFAULT_SIZES})")
    ap.add_argument("--factor", type=int, default=4, help="step of a LO..HI size range")
    ap.add_argument("--model", choices=sorted(MODELS), default=None,
                    help="allreduce a model's whole gradient set per iteration")
    ap.add_argument("--mode", default="both",
                    help="model case, a comma list of: fused (one buffer of all values), "
                         "per-tensor (one named async allreduce per tensor into a preallocated "
                         "out=, then wait all), fresh (the same without out=: what users write, "
                         "each result a new array); both = fused,per-tensor; all = every mode")
    ap.add_argument("--repeat", type=int, default=1,
                    help="model case: time every mode and strategy this many times, in turn "
                         "(interleaved arms; each round is its own JSON line)")
    ap.add_argument("--fuse", action="store_true", help="same as --mode fused")
    ap.add_argument("--api", choices=["numpy", "tf"], default="numpy",
                    help="model case through the numpy API, or through TensorFlow ops inside a "
                         "tf.function: fused is then ops.group_all_reduce over the tensors (one "
                         "op), per-tensor one ops.all_reduce per tensor")
    ap.add_argument("--strategy", default=None,
                    help="kungfu strategy: a name, a comma list, or 'all' (AUTO and every named "
                         "strategy); default: the cluster's default (KUNGFU_ALLREDUCE_STRATEGY)")
    ap.add_argument("--iters", type=int, default=20, help="timed iterations (at most)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed iterations before timing")
    ap.add_argument("--max-seconds", type=float, default=1.5,
                    help="fewer timed iterations (but at least --min-iters) when --iters would "
                         "take longer than this; 0 always runs --iters")
    ap.add_argument("--min-iters", type=int, default=3)
    ap.add_argument("--compare", action="store_true",
                    help="also time torch.distributed (gloo) on the same cases, in the same run")
    ap.add_argument("--compare-first", action="store_true",
                    help="with --compare: time gloo before kungfu on each case instead of after "
                         "(lets a driver alternate the order between runs)")
    ap.add_argument("--gloo-port", type=int, default=None,
                    help="gloo rendezvous port (default: first peer's port + 1000)")
    ap.add_argument("--no-table", action="store_true", help="JSON lines only")
    ap.add_argument("--json", default=None, metavar="PATH",
                    help="rank 0 also writes the JSON lines to PATH (without launcher prefixes)")
    ap.add_argument("--plot", default=None, metavar="PNG",
                    help="rank 0 draws time and busbw against size (and the model case as "
                         "bars) to PNG (needs matplotlib)")
    ap.add_argument("--from-json", nargs="+", default=None, metavar="PATH",
                    help="measure nothing: print the tables (and --plot) of these --json files "
                         "(no kungfu-run needed)")
    args = ap.parse_args(argv)
    if args.fuse:
        args.mode = "fused"
    args.modes = {"both": list(MODES[:2]), "all": list(MODES)}.get(
        args.mode, [m.strip() for m in args.mode.split(",")])
    if not args.modes or any(m not in MODES for m in args.modes):
        ap.error(f"--mode: choose from {', '.join(MODES)}, both or all (got {args.mode!r})")
    if args.api == "tf" and "fresh" in args.modes:
        ap.error("--api tf: TensorFlow always makes new output tensors; use per-tensor")
    if args.repeat < 1:
        ap.error("--repeat must be >= 1")
    if args.api == "tf" and args.sizes:
        ap.error("--api tf times the model case only: drop --sizes")
    if args.sizes is None and args.model is None:
        args.sizes = DEFAULT_SIZES if args.api == "numpy" else None
        args.model = "resnet50"
    if args.factor < 2:
        ap.error("--factor must be at least 2")
    try:
        args.size_list = parse_sizes(args.sizes, args.factor) if args.sizes else []
    except argparse.ArgumentTypeError as e:
        ap.error(str(e))
    if args.iters < 1 or args.warmup < 0 or args.min_iters < 1:
        ap.error("--iters and --min-iters must be >= 1, --warmup >= 0")
    return args


def resolve_strategies(spec: Optional[str]) -> List[Tuple[str, Optional[str]]]:
    """(label, strategy argument) pairs; None means the cluster's default."""
    if spec is None:
        return [(str(_env.ALLREDUCE_STRATEGY.get()).upper(), None)]
    known = strategy_names()
    if spec.lower() == "all":
        return [(n, n) for n in ["AUTO"] + [k for k in known if k != "AUTO"]]
    out = []
    for name in spec.split(","):
        up = name.strip().upper().replace("-", "_")
        if up not in known:
            raise SystemExit(f"unknown strategy {name!r} (choose from {', '.join(known)} or all)")
        out.append((up, up))
    return out


# ---------------------------------------------------------------------------------------------
# Data with an exactly known sum

def pattern(count: int, rank: int) -> np.ndarray:
    """Values that depend on position and rank; their sums over up to ~180 workers are exact
    in float32 (below 2**24), so results are compared for equality."""
    return ((np.arange(count, dtype=np.int64) % 251) + 1000 * rank).astype(np.float32)


def expected_sum(count: int, n: int) -> np.ndarray:
    return (n * (np.arange(count, dtype=np.int64) % 251) + 1000 * n * (n - 1) // 2).astype(np.float32)


def agree(ok: bool, what: str) -> None:
    """Every worker learns whether all passed; all stop together on a wrong result."""
    all_ok = kf.allreduce(np.int32(1 if ok else 0), op="min", name="bench:verify")
    if not all_ok:
        if kf.rank() == 0:
            print(f"WRONG RESULT: {what} (see the failing workers' stderr)", file=sys.stderr,
                  flush=True)
        raise SystemExit(1)


# ---------------------------------------------------------------------------------------------
# Timing

def measure(run: Callable[[], object], args) -> Tuple[np.ndarray, int]:
    """Warm-up, barrier, timed iterations. Returns per-iteration slowest-worker times."""
    t0 = time.perf_counter()
    for _ in range(args.warmup):
        run()
    per_call = (time.perf_counter() - t0) / args.warmup if args.warmup else 0.0
    iters = args.iters
    if args.max_seconds > 0 and args.warmup:
        slowest = float(kf.allreduce(np.float64(per_call), op="max", name="bench:plan"))
        if slowest * iters > args.max_seconds:
            iters = max(args.min_iters, int(args.max_seconds / max(slowest, 1e-9)))
    kf.barrier(name="bench:barrier")
    times = np.empty(iters, dtype=np.float64)
    for i in range(iters):
        t = time.perf_counter()
        run()
        times[i] = time.perf_counter() - t
    return kf.allreduce(times, op="max", name="bench:times"), iters


def record(impl: str, strategy: str, case: str, nbytes: int, times: np.ndarray, n: int,
           iters: int, warmup: int, **extra) -> dict:
    """One measurement (a JSON line) from its per-iteration slowest-worker times."""
    med = float(statistics.median(times))
    algbw = nbytes / med / 1e9 if med > 0 else 0.0
    return {"impl": impl, "strategy": strategy, "case": case, **extra, "bytes": nbytes,
            "dtype": "float32", "np": n, "iters": iters, "warmup": warmup,
            "time_s": med, "min_s": float(times.min()), "max_s": float(times.max()),
            "algbw_GBps": algbw, "busbw_GBps": algbw * 2 * (n - 1) / n}


class Reporter:
    def __init__(self, n: int, args):
        self.n = n
        self.args = args
        self.rows: List[dict] = []
        self.root = kf.rank() == 0
        self.file = open(args.json, "w") if (self.root and args.json) else None

    def add(self, impl: str, strategy: str, case: str, nbytes: int, times: np.ndarray,
            iters: int, **extra) -> None:
        row = record(impl, strategy, case, nbytes, times, self.n, iters, self.args.warmup,
                     **extra)
        self.rows.append(row)
        if self.root:
            line = json.dumps(row)
            print(line, flush=True)
            if self.file is not None:
                self.file.write(line + "\n")
                self.file.flush()



def tables(rows: List[dict]) -> str:
    """The text tables of `rows`, one set per np (a single run has one np)."""
    return "".join(tables_at(n, [r for r in rows if r["np"] == n])
                   for n in sorted({r["np"] for r in rows}))


def tables_at(n: int, rows: List[dict]) -> str:
    """The sweep's time and busbw tables and the model case's table, of measurements at np=n."""
    out = []
    sweep = [r for r in rows if r["case"] == "sweep"]
    if sweep:
        def col(r):
            return f"{r['impl']}:{r['strategy']}" + (f":{r['mode']}" if "mode" in r else "")

        cols = list(dict.fromkeys(col(r) for r in sweep))
        sizes = sorted({r["bytes"] for r in sweep})
        cell = {(r["bytes"], col(r)): r for r in sweep}
        for title, fmt in (("time (median)", lambda r: human_time(r["time_s"])),
                           ("busbw GB/s", lambda r: f"{r['busbw_GBps']:.3f}")):
            out.append(f"\nallreduce float32 sum, np={n}: {title}")
            body = [[human_bytes(s)] + [fmt(cell[(s, c)]) if (s, c) in cell else "-"
                                        for c in cols] for s in sizes]
            out.append(_grid(["size"] + cols, body))
    model = [r for r in rows if r["case"] != "sweep"]
    if model:
        modes = list(dict.fromkeys(r["mode"] for r in model))
        keys = list(dict.fromkeys((r["case"], r["impl"], r["strategy"]) for r in model))
        cell, rounds = {}, {}
        for r in model:  # with --repeat, a cell lists every round's median
            key = (r["case"], r["impl"], r["strategy"], r["mode"])
            cell[key] = r
            rounds.setdefault(key, []).append(f"{r['time_s'] * 1e3:.1f}")
        body = []
        for case, impl, strat in keys:
            line = [case, impl, strat]
            for m in modes:
                line.append(" / ".join(rounds.get((case, impl, strat, m), ["-"])))
            r = cell.get((case, impl, strat, "fused"))
            line.append(f"{r['busbw_GBps']:.3f}" if r else "-")
            body.append(line)
        first = model[0]
        out.append(f"\nmodel gradient set per iteration, np={n} "
                   f"({first['tensors']} tensors, {first['bytes'] / 1e6:.1f} MB float32): "
                   f"ms (median)")
        out.append(_grid(["model", "impl", "strategy"] + [f"{m} ms" for m in modes]
                         + ["fused busbw GB/s"], body))
    return "\n".join(out)


def _grid(head: Sequence[str], body: Sequence[Sequence[str]]) -> str:
    widths = [max(len(str(x)) for x in col) for col in zip(head, *body)]
    lines = ["  ".join(str(h).rjust(w) for h, w in zip(head, widths)),
             "  ".join("-" * w for w in widths)]
    lines += ["  ".join(str(x).rjust(w) for x, w in zip(row, widths)) for row in body]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Plots (--plot)

def series(r: dict) -> str:
    """A line's (or bar's) legend label: the implementation, and kungfu's strategy."""
    return "gloo" if r["impl"] == "gloo" else f"kungfu {r['strategy']}"


def plot(rows: List[dict], path: str) -> None:
    """One PNG of the measurements: for the sweep, a column per np with median time (top) and
    busbw (bottom) against size, log-log, a line per series with the min..max range shaded; for
    the model case, a panel of bars on the right."""
    if not rows:
        raise SystemExit("--plot: no measurements to draw")
    plt = pyplot()
    sweep = [r for r in rows if r["case"] == "sweep"]
    model = [r for r in rows if r["case"] != "sweep"]
    nps = sorted({r["np"] for r in sweep})
    cols = len(nps) + (1 if model else 0)
    fig = plt.figure(figsize=(5.2 * cols, 7.2 if sweep else 4.2))
    grid = fig.add_gridspec(2 if sweep else 1, cols)
    colors = {s: f"C{i}" for i, s in enumerate(dict.fromkeys(series(r) for r in rows))}
    for j, n in enumerate(nps):
        at_n = [r for r in sweep if r["np"] == n]
        plot_sweep(fig.add_subplot(grid[0, j]), fig.add_subplot(grid[1, j]), at_n, n, colors)
    if model:
        plot_model(fig.add_subplot(grid[:, -1]), model, colors)
    save(fig, path)


def plot_sweep(ax_time, ax_bw, rows: List[dict], n: int, colors: dict) -> None:
    """Median time and busbw against size at one np, a line per series."""
    for label in dict.fromkeys(series(r) for r in rows):
        got = sorted((r for r in rows if series(r) == label), key=lambda r: r["bytes"])
        x = [r["bytes"] for r in got]
        kw = dict(color=colors[label], marker="o", markersize=3, label=label)
        ax_time.plot(x, [r["time_s"] for r in got], **kw)
        ax_time.fill_between(x, [r["min_s"] for r in got], [r["max_s"] for r in got],
                             color=colors[label], alpha=0.15, linewidth=0)
        ax_bw.plot(x, [r["busbw_GBps"] for r in got], **kw)
    sizes = sorted({r["bytes"] for r in rows})
    ticks = sizes[::max(1, -(-len(sizes) // 8))]
    for ax in (ax_time, ax_bw):
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xticks(ticks, [human_bytes(b) for b in ticks])
        ax.minorticks_off()
        ax.grid(alpha=0.3, which="both")
        ax.set_xlabel("message size (float32 buffer)")
    ax_time.set_title(f"allreduce sum, np={n}")
    ax_time.set_ylabel("time per allreduce (s, median; range shaded)")
    ax_bw.set_ylabel("bus bandwidth (GB/s, busbw)")
    ax_time.legend(fontsize=8)


def plot_model(ax, rows: List[dict], colors: dict) -> None:
    """The model case: median time per series (and np, if several) and mode, min..max whiskers;
    bars of one series share its colour, per-tensor hatched."""
    several = len({r["np"] for r in rows}) > 1
    groups = list(dict.fromkeys((r["np"], series(r)) for r in rows))
    modes = list(dict.fromkeys(r["mode"] for r in rows))
    cell = {(r["np"], series(r), r["mode"]): r for r in rows}
    width = 0.8 / len(modes)
    for k, mode in enumerate(modes):
        for i, (n, label) in enumerate(groups):
            r = cell.get((n, label, mode))
            if r is None:
                continue
            ms = r["time_s"] * 1e3
            ax.bar(i + (k - (len(modes) - 1) / 2) * width, ms, width, color=colors[label],
                   hatch="//" if mode == "per-tensor" else None, edgecolor="black",
                   yerr=[[ms - r["min_s"] * 1e3], [r["max_s"] * 1e3 - ms]], capsize=3,
                   label=mode if i == 0 else None)
    ax.set_xticks(range(len(groups)),
                  [f"np={n} {label}" if several else label for n, label in groups],
                  rotation=30, ha="right")
    first = rows[0]
    ax.set_title(f"{first['case']} gradient set: {first['tensors']} tensors, "
                 f"{first['bytes'] / 1e6:.1f} MB" + ("" if several else f", np={first['np']}"))
    ax.set_ylabel("time per iteration (ms, median; whiskers min..max)")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8)


# ---------------------------------------------------------------------------------------------
# Cases

def kungfu_buffer(x: np.ndarray, out: np.ndarray, label: str, strategy: Optional[str],
                  tag: str) -> Callable:
    """One allreduce of x into the preallocated `out` per call (gloo, too, allocates nothing)."""
    name = f"bench:{tag}:{label}"
    return lambda: kf.allreduce(x, op="sum", name=name, strategy=strategy, out=out)


def kungfu_per_tensor(views: List[np.ndarray], outs: Optional[List[np.ndarray]], label: str,
                      strategy: Optional[str]) -> Callable:
    """An async allreduce per tensor (distinct names), then a wait on every handle. outs=None:
    no out= (each result a new array, as users write it); the run returns the results."""
    names = [f"bench:pt:{label}:{j}" for j in range(len(views))]
    if outs is None:
        return lambda: [h.wait() for h in [
            kf.allreduce_async(v, op="sum", name=nm, strategy=strategy)
            for v, nm in zip(views, names)]]

    def run():
        handles = [kf.allreduce_async(v, op="sum", name=nm, strategy=strategy, out=o)
                   for v, o, nm in zip(views, outs, names)]
        return [h.wait() for h in handles]

    return run


def tf_model_cases(views: List[np.ndarray], label: str, strategy: Optional[str]) -> dict:
    """The model case through TensorFlow: {mode: run}, each run returning the reduced tensors."""
    import tensorflow as tf

    from kungfu.tensorflow import ops

    inputs = [tf.constant(v) for v in views]

    @tf.function(autograph=False)
    def grouped(ts):
        return ops.group_all_reduce(ts, name=f"bench:tfg:{label}", strategy=strategy)

    @tf.function(autograph=False)
    def per_tensor(ts):
        return [ops.all_reduce(t, name=f"bench:tfpt:{label}:{j}", strategy=strategy)
                for j, t in enumerate(ts)]

    return {"fused": lambda: grouped(inputs), "per-tensor": lambda: per_tensor(inputs)}


def run_sweep(args, strategies, rep: Reporter, gloo) -> None:
    n, r = kf.size(), kf.rank()
    for nbytes in args.size_list:
        count = nbytes // 4
        x = pattern(count, r)
        want = expected_sum(count, n)
        out = np.empty_like(x)
        if gloo is not None and args.compare_first:
            sweep_gloo(gloo, x, want, count, nbytes, args, rep)
        for label, strat in strategies:
            run = kungfu_buffer(x, out, label, strat, f"sweep:{nbytes}")
            out.fill(-1)
            run()
            agree(np.array_equal(out, want), f"kungfu {label} allreduce of {nbytes} B")
            times, iters = measure(run, args)
            rep.add("kungfu", label, "sweep", nbytes, times, iters, count=count)
            if "fresh" in args.modes:  # the same without out=: each result a new array
                name = f"bench:sweep-fresh:{nbytes}:{label}"
                fresh = lambda: kf.allreduce(x, op="sum", name=name, strategy=strat)  # noqa: E731
                agree(np.array_equal(fresh(), want), f"kungfu {label} fresh allreduce of {nbytes} B")
                times, iters = measure(fresh, args)
                rep.add("kungfu", label, "sweep", nbytes, times, iters, count=count, mode="fresh")
        if gloo is not None and not args.compare_first:
            sweep_gloo(gloo, x, want, count, nbytes, args, rep)
        del x, want, out


def sweep_gloo(gloo, x, want, count, nbytes, args, rep: Reporter) -> None:
    t = gloo.tensor(x.copy())
    gloo.fused(t)()
    agree(np.array_equal(t.numpy(), want), f"gloo allreduce of {nbytes} B")
    del t
    # Timed on zeros: in place, repeated sums of the pattern would grow without bound.
    zeros = gloo.torch.zeros(count, dtype=gloo.torch.float32)
    times, iters = measure(gloo.fused(zeros), args)
    rep.add("gloo", "gloo", "sweep", nbytes, times, iters, count=count)
    del zeros


def load_model(name: str) -> dict:
    with open(MODELS[name]) as f:
        doc = json.load(f)
    sizes = [t["size"] for t in doc["tensors"]]
    if len(sizes) != doc["count"] or sum(sizes) != doc["total"]:
        raise SystemExit(f"{MODELS[name]} is inconsistent (count/total); regenerate it")
    return doc


def split_views(flat: np.ndarray, tensors: List[dict]) -> List[np.ndarray]:
    views, off = [], 0
    for t in tensors:
        views.append(flat[off:off + t["size"]].reshape(t["shape"]))
        off += t["size"]
    return views


def run_model(args, strategies, rep: Reporter, gloo) -> None:
    n, r = kf.size(), kf.rank()
    doc = load_model(args.model)
    total, tensors = doc["total"], doc["tensors"]
    nbytes = 4 * total
    x = pattern(total, r)
    want = expected_sum(total, n)
    views = split_views(x, tensors)
    out = np.empty_like(x)
    outs = split_views(out, tensors)
    modes = args.modes
    extra = dict(tensors=len(tensors), api=args.api)
    gloo_modes = [m for m in modes if m != "fresh"]  # gloo reduces its tensors in place
    tf_cases = {label: tf_model_cases(views, label, strat) if args.api == "tf" else {}
                for label, strat in strategies}
    for _ in range(args.repeat):
        if gloo is not None and args.compare_first:
            model_gloo(gloo, x, want, tensors, gloo_modes, args, rep)
        for label, strat in strategies:
            for mode in modes:
                if args.api == "tf":
                    run = tf_cases[label][mode]
                    got = np.concatenate([t.numpy().ravel() for t in run()])
                elif mode == "fresh":
                    run = kungfu_per_tensor(views, None, label, strat)
                    got = np.concatenate([t.ravel() for t in run()])
                else:
                    run = (kungfu_buffer(x, out, label, strat, f"fused:{args.model}")
                           if mode == "fused" else kungfu_per_tensor(views, outs, label, strat))
                    out.fill(-1)
                    run()
                    got = out
                agree(np.array_equal(got, want), f"kungfu {label} {args.model} {mode}")
                del got
                times, iters = measure(run, args)
                rep.add("kungfu", label, args.model, nbytes, times, iters, mode=mode, **extra)
        if gloo is not None and not args.compare_first:
            model_gloo(gloo, x, want, tensors, gloo_modes, args, rep)


def model_gloo(gloo, x, want, tensors, modes, args, rep: Reporter) -> None:
    torch = gloo.torch
    total, nbytes, extra = x.size, 4 * x.size, dict(tensors=len(tensors))
    for mode in modes:
        t = gloo.tensor(x.copy())
        tviews = list(torch.split(t, [tt["size"] for tt in tensors]))
        (gloo.fused(t) if mode == "fused" else gloo.per_tensor(tviews))()
        agree(np.array_equal(t.numpy(), want), f"gloo {args.model} {mode}")
        del t, tviews
        zeros = torch.zeros(total, dtype=torch.float32)
        zviews = list(torch.split(zeros, [tt["size"] for tt in tensors]))
        run = gloo.fused(zeros) if mode == "fused" else gloo.per_tensor(zviews)
        times, iters = measure(run, args)
        rep.add("gloo", "gloo", args.model, nbytes, times, iters, mode=mode, **extra)
        del zeros, zviews


def start_gloo(args):
    from _gloo import Gloo, port_from_peers

    ident_peers = [p for p in (_env.INIT_PEERS.get() or "").split(",") if p]
    hosts = [p.rsplit(":", 1)[0] for p in ident_peers] or ["127.0.0.1"]
    port = args.gloo_port or port_from_peers(ident_peers)
    if port is None:  # a lone worker started without kungfu-run
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    return Gloo(kf.rank(), kf.size(), hosts[0], port, hosts)


def replot(args) -> int:
    """--from-json: the tables (and --plot) of saved runs, without measuring."""
    rows = [r for path in args.from_json for r in read_json_lines(path)]
    print(tables(rows).lstrip("\n"))
    if args.plot:
        plot(rows, args.plot)
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.plot:
        pyplot()  # without matplotlib, every worker stops before measuring
    if args.from_json:
        return replot(args)
    if args.compare:
        from _gloo import load

        if load() is None:
            # Every worker says it: the launcher may stop rank 0 before it can.
            print("--compare needs torch (torch.distributed with the gloo backend), which is "
                  "not importable here; install it or run without --compare",
                  file=sys.stderr, flush=True)
            return 2
    strategies = resolve_strategies(args.strategy)
    kf.init()
    n = kf.size()
    gloo = start_gloo(args) if args.compare else None
    rep = Reporter(n, args)
    t0 = time.perf_counter()
    try:
        if args.size_list:
            run_sweep(args, strategies, rep, gloo)
        if args.model:
            run_model(args, strategies, rep, gloo)
    finally:
        if gloo is not None:
            gloo.close()
    kf.barrier(name="bench:end")
    if kf.rank() == 0 and not args.no_table:
        head = f"np={n}, strategies: {', '.join(l for l, _ in strategies)}"
        if gloo is not None:
            head += f"; gloo: torch {gloo.version}"
        print(f"\n# {head}; total {time.perf_counter() - t0:.1f}s{tables(rep.rows)}", flush=True)
    if kf.rank() == 0 and args.plot:
        plot(rep.rows, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
