"""kungfu-run inside a Slurm job step: the job's hosts, this host and the number of workers come
from Slurm, so that one line starts a job over the allocation's nodes (docs/slurm.md):

    srun --ntasks-per-node=1 kungfu-run -np 8 python train.py

In a step (SLURM_STEP_NODELIST and SLURMD_NODENAME set) and without -H, each launcher takes:

- the hosts: the step's nodes (SLURM_STEP_NODELIST as `scontrol show hostnames` expands it, or
  kungfu's own reading of it where scontrol does not answer), in Slurm's order, each at its address (`scontrol show node`'s
  NodeAddr, which may differ from its name; the name where scontrol does not answer), with
  ceil(np / nodes) slots, or the node's GPUs where Slurm gave some (SLURM_GPUS_ON_NODE); with
  -w at least the node's CPUs (SLURM_CPUS_ON_NODE), so a resize may grow within the allocation;
- this host (-self): its own node (SLURMD_NODENAME);
- -np when not given: one worker per allocated GPU, else one per node;
- -w without a store: the first node's launcher hosts the builtin one, on a port taken from the
  job's id, and the others use it.

The job's secret is not Slurm's: every launcher must be given the same one (KUNGFU_JOB_TOKEN,
which srun passes on, or -job-token-file on a shared file system), as on any set of hosts.
Given -H (and -self), kungfu-run uses them and ignores Slurm. A step with several tasks on a
node would start its workers several times over: refused.
"""
from __future__ import annotations

import os
import re
import subprocess
from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional, Sequence

from kungfu._hosts import ManagedHosts, UsageError

SCONTROL_SECONDS = 10.0  # a healthy controller answers in milliseconds
STORE_PORTS = (29000, 30000)  # -w: the builtin store's port, chosen by the job's id
_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")


def expand_nodelist(text: str) -> List[str]:
    """A Slurm node list expanded in order, by Slurm itself (`scontrol show hostnames`, which
    knows every form Slurm writes) where scontrol answers, else by expand_hostlist. ValueError
    for a list that neither reads."""
    try:
        out = subprocess.run(["scontrol", "show", "hostnames", text], capture_output=True,
                             text=True, timeout=SCONTROL_SECONDS, check=False)
    except (OSError, subprocess.SubprocessError):
        return expand_hostlist(text)
    names = out.stdout.split()
    # scontrol answers a list it cannot read with nothing on stdout (and exit code 0).
    return names if out.returncode == 0 and names else expand_hostlist(text)


def expand_hostlist(text: str) -> List[str]:
    """Slurm's compressed host list, expanded in order: "n[01-03,07],gpu5,r[1-2]-c[1-2]" ->
    n01, n02, n03, n07, gpu5, r1-c1, r1-c2, r2-c1, r2-c2. Ranges keep the lower bound's zero
    padding. ValueError naming the problem for a list that is not one."""
    names: List[str] = []
    for item in _split_top(text.strip(), text):
        names.extend(_expand_item(item, text))
    return names


def _split_top(text: str, whole: str) -> List[str]:
    """`text` split at the commas outside brackets."""
    items, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
            if depth > 1:
                raise ValueError(f"host list {whole!r}: nested brackets")
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"host list {whole!r}: ']' without '['")
        elif ch == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    if depth:
        raise ValueError(f"host list {whole!r}: '[' without ']'")
    items.append(text[start:])
    if any(not item for item in items):
        raise ValueError(f"host list {whole!r}: an empty name")
    return items


def _expand_item(item: str, whole: str) -> List[str]:
    """One name with bracket groups: the product of the groups, the last varying fastest."""
    open_at = item.find("[")
    if open_at < 0:
        return [item]
    close_at = item.index("]", open_at)
    head, body, tail = item[:open_at], item[open_at + 1:close_at], item[close_at + 1:]
    numbers: List[str] = []
    for part in body.split(","):
        m = _RANGE.match(part.strip())
        if m is None:
            raise ValueError(f"host list {whole!r}: {part!r} is not a number or a range A-B")
        low, high = m.group(1), m.group(2) or m.group(1)
        if int(high) < int(low):
            raise ValueError(f"host list {whole!r}: range {part!r} runs backwards")
        width = len(low) if low.startswith("0") else 0
        numbers.extend(str(n).zfill(width) for n in range(int(low), int(high) + 1))
    rest = _expand_item(tail, whole)
    return [f"{head}{n}{r}" for n in numbers for r in rest]


@dataclass
class Step:
    """What kungfu-run needs of the Slurm job step it runs in."""

    nodes: List[str]  # the step's nodes, in Slurm's order
    me: str  # this node's name
    job_id: str
    gpus: int  # GPUs per node (0: none given)
    cpus: int  # CPUs of this node (0: not given)


def step(environ: Mapping[str, str]) -> Optional[Step]:
    """The Slurm step this process runs in, or None outside one (not under Slurm, or in a
    batch script's own shell: there kungfu-run runs on its node alone). UsageError for a step
    with several tasks on a node."""
    nodelist, me = environ.get("SLURM_STEP_NODELIST"), environ.get("SLURMD_NODENAME")
    if not nodelist or not me:
        return None
    try:
        nodes = expand_nodelist(nodelist)
    except ValueError as e:
        raise UsageError(f"SLURM_STEP_NODELIST: {e}") from None
    tasks = environ.get("SLURM_STEP_NUM_TASKS")
    if tasks and tasks.isdigit() and int(tasks) != len(nodes):
        raise UsageError(f"this Slurm step runs {tasks} tasks on {len(nodes)} nodes: one "
                         f"kungfu-run per node starts that node's workers (srun "
                         f"--ntasks-per-node=1 kungfu-run ...), or give -H and -self")
    if me not in nodes:
        raise UsageError(f"this node ({me}, SLURMD_NODENAME) is not one of the step's nodes "
                         f"({nodelist}, SLURM_STEP_NODELIST)")
    return Step(nodes, me, environ.get("SLURM_JOB_ID", "0"),
                _count(environ.get("SLURM_GPUS_ON_NODE")),
                _count(environ.get("SLURM_CPUS_ON_NODE")))


def _count(text: Optional[str]) -> int:
    return int(text) if text and text.isdigit() else 0


def node_addresses(nodes: Sequence[str]) -> Dict[str, str]:
    """Each node's address (NodeAddr) as Slurm's controller knows it; {} when scontrol does not
    answer (the names are then resolved as host names)."""
    try:
        out = subprocess.run(["scontrol", "-o", "show", "node", ",".join(nodes)],
                             capture_output=True, text=True, timeout=SCONTROL_SECONDS,
                             check=False)
    except (OSError, subprocess.SubprocessError):
        return {}
    found = {}
    for line in out.stdout.splitlines():
        name = re.search(r"\bNodeName=(\S+)", line)
        addr = re.search(r"\bNodeAddr=(\S+)", line)
        if name and addr:
            found[name.group(1)] = addr.group(1)
    return found


def hosts(environ: Optional[Mapping[str, str]] = None) -> Optional[ManagedHosts]:
    """The hosts of the Slurm step kungfu-run runs in (see the module's doc), or None."""
    s = step(os.environ if environ is None else environ)
    if s is None:
        return None
    found = node_addresses(s.nodes)
    low, high = STORE_PORTS
    return ManagedHosts(f"Slurm job {s.job_id}", s.nodes, [found.get(n, n) for n in s.nodes],
                        s.nodes.index(s.me), len(s.nodes) * max(s.gpus, 1), s.gpus, s.cpus,
                        low + int(s.job_id) % (high - low) if s.job_id.isdigit() else low)
