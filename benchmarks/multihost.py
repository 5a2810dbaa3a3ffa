"""Allreduce across "hosts": network namespaces joined by veth pairs, one kungfu-run in each.

    python benchmarks/multihost.py                        # 2 hosts x 2 workers, no rate limit
    python benchmarks/multihost.py --rate 10gbit          # every host link shaped to 10 Gbit/s
    python benchmarks/multihost.py --hosts 3 --workers-per-host 1,2,1 --delay 0.1ms

Needs root and iproute2 (`ip`; `tc` for --rate/--delay). The network it builds:

    namespace PREFIX0 (10.201.0.1, kfv0) --veth-- kfp0 \\
    namespace PREFIX1 (10.201.0.2, kfv1) --veth-- kfp1 -- bridge kfbr in namespace PREFIXsw
    ...                                                /

Each host's link is one veth pair to a bridge in a namespace of its own (a switch), so every
host reaches every other one through its own link only. --rate puts a token bucket (tc tbf) on
both ends of every link (the host's egress and the switch's egress towards the host), so each
host link carries at most RATE in each direction; --delay adds a netem delay on both ends too
(a packet between two hosts crosses two links: one-way +2 x DELAY, round trip +4 x DELAY).
Namespace and interface names are fixed (change them with --prefix): a run refuses to start
when one of its namespaces exists already, and always deletes the ones it made, after stopping
every process in them, on success, failure, Ctrl-C or SIGTERM.

What runs: per repeat, one `kungfu-run -H ip0:n0,ip1:n1,... -self ipI` per namespace executing
benchmarks/allreduce.py on the ResNet50 gradient set (214 float32 tensors, 102.3 MB), fused
(one buffer) and per-tensor (one async allreduce per tensor, then wait all), for every strategy
of --strategies, and torch.distributed's gloo on the same workers (--compare) when torch is
importable. The arms are interleaved: repeat k runs the strategies rotated by k places, with
gloo after kungfu on even repeats and before it on odd ones. allreduce.py checks every arm's
result once, then times it (the median over its timed iterations of the slowest worker's time).
A cell of the table is the median of the per-repeat medians, with their [min, max].

The link-bound lower limit, for B bytes across H hosts: limit = 2 (H-1)/H x B / RATE. It assumes
the workers of a host reduce among themselves for free (no link crossed) and that the host links,
full duplex at exactly RATE and joined by a switch that is never the bottleneck, then carry
the least any allreduce can: 2 (H-1)/H x B each way on each link (reduce-scatter plus
allgather of B over H hosts). Latency, protocol headers and CPU time are left out, so no
implementation reaches it; "x limit" says how far each arm is from it. Without --rate there is
no limit ('-').
"""
from __future__ import annotations

import argparse
import json
import os
import re
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Optional, Sequence

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)

from _common import JsonLines  # noqa: E402

DEFAULT_STRATEGIES = "AUTO,HIERARCHICAL,RING,BINARY_TREE_STAR,TREE"
STRATEGIES = ("STAR", "RING", "TREE", "BINARY_TREE", "BINARY_TREE_STAR",
              "MULTI_BINARY_TREE_STAR", "CLIQUE", "DIRECT", "HIERARCHICAL", "AUTO")
MODES = ("fused", "per-tensor")
SUBNET = "10.201.0"
BRIDGE = "kfbr"
_RATE_UNITS = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}
_DELAY_UNITS = {"us": 1e-6, "ms": 1e-3, "s": 1.0}
NEEDS = ("multihost.py needs root and iproute2 (`ip`, and `tc` for --rate/--delay) to build "
         "network namespaces: run it as root on a Linux machine with iproute2")


class Failed(Exception):
    """A run that cannot go on; main() prints it as one line."""


# ---------------------------------------------------------------------------------------------
# Arguments

def parse_rate(text: str) -> float:
    """'10gbit', '100mbit', '1.5Gbit', '800kbit' -> bits per second (SI units, as tc)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)bit\s*", text, re.IGNORECASE)
    if not m or float(m.group(1)) <= 0:
        raise argparse.ArgumentTypeError(
            f"bad rate {text!r}: a positive number of bits per second as tc writes it, "
            "e.g. 100mbit, 10gbit")
    return float(m.group(1)) * _RATE_UNITS[m.group(2).lower()]


def parse_delay(text: str) -> float:
    """'0.1ms', '50us', '1s' -> seconds."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(us|ms|s)\s*", text)
    if not m or float(m.group(1)) <= 0:
        raise argparse.ArgumentTypeError(f"bad delay {text!r}: e.g. 50us, 0.1ms, 2ms")
    return float(m.group(1)) * _DELAY_UNITS[m.group(2)]


def parse_workers(spec: str, hosts: int) -> List[int]:
    """'2' -> [2] * hosts; '1,3' -> [1, 3] (one count per host)."""
    parts = [p.strip() for p in spec.split(",")]
    if not all(re.fullmatch(r"\d+", p) for p in parts):
        raise ValueError(f"--workers-per-host {spec!r}: give a count (2) or one per host (1,3)")
    counts = [int(p) for p in parts]
    if len(counts) == 1:
        counts = counts * hosts
    if len(counts) != hosts:
        raise ValueError(f"--workers-per-host {spec!r} names {len(counts)} hosts, --hosts is "
                         f"{hosts}")
    if min(counts) < 1:
        raise ValueError(f"--workers-per-host {spec!r}: every host needs at least 1 worker")
    return counts


def parse_strategies(spec: str) -> List[str]:
    out = []
    for name in spec.split(","):
        up = name.strip().upper().replace("-", "_")
        if up not in STRATEGIES:
            raise ValueError(f"unknown strategy {name!r} (choose from {', '.join(STRATEGIES)})")
        if up not in out:
            out.append(up)
    return out


def human_rate(bps: Optional[float]) -> str:
    if bps is None:
        return "unlimited"
    for unit, scale in (("tbit", 1e12), ("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3)):
        if bps >= scale:
            return f"{bps / scale:g}{unit}"
    return f"{bps:g}bit"


def parse_args(argv=None):
    ap = argparse.ArgumentParser(
        prog="multihost.py", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hosts", type=int, default=2,
                    help="network namespaces, one per host (default 2)")
    ap.add_argument("--workers-per-host", default="2", metavar="N|N0,N1,...",
                    help="workers on every host, or one count per host (default 2)")
    ap.add_argument("--rate", type=parse_rate, default=None, metavar="RATE",
                    help="shape every host link to RATE each way with tc tbf, e.g. 10gbit "
                         "(default: no shaping)")
    ap.add_argument("--delay", type=parse_delay, default=None, metavar="DELAY",
                    help="add DELAY with tc netem on both ends of every host link, e.g. 0.1ms")
    ap.add_argument("--strategies", default=DEFAULT_STRATEGIES,
                    help=f"kungfu strategies, a comma list (default {DEFAULT_STRATEGIES})")
    ap.add_argument("--mode", choices=["fused", "per-tensor", "both"], default="both",
                    help="allreduce.py --mode: the gradient set as one buffer (fused), one async "
                         "allreduce per tensor (per-tensor), or both (default both)")
    ap.add_argument("--api", choices=["numpy", "tf"], default="numpy",
                    help="allreduce.py --api: the kungfu arms through the numpy API, or through "
                         "TensorFlow ops in a tf.function (fused: one group_all_reduce; "
                         "per-tensor: one all_reduce per tensor); gloo is the same either way")
    ap.add_argument("--no-gloo", action="store_true",
                    help="leave gloo out even when torch is importable")
    ap.add_argument("--repeats", type=int, default=3,
                    help="runs of every arm, interleaved (default 3)")
    ap.add_argument("--iters", type=int, default=20,
                    help="allreduce.py --iters: timed iterations per arm and repeat, at most")
    ap.add_argument("--max-seconds", type=float, default=1.5,
                    help="allreduce.py --max-seconds: fewer timed iterations (at least 3) when "
                         "--iters would take longer (default 1.5)")
    ap.add_argument("--timeout", type=float, default=300,
                    help="seconds one repeat (one job) may take before it is stopped "
                         "(default 300)")
    ap.add_argument("--prefix", default="kfmh",
                    help="namespace names: PREFIX0, PREFIX1, ... and PREFIXsw (default kfmh)")
    ap.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                    help="set a KUNGFU_* variable for every worker, e.g. KUNGFU_PARALLELISM=4 "
                         "(repeatable)")
    ap.add_argument("--json", default=None, metavar="PATH",
                    help="also write the JSON lines to PATH")
    args = ap.parse_args(argv)
    args.env_vars = {}
    for item in args.env:
        name, eq, value = item.partition("=")
        if not eq or not name.startswith("KUNGFU_"):
            ap.error(f"--env {item!r}: expected KUNGFU_NAME=VALUE")
        args.env_vars[name] = value
    if not 2 <= args.hosts <= 200:
        ap.error("--hosts must be between 2 and 200")
    try:
        args.workers = parse_workers(args.workers_per_host, args.hosts)
        args.strategy_list = parse_strategies(args.strategies)
    except ValueError as e:
        ap.error(str(e))
    if args.repeats < 1 or args.iters < 1 or args.timeout <= 0:
        ap.error("--repeats and --iters must be >= 1, --timeout > 0")
    if not re.fullmatch(r"[a-z][a-z0-9]{0,7}", args.prefix):
        ap.error("--prefix: 1 to 8 lower-case letters and digits, starting with a letter")
    return args


# ---------------------------------------------------------------------------------------------
# The limit

def link_limit_s(nbytes: int, hosts: int, rate_bps: Optional[float]) -> Optional[float]:
    """Least time for an allreduce of nbytes across `hosts` host links of rate_bps each way:
    each link carries at least 2 (H-1)/H x B in each direction (see the module docstring)."""
    if rate_bps is None:
        return None
    return 2 * (hosts - 1) / hosts * nbytes * 8 / rate_bps


def resnet50_bytes() -> int:
    with open(os.path.join(HERE, "resnet50_sizes.json")) as f:
        return 4 * json.load(f)["total"]


# ---------------------------------------------------------------------------------------------
# The network

def missing_privileges(need_tc: bool) -> Optional[str]:
    """None when this process can build the network, else the one line that says what is needed."""
    tools = ["ip"] + (["tc"] if need_tc else [])
    if os.geteuid() != 0 or any(shutil.which(t) is None for t in tools):
        return NEEDS
    return None


def sh(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run(list(cmd), capture_output=True, text=True, timeout=30, check=False)
    if check and r.returncode != 0:
        raise Failed(f"`{' '.join(cmd)}` failed ({r.returncode}): {r.stderr.strip()}")
    return r


def existing_namespaces() -> List[str]:
    out = sh("ip", "netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


class Network:
    """H host namespaces, each with one veth link to a bridge in a switch namespace."""

    def __init__(self, prefix: str, hosts: int):
        self.ns = [f"{prefix}{i}" for i in range(hosts)]
        self.switch = f"{prefix}sw"
        self.nic = [f"kfv{i}" for i in range(hosts)]      # host end of link i
        self.port = [f"kfp{i}" for i in range(hosts)]     # switch end of link i
        self.ip = [f"{SUBNET}.{i + 1}" for i in range(hosts)]
        self.created: List[str] = []

    def names(self) -> List[str]:
        return self.ns + [self.switch]

    def clashes(self) -> List[str]:
        have = set(existing_namespaces())
        return [n for n in self.names() if n in have]

    def build(self, rate_bps: Optional[float], delay_s: Optional[float]) -> None:
        for ns in self.names():
            sh("ip", "netns", "add", ns)
            self.created.append(ns)
        sw = self.switch
        sh("ip", "-n", sw, "link", "add", BRIDGE, "type", "bridge")
        sh("ip", "-n", sw, "link", "set", BRIDGE, "up")
        sh("ip", "-n", sw, "link", "set", "lo", "up")
        for ns, nic, port, addr in zip(self.ns, self.nic, self.port, self.ip):
            # Created in the switch namespace with the peer moved straight into the host's:
            # nothing appears in the caller's namespace (as in tests/integration/test_multihost.py).
            sh("ip", "-n", sw, "link", "add", port, "type", "veth", "peer", "name", nic,
               "netns", ns)
            sh("ip", "-n", sw, "link", "set", port, "master", BRIDGE, "up")
            sh("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", nic)
            sh("ip", "-n", ns, "link", "set", "lo", "up")
            sh("ip", "-n", ns, "link", "set", nic, "up")
            for where, dev in ((ns, nic), (sw, port)):
                for cmd in shaping(dev, rate_bps, delay_s):
                    r = sh("ip", "netns", "exec", where, *cmd, check=False)
                    if r.returncode != 0 and "netem" in cmd and "unknown" in r.stderr:
                        raise Failed("--delay needs the kernel's netem qdisc (sch_netem), "
                                     "which this kernel does not have")
                    if r.returncode != 0:
                        raise Failed(f"`{' '.join(cmd)}` in {where} failed: {r.stderr.strip()}")

    def destroy(self) -> List[str]:
        """Stops every process left in our namespaces, deletes them; returns those left."""
        for ns in self.created:
            pids = sh("ip", "netns", "pids", ns, check=False).stdout.split()
            for pid in pids:
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
        for ns in reversed(self.created):
            sh("ip", "netns", "del", ns, check=False)
        have = set(existing_namespaces())
        left = [n for n in self.created if n in have]
        self.created = left
        return left


def shaping(dev: str, rate_bps: Optional[float], delay_s: Optional[float]) -> List[List[str]]:
    """tc commands for one end of a link: tbf for the rate, netem (under it) for the delay."""
    cmds: List[List[str]] = []
    delay = f"{delay_s * 1e6:g}us" if delay_s else None
    if rate_bps is not None:
        # Burst: 1 ms at the rate, and never less than a 64 KiB GSO packet of the veth.
        burst = max(int(rate_bps / 8 / 1000), 128 * 1024)
        cmds.append(["tc", "qdisc", "add", "dev", dev, "root", "handle", "1:", "tbf", "rate",
                     f"{int(rate_bps)}bit", "burst", str(burst), "latency", "20ms"])
        if delay:
            cmds.append(["tc", "qdisc", "add", "dev", dev, "parent", "1:1", "handle", "10:",
                         "netem", "delay", delay, "limit", "100000"])
    elif delay:
        cmds.append(["tc", "qdisc", "add", "dev", dev, "root", "netem", "delay", delay,
                     "limit", "100000"])
    return cmds


# ---------------------------------------------------------------------------------------------
# One repeat: one kungfu-run per namespace

def gloo_available() -> Optional[str]:
    """torch's version when torch.distributed imports here (the workers use this interpreter)."""
    r = subprocess.run([sys.executable, "-c", "import torch, torch.distributed; "
                        "print(torch.__version__)"], capture_output=True, text=True, timeout=120)
    return r.stdout.strip() if r.returncode == 0 else None


def arm_order(strategies: Sequence[str], repeat: int) -> List[str]:
    k = repeat % len(strategies)
    return list(strategies[k:]) + list(strategies[:k])


def run_repeat(net: Network, args, repeat: int, gloo: bool, out_dir: str,
               procs: List[subprocess.Popen]) -> List[dict]:
    np_ = sum(args.workers)
    hosts = ",".join(f"{ip}:{n}" for ip, n in zip(net.ip, args.workers))
    token = secrets.token_hex(16)
    json_path = os.path.join(out_dir, f"repeat{repeat}.jsonl")
    bench = [sys.executable, os.path.join(HERE, "allreduce.py"), "--model", "resnet50",
             "--mode", args.mode, "--api", args.api, "--strategy", ",".join(arm_order(args.strategy_list, repeat)),
             "--iters", str(args.iters), "--max-seconds", str(args.max_seconds),
             "--no-table", "--json", json_path]
    if gloo:
        bench += ["--compare"] + (["--compare-first"] if repeat % 2 else [])
    logs = []
    for i, (ns, addr) in enumerate(zip(net.ns, net.ip)):
        env = {k: v for k, v in os.environ.items() if not k.startswith("KUNGFU_")}
        env.update(args.env_vars)
        env["KUNGFU_JOB_TOKEN"] = token  # one secret for the launchers of every host
        env["PYTHONPATH"] = os.pathsep.join([REPO] + [p for p in [env.get("PYTHONPATH")] if p])
        env["GLOO_SOCKET_IFNAME"] = net.nic[i]  # gloo would pick by host name otherwise
        log = os.path.join(out_dir, f"repeat{repeat}-host{i}.log")
        logs.append(log)
        with open(log, "w") as f:
            procs.append(subprocess.Popen(
                ["ip", "netns", "exec", ns, sys.executable, "-m", "kungfu.cmd", "-np", str(np_),
                 "-H", hosts, "-self", addr, "-q", "-timeout", f"{args.timeout:g}s", *bench],
                stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True))
    mine = procs[-len(net.ns):]
    deadline = time.time() + args.timeout + 30
    while any(p.poll() is None for p in mine):
        failed = [i for i, p in enumerate(mine) if p.poll() not in (None, 0)]
        if failed or time.time() > deadline:
            break
        time.sleep(0.2)
    bad = [(i, p.poll()) for i, p in enumerate(mine) if p.poll() != 0]
    if bad:
        i, rc = bad[0]
        with open(logs[i]) as f:
            tail = "".join(f.readlines()[-15:])
        raise Failed(f"repeat {repeat}: kungfu-run on host {i} ({net.ns[i]}) "
                     f"{'did not finish' if rc is None else f'exited {rc}'}; its last lines:\n"
                     f"{tail}")
    with open(json_path) as f:
        return [json.loads(line) for line in f if line.strip()]


def stop(procs: List[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)  # its own session: the workers go with it
            except ProcessLookupError:
                pass
            p.wait()


# ---------------------------------------------------------------------------------------------
# Summary

def summarize(rows: List[dict], arms: Sequence[str], limit_s: Optional[float]) -> List[dict]:
    """Per arm and mode: median, min, max over the repeats of the per-repeat medians, and the
    ratios of that median to gloo's (same mode) and to the link-bound limit."""
    per: Dict[tuple, List[float]] = {}
    for r in rows:
        arm = "gloo" if r["impl"] == "gloo" else r["strategy"]
        per.setdefault((arm, r["mode"]), []).append(r["time_s"])
    out = []
    for arm in arms:
        for mode in MODES:
            ts = per.get((arm, mode))
            if not ts:
                continue
            med = statistics.median(ts)
            gloo = per.get(("gloo", mode))
            out.append({
                "row": "summary", "arm": arm, "mode": mode, "repeats": len(ts),
                "median_s": med, "min_s": min(ts), "max_s": max(ts),
                "ratio_gloo": med / statistics.median(gloo) if gloo else None,
                "limit_s": limit_s, "ratio_limit": med / limit_s if limit_s else None})
    return out


def table(summary: List[dict]) -> str:
    cell = {(s["arm"], s["mode"]): s for s in summary}
    arms = list(dict.fromkeys(s["arm"] for s in summary))

    def ms(s):
        if s is None:
            return "-"
        return f"{s['median_s'] * 1e3:.1f} [{s['min_s'] * 1e3:.1f}, {s['max_s'] * 1e3:.1f}]"

    def ratio(s, key):
        return "-" if s is None or s[key] is None else f"{s[key]:.2f}"

    head = ["arm", "fused ms [min, max]", "per-tensor ms [min, max]", "fused x gloo",
            "per-tensor x gloo", "fused x limit", "per-tensor x limit"]
    body = []
    for arm in arms:
        f, p = cell.get((arm, "fused")), cell.get((arm, "per-tensor"))
        body.append([arm, ms(f), ms(p), ratio(f, "ratio_gloo"), ratio(p, "ratio_gloo"),
                     ratio(f, "ratio_limit"), ratio(p, "ratio_limit")])
    widths = [max(len(x) for x in col) for col in zip(head, *body)]
    lines = ["  ".join(h.rjust(w) for h, w in zip(head, widths)),
             "  ".join("-" * w for w in widths)]
    lines += ["  ".join(x.rjust(w) for x, w in zip(row, widths)) for row in body]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------

def _sigterm(signum, frame):
    raise KeyboardInterrupt  # the same cleanup as Ctrl-C


def main(argv=None) -> int:
    args = parse_args(argv)
    need = missing_privileges(need_tc=args.rate is not None or args.delay is not None)
    if need:
        print(need, file=sys.stderr)
        return 2
    net = Network(args.prefix, args.hosts)
    clash = net.clashes()
    if clash:
        print(f"multihost.py: namespace(s) {', '.join(clash)} exist already: another run of "
              f"this benchmark, or one killed before it could clean up. Delete them "
              f"(`ip netns del NAME`) or choose other names with --prefix.", file=sys.stderr)
        return 2
    torch_version = None if args.no_gloo else gloo_available()
    arms = args.strategy_list + (["gloo"] if torch_version else [])
    nbytes = resnet50_bytes()
    limit = link_limit_s(nbytes, args.hosts, args.rate)
    np_ = sum(args.workers)
    report = JsonLines(args.json)
    procs: List[subprocess.Popen] = []
    old_term = signal.signal(signal.SIGTERM, _sigterm)
    load_before = os.getloadavg()
    t0 = time.time()
    rows: List[dict] = []
    try:
        net.build(args.rate, args.delay)
        with tempfile.TemporaryDirectory(prefix="multihost.") as out_dir:
            for k in range(args.repeats):
                got = run_repeat(net, args, k, torch_version is not None, out_dir, procs)
                for r in got:
                    r.update(row="repeat", repeat=k, hosts=args.hosts, workers=args.workers,
                             rate_bps=args.rate, delay_s=args.delay)
                    report.emit(r)
                rows += got
                print(f"# repeat {k + 1}/{args.repeats} done ({time.time() - t0:.0f}s)",
                      file=sys.stderr, flush=True)
        summary = summarize(rows, arms, limit)
        for s in summary:
            report.emit(s)
        run = {"row": "run", "hosts": args.hosts, "workers": args.workers, "np": np_,
               "rate_bps": args.rate, "delay_s": args.delay, "bytes": nbytes,
               "limit_s": limit, "repeats": args.repeats, "env": args.env_vars,
               "torch": torch_version,
               "cpus": os.cpu_count(), "wall_s": round(time.time() - t0, 1),
               "loadavg_before": [round(x, 2) for x in load_before],
               "loadavg_after": [round(x, 2) for x in os.getloadavg()]}
        report.emit(run)
        print(f"\n# ResNet50 gradient set ({nbytes / 1e6:.1f} MB float32) allreduced across "
              f"{args.hosts} namespaces x {args.workers} workers (np={np_}); host links: "
              f"{human_rate(args.rate)}"
              + (f", +{args.delay * 1e3:g} ms on each end" if args.delay else "")
              + f"; {args.repeats} repeats; "
              + (f"gloo: torch {torch_version}" if torch_version else
                 "gloo: left out (torch not importable)" if not args.no_gloo else
                 "gloo: left out (--no-gloo)"))
        print("# link-bound limit 2(H-1)/H x B / rate = "
              + (f"{limit * 1e3:.1f} ms" if limit else "-")
              + " (host-local reduction free; full-duplex links at exactly the rate; no "
                "latency, headers or CPU)")
        print(f"# load average before {run['loadavg_before']}, after {run['loadavg_after']}; "
              f"{os.cpu_count()} cores; {run['wall_s']:.0f}s")
        print(table(summary), flush=True)
        return 0
    except Failed as e:
        print(f"multihost.py: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("multihost.py: interrupted; cleaning up", file=sys.stderr)
        return 130
    finally:
        stop(procs)
        left = net.destroy()
        report.close()
        signal.signal(signal.SIGTERM, old_term)
        if left:
            print(f"multihost.py: could not delete namespace(s) {', '.join(left)}",
                  file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
