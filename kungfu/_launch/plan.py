"""Where a job's workers run: the hosts of -H, which of them is this one (-self, -nic), the
ports (bound here and held for the job; moved off taken defaults), the job's secret, and the
GPU each worker of this host sees. `prepare` and `listen` check all of it before any worker
starts, so a mistake is a usage error at once.

The placement itself (host-major in -H order) is kungfu/_hosts.py, which the workers share.
"""
from __future__ import annotations

import dataclasses
import errno
import glob
import os
import re
import secrets
import socket
import subprocess
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Set

from kungfu import _env, _ports
from kungfu._hosts import (
    HostSpec,
    UsageError,
    Worker,
    _is_ipv4,
    _is_loopback,
    parse_hosts,
    plan_workers,
)
from kungfu._launch.flags import DEFAULT_PORT_RANGE, Options, check_store_credentials
from kungfu._launch.output import _plural, _ranks, logger


@dataclass
class Plan:
    """The job's workers and this launcher's part of them."""

    hosts: List[HostSpec]  # -H (default 127.0.0.1:np)
    peers: List[Worker]  # every worker of the job (-w: of its first version)
    mine: List[Worker]  # the workers this launcher starts
    here: Set[str]  # the hosts of -H that are this one
    # The ssh start (kungfu/_launch/ssh.py): the hosts with workers (-w: every other host of -H)
    # whose launchers this one starts over ssh; empty when each host runs its own (-self, -nic, a cluster manager).
    remote: List[HostSpec] = field(default_factory=list)
    # host:port -> its socket, bound and listening, for the worker there (see listen)
    listeners: Dict[str, socket.socket] = field(default_factory=dict)


def prepare(opts: Options) -> Plan:
    """The plan of the job for `opts`; resolves opts.job_token, creates -logdir and -timeline.
    UsageError when any of it fails. Its ports are taken by `listen`."""
    hosts = parse_hosts(opts.hosts) if opts.hosts is not None else [
        HostSpec("127.0.0.1", opts.np)
    ]
    try:
        if opts.gpu_per_worker:
            _env.GPU_COUNT.get()
        if opts.elastic:
            opts.leave_grace = _env.LEAVE_GRACE.get()
    except ValueError as e:
        raise UsageError(str(e)) from None
    peers = plan_workers(opts.np, hosts, opts.port_range)
    here = set(local_hosts(opts, hosts))
    mine = [w for w in peers if w.host in here]
    remote = [] if opts.self_host is not None or opts.nic is not None else [
        h for h in hosts if h.host not in here
        and (opts.elastic or any(w.host == h.host for w in peers))]
    _check_ssh_start(opts, remote)
    # Alone: this launcher starts every worker the job may have (elastic: every slot).
    alone = all(h.host in here for h in hosts) if opts.elastic else len(mine) == len(peers)
    opts.job_token = job_token(opts, alone or bool(remote))  # the ssh start hands it on
    slots = ", ".join(f"{h.host}:{h.slots}" for h in hosts)
    logger.debug(f"plan: {_plural(opts.np, 'worker')} on {slots}; this host"
                 f" ({', '.join(sorted(here))}) starts {_ranks(mine) if mine else 'none'}"
                 f"; strategy {opts.strategy}{'; elastic' if opts.elastic else ''}")
    _make_dirs(opts)
    if opts.config_server is not None:
        check_store_credentials(opts)
    return Plan(hosts, peers, mine, here, remote)


def _check_ssh_start(opts: Options, remote: List[HostSpec]) -> None:
    """The flags of the ssh start go with it."""
    if not remote and (opts.ssh_port is not None or opts.ssh_identity_file is not None):
        raise UsageError("-ssh-port and -ssh-identity-file are for the ssh start (several hosts "
                         "in -H, not all of them this one, and neither -self nor -nic)")


def _make_dirs(opts: Options) -> None:
    """Creates -logdir and -timeline; the timeline's as an absolute path (workers may change
    directory)."""
    for flag in ("logdir", "timeline"):
        directory = getattr(opts, flag)
        if directory is None:
            continue
        try:
            os.makedirs(directory, exist_ok=True)
        except OSError as e:
            reason = e.strerror or str(e)
            raise UsageError(f"cannot create -{flag} {directory!r}: {reason}") from None
    if opts.timeline is not None:
        opts.timeline = os.path.abspath(opts.timeline)  # workers may change directory


def job_token(opts: Options, alone: bool) -> str:
    """The job's secret: from -job-token-file, else KUNGFU_JOB_TOKEN, else a new random one when
    this launcher runs the whole job (`alone`). A job with a launcher per host needs the same
    secret on every host, so it must be given there (a random one would differ per host). A
    given secret must have _env.MIN_TOKEN_BITS (see _env.token_bits)."""
    if opts.job_token_file is not None:
        try:
            token = _env.read_secret_file(opts.job_token_file, "-job-token-file")
        except ValueError as e:
            raise UsageError(str(e)) from None
        try:
            return _env.check_job_token(token)
        except ValueError as e:
            raise UsageError(f"-job-token-file {opts.job_token_file!r}: {e}") from None
    try:
        token = _env.JOB_TOKEN.get()
    except ValueError as e:
        raise UsageError(str(e)) from None
    if token:
        return token
    if not alone:
        raise UsageError("a job with a launcher on each host needs one secret on every host: "
                         "give each launcher the same -job-token-file FILE, or set "
                         "KUNGFU_JOB_TOKEN to the same value (make one with python3 -c "
                         "\"import secrets; print(secrets.token_hex(32))\"; under Slurm, "
                         "export it before srun, which passes it on)")
    return secrets.token_hex(32)


def nic_ipv4(iface: str) -> str:
    """The first IPv4 address of a network interface."""
    try:
        socket.if_nametoindex(iface)
    except OSError:
        raise UsageError(f"unknown network interface -nic {iface!r}") from None
    addr = _nic_ipv4_ioctl(iface)
    if addr is None:
        addr = _nic_ipv4_ip_command(iface)
    if addr is None:
        raise UsageError(f"network interface {iface!r} has no IPv4 address")
    return addr


def _nic_ipv4_ioctl(iface: str) -> Optional[str]:
    try:
        import fcntl
        import struct

        siocgifaddr = 0x8915
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            req = struct.pack("256s", iface.encode()[:15])
            res = fcntl.ioctl(s.fileno(), siocgifaddr, req)
        return socket.inet_ntoa(res[20:24])
    except (OSError, ImportError, ValueError):
        return None


def _nic_ipv4_ip_command(iface: str) -> Optional[str]:
    try:
        out = subprocess.run(
            ["ip", "-4", "-o", "addr", "show", "dev", iface],
            capture_output=True, text=True, timeout=5, check=False,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    m = re.search(r"\binet (\d+\.\d+\.\d+\.\d+)/", out)
    return m.group(1) if m else None


def _resolve(host: str) -> Optional[str]:
    if _is_ipv4(host):
        return host
    try:
        return socket.gethostbyname(host)
    except OSError:
        return None


def local_hosts(opts: Options, hosts: Sequence[HostSpec]) -> List[str]:
    """The -H hosts whose workers this launcher starts."""
    names = [h.host for h in hosts]
    if opts.self_host is None and opts.nic is None:
        if len(names) == 1 or all(_is_loopback(n) for n in names):
            return names
        # The ssh start: those that are this machine; this launcher starts the others'.
        mine = this_machine()
        addresses = {n: _resolve(n) or n for n in names}
        return [n for n in names if addresses[n] in mine or _is_loopback(addresses[n])]
    if opts.nic is not None:
        me = nic_ipv4(opts.nic)
        how = f"-nic {opts.nic} ({me})"
    else:
        me, how = opts.self_host, f"-self {opts.self_host}"
    if me in names:
        return [me]
    me_resolved = _resolve(me)
    matches = [n for n in names if me_resolved is not None and _resolve(n) == me_resolved]
    if not matches:
        raise UsageError(f"{how} is not one of the hosts of -H ({', '.join(names)})")
    return matches[:1]


def this_machine() -> Set[str]:
    """The IPv4 addresses of this machine's network interfaces (the first of each), loopback
    included."""
    found = {"127.0.0.1"}
    for _, iface in socket.if_nameindex():
        addr = _nic_ipv4_ioctl(iface)
        if addr is not None:
            found.add(addr)
    return found


def listen(opts: Options, job: Plan) -> Plan:
    """Binds the ports of this host's slots and keeps them listening for the job (job.listeners):
    each worker inherits its slot's socket (KUNGFU_LISTEN_FD), so no other process can take a
    port between this check and the worker's start, nor between two workers of a slot (elastic).
    Static: the ports of this host's workers; elastic: of every slot this host has in -H (a
    later version may use any). A launcher that runs the whole job with the default ports
    moves to a free block when they are taken, and says so; any other taken port is a
    UsageError that names it."""
    if opts.elastic:
        wanted = [(h.host, slot) for h in job.hosts if h.host in job.here
                  for slot in range(h.slots)]
    else:
        wanted = [(w.host, w.local_rank) for w in job.mine]
    base = opts.port_range[0]
    try:
        socks = _ports.listen_at(base, wanted)
    except OSError as e:
        socks = _move(opts, job, wanted, e)
        base = opts.port_range[0]
        job = dataclasses.replace(job, peers=plan_workers(opts.np, job.hosts, opts.port_range))
        job.mine = [w for w in job.peers if w.host in job.here]
    job.listeners = {f"{host}:{base + slot}": s for (host, slot), s in zip(wanted, socks)}
    return job


def _move(opts: Options, job: Plan, wanted, error: OSError) -> List[socket.socket]:
    """The sockets of a free block for `wanted` when the ports of -port-range are not all free
    (`error`): only for a launcher that runs the whole job with the default ports, which moves
    opts.port_range there; else a UsageError."""
    taken = []
    for host, slot in wanted:
        try:
            _ports.listen(host, opts.port_range[0] + slot).close()
        except OSError as e:
            taken.append((f"{host}:{opts.port_range[0] + slot}", e))
    # (A port free again by now is not named; a range whose ports all are, as a whole.)
    shown = ", ".join(spec for spec, _ in taken[:3]) + (" ..." if len(taken) > 3 else "") \
        or "the ports of -port-range {}-{}".format(*opts.port_range)
    first = taken[0][1] if taken else error
    if first.errno == errno.EADDRNOTAVAIL:
        host = taken[0][0].rpartition(":")[0] if taken else "a host of -H"
        raise UsageError(f"cannot listen on {shown} ({first.strerror}): {host} is not an "
                         f"address of this host (-H, -self, -nic)")
    alone = all(h.host in job.here for h in job.hosts) if opts.elastic else \
        len(job.mine) == len(job.peers)
    if opts.port_range != DEFAULT_PORT_RANGE or not alone or first.errno != errno.EADDRINUSE:
        hint = ("give -port-range with ports free on every host" if not alone else
                "give another -port-range, or none to have free ports chosen")
        raise UsageError(f"cannot listen on {shown} ({first.strerror or first}; another job "
                         f"on this host?): {hint}")
    try:
        base, socks = _ports.listen_block(wanted)
    except RuntimeError as e:
        raise UsageError(f"ports {shown} are taken and {e}; give -port-range") from None
    old = "{}-{}".format(*opts.port_range)
    slots = max(h.slots for h in job.hosts)
    opts.port_range = (base, base + slots - 1)
    new = "{}-{}".format(*opts.port_range)
    logger.info(f"{shown} taken (another job on this host?); using -port-range {new} instead "
                f"of {old}")
    return socks


GPU_PROBE_SECONDS = 5.0  # nvidia-smi answers in well under a second on a healthy host


def gpu_count(environ=None) -> int:
    """GPUs on this host, without importing a framework: KUNGFU_GPU_COUNT when set, else the
    lines of `nvidia-smi -L`, else the entries of /proc/driver/nvidia/gpus; 0 when none."""
    override = _env.GPU_COUNT.get(environ)
    if override is not None:
        return override
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True,
                             timeout=GPU_PROBE_SECONDS)
        if out.returncode == 0:
            return sum(1 for line in out.stdout.splitlines() if line.startswith("GPU "))
    except (OSError, subprocess.TimeoutExpired):
        pass
    return len(glob.glob("/proc/driver/nvidia/gpus/*"))


def visible_devices(slot: int, gpus: int, user: Optional[str]) -> Optional[str]:
    """CUDA_VISIBLE_DEVICES for the worker in `slot` of its host, or None to leave the
    variable as it is. `user` is the launcher's own CUDA_VISIBLE_DEVICES (None: unset)."""
    if user is not None:
        devices = [d.strip() for d in user.split(",") if d.strip()]
        return devices[slot % len(devices)] if len(devices) > 1 else None
    return str(slot % gpus) if gpus > 0 else None
