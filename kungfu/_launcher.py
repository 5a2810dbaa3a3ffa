"""kungfu-run: start the workers of one host, label their output, supervise them.

One launcher runs on each host of a job. It computes the whole peer list from -np and -H (the
same on every host), starts the workers whose host is its own, gives each its identity through
the KUNGFU_* environment variables (kungfu._env.worker_env), prefixes every line the workers
print with their rank, forwards SIGINT/SIGTERM, and stops the job when a worker fails or the
time limit passes.

This module uses only the standard library and kungfu._env: it never loads the native runtime
or TensorFlow.
"""
from __future__ import annotations

import glob
import logging
import os
import queue
import re
import secrets
import shlex
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from dataclasses import dataclass, field
from typing import BinaryIO, Dict, List, Optional, Sequence, Tuple

from kungfu import _env
from kungfu._hosts import (  # noqa: F401 - part of the launcher's interface too
    HostSpec,
    UsageError,
    Worker,
    _is_ipv4,
    _is_loopback,
    _valid_host,
    parse_hosts,
    parse_port_range,
    plan_workers,
)

PROG = "kungfu-run"

EXIT_USAGE = 2
EXIT_TIMEOUT = 124
EXIT_CANNOT_EXECUTE = 126
EXIT_NOT_FOUND = 127

DEFAULT_PORT_RANGE = (10000, 11000)
DEFAULT_STRATEGY = "AUTO"
STRATEGIES = (
    "STAR",
    "RING",
    "TREE",
    "BINARY_TREE",
    "BINARY_TREE_STAR",
    "MULTI_BINARY_TREE_STAR",
    "CLIQUE",
    "DIRECT",
    "HIERARCHICAL",
    "MULTI_STAR",
    "AUTO",
)
# After SIGTERM, how long a worker may take to exit before it gets SIGKILL.
GRACE_SECONDS = 5.0
BLAME_WINDOW = 0.1  # seconds of exits compared to find the worker that failed first
# How long a failure waits for the exit of a worker that had begun to exit before it.
EXITING_WAIT = 5.0
# A worker killed by a signal notes no exit: when it died is known only by its reap, and its
# peers, whose collectives fail on it within milliseconds, may note their exits before the
# launcher's waiting thread reaps it (under load, tens of milliseconds later: 4 of 9 kills blamed
# a survivor). So such a death counts as having begun this long before its reap. A failure
# noted earlier than that came first; a signal that is a consequence of a noted failure (a
# crash after a peer's) within it would be blamed instead, which kungfu's workers never do.
SIGNAL_SLACK = 1.0


@dataclass
class Options:
    np: int = 1
    hosts: Optional[str] = None  # raw -H text; None means 127.0.0.1:np
    self_host: Optional[str] = None
    nic: Optional[str] = None
    port_range: Tuple[int, int] = DEFAULT_PORT_RANGE
    strategy: str = DEFAULT_STRATEGY
    logdir: Optional[str] = None
    timeline: Optional[str] = None  # -timeline DIR
    quiet: bool = False
    verbose: bool = False  # -v: debug lines too
    gpu_per_worker: bool = True
    timeout: Optional[float] = None  # seconds
    command: List[str] = field(default_factory=list)
    help: bool = False
    version: bool = False
    elastic: bool = False
    builtin_config_port: Optional[int] = None
    config_server: Optional[str] = None
    config_server_credentials: Optional[str] = None  # a file with etcd's USER:PASSWORD
    job_token_file: Optional[str] = None
    job_token: str = ""  # resolved by run(), never printed
    min_np: Optional[int] = None  # -w: the fewest workers a failure may leave
    max_restarts: Optional[int] = None  # -w: how many failures the job survives
    replace: Optional[bool] = None  # -w: start new workers in place of lost ones
    host_cooldown: Optional[float] = None  # -w: seconds a host that failed twice gets no worker


HELP = """\
usage: kungfu-run [flags] [--] command [args...]

Starts the workers of a kungfu job that run on this host. Run one kungfu-run per host, each with
the same -np and -H. Workers are numbered host-major in -H order: the first host's slots get
ranks 0, 1, ..., then the next host's, until -np workers are placed. A worker on its host's
slot i listens on port (first port of -port-range) + i.

Flags (single or double dash: -np 4, --np 4, -np=4):
  -np N               number of workers in the whole job (default 1)
  -H HOST:SLOTS,...   hosts and how many workers each may run; HOST is an IPv4 address or a
                      host name, SLOTS defaults to 1 (default 127.0.0.1:N, all workers here)
  -self IP            this host's address as written in -H; only workers on it are started
  -nic IFACE          take this host's address from the first IPv4 address of IFACE
                      (without -self or -nic, -H must name one host or only loopback addresses,
                      and then this launcher starts every worker)
  -port-range A-B     ports the workers of a host listen on (default {ports}; a launcher that
                      runs the whole job moves to free ports when those are taken)
  -strategy S         default allreduce strategy, case-insensitive (default {strategy}):
{strategies}
  -logdir DIR         also write the output of worker r to DIR/rank-r.log (DIR is created)
  -timeline DIR       every worker writes a Chrome trace of each collective it runs (bytes,
                      strategy, wait for peers) and of elastic phases to DIR/HOST-PID.trace.json
                      (KUNGFU_TIMELINE=DIR); when the job ends kungfu-run merges this host's
                      files into DIR/timeline.json (open it in ui.perfetto.dev)
  -q                  quiet: print no informational lines of kungfu-run (worker output and
                      errors are still printed)
  -v                  verbose: also print debug lines of kungfu-run: the plan of workers, each
                      worker's command and identity (rank, local rank, GPUs), each exit.
                      kungfu-run's own lines go through Python's logging (logger "kungfu.run",
                      on stderr); worker output is never filtered
  -gpu-per-worker=false  leave CUDA_VISIBLE_DEVICES alone. By default, on a host with GPUs
                      (nvidia-smi -L, or KUNGFU_GPU_COUNT=N) the worker in slot i of its host
                      sees GPU i mod N only; when CUDA_VISIBLE_DEVICES is set to a list of
                      several devices, it sees entry i mod (list length) of that list, and a
                      single device given there is kept for every worker
  -timeout DURATION   stop the job after DURATION (e.g. 90, 30s, 10m, 1h30m), print one line
                      and exit with code 124 (default: no limit)
  -w                  elastic: watch the job's config store and start or stop this host's
                      workers to match each new cluster version (kf.resize); -np is the
                      initial size, the slots of -H the largest. Needs one of:
  -builtin-config-port P  host the config store here, on port P of this host's address
                      (one launcher of the job hosts it; the others use -config-server)
  -config-server URL  the job's config store: http://HOST:P (a builtin one), or etcd's gateway:
                      etcd://HOST:P, or etcds://... over TLS
  -config-server-credentials F  etcd's USER:PASSWORD, read from file F, which only its owner
                      may read (chmod 600); the workers read it too (KUNGFU_ETCD_CREDENTIALS).
                      A password in the URL works but every local user can read it in ps
  -min-np N           -w: a worker that dies or hangs (KUNGFU_PEER_TIMEOUT) is left behind
                      and the others go on from the step it failed in (model.fit with
                      kf.Hook and kf.ElasticData); the job fails instead when fewer than N
                      workers would be left (default 1)
  -max-restarts K     -w: how many failures the job survives (default 3); one more ends it
  -replace=false      -w: go on with the survivors; by default new workers are started in
                      the freed slots after a failure and join as in a resize
  -host-cooldown DURATION  -w: a host whose workers failed twice within 10 minutes
                      (failures seconds apart count once: a host lost at once) gets no new
                      worker for DURATION; meanwhile replacements go to other hosts' free
                      slots, or wait (default 60s; 0: hosts are never left out)
  -job-token-file F   the job's secret, read from file F. Workers prove it to each other in
                      every handshake and the builtin config store answers only requests that
                      carry it, so no other process can join or change the job. Default:
                      KUNGFU_JOB_TOKEN if set, else a random secret for this job; a job on
                      several hosts must give every launcher the same one. A given secret
                      needs 128 bits (32 hex digits or 22 base64 characters); make one with
                      python -c "import secrets; print(secrets.token_hex(32))"; the file must
                      be its owner's alone (chmod 600)
  -V, -version        print kungfu-run's version and exit
  -h, -help, --help   print this help and exit

The command is run as given; a path to an existing .py file is run with the Python that runs
kungfu-run (kungfu-run -np 4 train.py).

Each worker inherits the environment of kungfu-run plus its identity
({identity}; and RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE as torchrun sets them, for
scripts that read them: in an elastic job they describe the worker's start, kf.rank() is current)
and the job's secret (KUNGFU_JOB_TOKEN) and PYTHONUNBUFFERED=1; its stdin is /dev/null. A worker
runs in its own process group, which kungfu-run signals as a whole. If kungfu-run dies (even by
SIGKILL), its workers end too: each inherits a pipe (KUNGFU_WATCHDOG_FD) whose end means the
launcher is gone, and kungfu ends the worker's process group then, through wrappers such as
bash -c.
Every line a worker writes is printed with its rank in front, "[r] ": stdout lines on
kungfu-run's stdout, stderr lines on its stderr.

SIGINT and SIGTERM are forwarded to the workers. When a worker exits with a non-zero code,
the others get SIGTERM, then SIGKILL {grace:g}s later if still running.

Exit code: 0 when every worker exits 0; otherwise the exit code of the first worker that
failed (128+k for a worker killed by signal k); 124 on -timeout; 2 for a bad command line;
127 (126) when the command cannot be found (executed).

Examples:
  kungfu-run -np 4 python train.py --epochs 3
  kungfu-run -np 8 -H 10.0.0.1:4,10.0.0.2:4 -nic eth0 -logdir logs -- python train.py
""".format(
    ports="{}-{}".format(*DEFAULT_PORT_RANGE),
    strategies=textwrap.fill(", ".join(STRATEGIES), width=96, initial_indent=" " * 22,
                             subsequent_indent=" " * 22),
    strategy=DEFAULT_STRATEGY,
    identity=", ".join(
        [_env.SELF_SPEC.name, _env.INIT_PEERS.name, _env.INIT_CLUSTER_VERSION.name,
         _env.ALLREDUCE_STRATEGY.name]
    ),
    grace=GRACE_SECONDS,
)

_VALUE_FLAGS = {
    "np": "np",
    "H": "hosts",
    "self": "self_host",
    "nic": "nic",
    "port-range": "port_range",
    "strategy": "strategy",
    "logdir": "logdir",
    "timeline": "timeline",
    "timeout": "timeout",
    "builtin-config-port": "builtin_config_port",
    "config-server": "config_server",
    "config-server-credentials": "config_server_credentials",
    "job-token-file": "job_token_file",
    "min-np": "min_np",
    "max-restarts": "max_restarts",
    "host-cooldown": "host_cooldown",
}
# Flags that take no value, or =true / =false.
_BOOL_FLAGS = {"q": "quiet", "v": "verbose", "gpu-per-worker": "gpu_per_worker", "w": "elastic",
               "replace": "replace"}
_HELP_FLAGS = {"h", "help"}
_VERSION_FLAGS = {"V", "version"}
# Other launchers' spellings (torchrun, horovodrun, mpirun) -> kungfu-run's.
_SPELLINGS = {
    "n": "-np N (workers in the whole job)",
    "nproc-per-node": "-H HOST:SLOTS (workers per host) and -np N (in all)",
    "nproc_per_node": "-H HOST:SLOTS (workers per host) and -np N (in all)",
    "nnodes": "-H HOST:SLOTS,HOST:SLOTS,... (one entry per host)",
    "hosts": "-H HOST:SLOTS,...",
    "host": "-H HOST:SLOTS,...",
    "hostfile": "-H HOST:SLOTS,... (hosts on the command line)",
}


def _parse_np(text: str, flag: str = "np") -> int:
    try:
        n = int(text)
    except ValueError:
        raise UsageError(f"-{flag} needs a positive integer, got {text!r}") from None
    if n < 1:
        raise UsageError(f"-{flag} must be at least 1, got {n}")
    return n


def parse_strategy(text: str) -> str:
    name = text.strip().upper()
    if name not in STRATEGIES:
        raise UsageError(f"unknown -strategy {text!r} (choose one of {', '.join(STRATEGIES)})")
    return name


def _parse_timeout(text: str, flag: str = "timeout", zero: bool = False) -> float:
    try:
        seconds = _env.parse_duration(text)
    except ValueError as e:
        raise UsageError(f"-{flag}: {e}") from None
    if seconds < 0 or (seconds == 0 and not zero):
        raise UsageError(f"-{flag} must be {'>= 0' if zero else 'positive'}, got {text!r}")
    return seconds


def _parse_bool(name: str, text: str) -> bool:
    low = text.lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    raise UsageError(f"-{name} takes no value or true/false, got {text!r}")


def parse_args(argv: Sequence[str]) -> Options:
    """Flags up to the first non-flag argument or '--'; the rest is the worker command."""
    opts = Options()
    args = list(argv)
    i = 0
    while i < len(args):
        arg = args[i]
        if arg == "--":
            i += 1
            break
        if not arg.startswith("-") or arg == "-":
            break
        body = arg[2:] if arg.startswith("--") else arg[1:]
        name, eq, inline = body.partition("=")
        i += 1
        if name in _HELP_FLAGS:
            opts.help = True
            return opts
        if name in _BOOL_FLAGS:
            setattr(opts, _BOOL_FLAGS[name], _parse_bool(name, inline) if eq else True)
            continue
        if name in _VERSION_FLAGS:
            opts.version = True
            return opts
        if name not in _VALUE_FLAGS:
            hint = _SPELLINGS.get(name)
            hint = f"; did you mean {hint}?" if hint else ""
            raise UsageError(f"unknown flag {arg.split('=', 1)[0]!r}{hint} (see {PROG} -help)")
        if eq:
            value = inline
        else:
            if i >= len(args):
                raise UsageError(f"flag -{name} needs a value")
            value = args[i]
            i += 1
        attr = _VALUE_FLAGS[name]
        if attr == "np":
            opts.np = _parse_np(value)
        elif attr == "min_np":
            opts.min_np = _parse_np(value, "min-np")
        elif attr == "max_restarts":
            if not value.isdigit():
                raise UsageError(f"-max-restarts needs a number >= 0, got {value!r}")
            opts.max_restarts = int(value)
        elif attr == "host_cooldown":
            opts.host_cooldown = _parse_timeout(value, "host-cooldown", zero=True)
        elif attr == "port_range":
            opts.port_range = parse_port_range(value)
        elif attr == "strategy":
            opts.strategy = parse_strategy(value)
        elif attr == "timeout":
            opts.timeout = _parse_timeout(value)
        elif attr == "builtin_config_port":
            if not value.isdigit() or not 0 < int(value) < 65536:
                raise UsageError(f"-builtin-config-port must be a port number, got {value!r}")
            opts.builtin_config_port = int(value)
        else:
            if value == "":
                raise UsageError(f"flag -{name} needs a non-empty value")
            setattr(opts, attr, value)
    opts.command = args[i:]
    if opts.command and opts.command[0].endswith(".py") and os.path.isfile(opts.command[0]):
        opts.command = [sys.executable, *opts.command]  # a script: run with this Python
    if not opts.command:
        raise UsageError(f"no command to run (usage: {PROG} -np N [flags] [--] command args...)")
    if opts.self_host is not None and opts.nic is not None:
        raise UsageError("give only one of -self and -nic")
    if opts.quiet and opts.verbose:
        raise UsageError("give only one of -q and -v")
    if opts.elastic and (opts.builtin_config_port is None) == (opts.config_server is None):
        raise UsageError("-w needs exactly one of -builtin-config-port P and -config-server URL")
    if opts.config_server_credentials is not None and not (opts.config_server or "").startswith(
            ("etcd://", "etcds://")):
        raise UsageError("-config-server-credentials is for an etcd store "
                         "(-config-server etcd://HOST:P or etcds://HOST:P)")
    if not opts.elastic and (opts.builtin_config_port is not None or opts.config_server
                             or opts.min_np is not None or opts.max_restarts is not None
                             or opts.replace is not None or opts.host_cooldown is not None):
        raise UsageError("-builtin-config-port, -config-server, -min-np, -max-restarts, "
                         "-replace and -host-cooldown are for elastic jobs (-w)")
    if opts.config_server is not None and not opts.config_server.startswith(
            ("http://", "etcd://", "etcds://")):
        raise UsageError(f"-config-server must be http://HOST:P, etcd://HOST:P or etcds://HOST:P, "
                         f"got {opts.config_server!r}")
    return opts


def _check_store_credentials(opts: Options) -> None:
    """Reads -config-server-credentials (or KUNGFU_ETCD_CREDENTIALS) once, so that a bad file is
    a usage error here rather than every worker's; warns, once, when the -config-server URL
    holds a password: kungfu-run's command line is readable by every local user."""
    from kungfu import store

    if opts.config_server_credentials is not None:
        opts.config_server_credentials = os.path.abspath(opts.config_server_credentials)
    try:
        path = opts.config_server_credentials or _env.ETCD_CREDENTIALS.get()
        if path is not None and opts.config_server.startswith(("etcd://", "etcds://")):
            store.read_credentials(path)
            if store.url_password(opts.config_server) is not None:
                raise ValueError(f"etcd credentials given twice: in -config-server and in "
                                 f"{path!r}")
    except ValueError as e:
        raise UsageError(str(e)) from None
    given = store.url_password(opts.config_server)
    if given is not None:
        logger.warning(f"warning: -config-server {store.shown_url(opts.config_server)} holds "
                       f"etcd user {given[0]!r}'s password, which every local user can read in "
                       f"this command line (ps); put USER:PASSWORD in a file only you can read "
                       f"(chmod 600) and give -config-server-credentials FILE instead")


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
                         "KUNGFU_JOB_TOKEN to the same value")
    return secrets.token_hex(32)


# ---------------------------------------------------------------------------------------------
# Hosts, peers, ports

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
        raise UsageError(
            f"-H names several hosts ({', '.join(names)}); "
            "give -self IP or -nic IFACE to say which one this is"
        )
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


# ---------------------------------------------------------------------------------------------
# Running workers


class _Output:
    """Serializes prefixed lines onto one of the launcher's streams; ignores a closed reader."""

    def __init__(self, stream: BinaryIO):
        self.stream = stream
        self.lock = threading.Lock()
        self.broken = False

    def write(self, data: bytes) -> None:
        with self.lock:
            if self.broken:
                return
            try:
                self.stream.write(data)
                self.stream.flush()
            except (BrokenPipeError, ValueError, OSError):
                self.broken = True


def _binary(stream) -> BinaryIO:
    return getattr(stream, "buffer", stream)


def _preexec_parent_death_signal():
    """A preexec_fn that kills the worker when the launcher dies (Linux), or None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        prctl = libc.prctl
    except (OSError, AttributeError):
        return None
    pr_set_pdeathsig = 1
    launcher_pid = os.getpid()

    def preexec():
        prctl(pr_set_pdeathsig, int(signal.SIGKILL), 0, 0, 0)
        if os.getppid() != launcher_pid:  # the launcher died before prctl took effect
            os._exit(1)

    return preexec


def _ended(proc) -> bool:
    """Whether a worker's process has ended, though its waiting thread may not have reported
    the exit yet: a look that leaves the process to that thread to reap (WNOWAIT)."""
    if getattr(proc, "returncode", None) is not None:
        return True
    try:
        return os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return False  # not a child of this process (or reaped this instant: reported soon)


class _Interrupted(Exception):
    """A signal or -timeout ended a wait before the event loop ran; `code` is the exit code."""

    def __init__(self, code: int):
        super().__init__(code)
        self.code = code


class _Running:
    def __init__(self, worker: Worker, proc: subprocess.Popen, log: Optional[BinaryIO]):
        self.worker = worker
        self.proc = proc
        self.log = log
        self.log_lock = threading.Lock()
        self.readers: List[threading.Thread] = []
        self.returncode: Optional[int] = None
        self.started = time.monotonic()


def _exit_code(returncode: int) -> int:
    return 128 - returncode if returncode < 0 else returncode


def _describe_exit(returncode: int) -> str:
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"was killed by {name} (exit code {128 - returncode})"
    return f"exited with code {returncode}"


def _plural(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def _ranks(workers: Sequence[Worker]) -> str:
    ranks = [w.rank for w in workers]
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    if ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"ranks {ranks[0]}-{ranks[-1]}"
    return "ranks " + ", ".join(map(str, ranks))


def _fmt_seconds(s: float) -> str:
    return f"{s:g}s"


# kungfu-run's own lines (never the workers' output) go through this logger: INFO by default,
# WARNING with -q, DEBUG with -v. Errors are logged at ERROR and so survive -q.
logger = logging.getLogger("kungfu.run")


class _LogHandler(logging.Handler):
    """Writes records as "kungfu-run: message" lines on an _Output, whose lock keeps them whole
    among the workers' lines."""

    def __init__(self, sink: "_Output"):
        super().__init__()
        self.sink = sink

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.sink.write(f"{PROG}: {record.getMessage()}\n".encode())
        except Exception:
            self.handleError(record)


def configure_logging(opts: Options, sink: "_Output") -> None:
    """Points the launcher's logger at `sink` (replacing an earlier sink) at the level that
    -q / -v ask for."""
    for h in list(logger.handlers):
        logger.removeHandler(h)
    logger.addHandler(_LogHandler(sink))
    logger.setLevel(logging.WARNING if opts.quiet else logging.DEBUG if opts.verbose
                    else logging.INFO)
    logger.propagate = False


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


class Launcher:
    def __init__(self, opts: Options, peers: List[Worker], mine: List[Worker]):
        self.opts = opts
        self.peers = peers
        self.mine = mine
        self.out = _Output(_binary(sys.stdout))
        self.err = _Output(_binary(sys.stderr))
        self.events: "queue.SimpleQueue[tuple]" = queue.SimpleQueue()
        self.running: Dict[int, _Running] = {}
        self._drained = False
        # The event loop's state (see _run).
        self.start = 0.0
        self.result: Optional[int] = None  # the job's exit code, once decided
        self.stopping = False
        self.stop_signal = signal.SIGTERM
        self.kill_at: Optional[float] = None
        self.killed = False
        self.received_signal: Optional[int] = None
        # Workers inherit the read end; only this process holds the write end, so the workers
        # see end of file when it dies, however it dies (kungfu/_watchdog.py).
        self._watchdog = os.pipe()
        # Workers note on this one when they begin to exit (kungfu/_watchdog.py): {pid: time}.
        self._exit_notes = os.pipe()
        self._exit_noted: Dict[int, float] = {}
        self._notes_reader: Optional[threading.Thread] = None
        configure_logging(opts, self.err)
        self.gpus = gpu_count() if opts.gpu_per_worker else 0
        self.user_devices = os.environ.get("CUDA_VISIBLE_DEVICES")
        if opts.gpu_per_worker and (self.gpus or self.user_devices is not None):
            seen = (f"CUDA_VISIBLE_DEVICES={self.user_devices}" if self.user_devices is not None
                    else _plural(self.gpus, "GPU"))
            logger.debug(f"{seen}: each worker sees the device of its slot")

    # messages ---------------------------------------------------------------------------
    def info(self, msg: str) -> None:
        logger.info(msg)

    def error(self, msg: str) -> None:
        logger.error(msg)

    # signals ----------------------------------------------------------------------------
    def _on_signal(self, signum, _frame):
        self.events.put(("signal", signum))

    def _install_signal_handlers(self):
        previous = {}
        for sig in (signal.SIGINT, signal.SIGTERM):
            previous[sig] = signal.signal(sig, self._on_signal)
        return previous

    # workers ----------------------------------------------------------------------------
    def _spawn(self, worker: Worker, peers: Optional[List[str]] = None, version: int = 0,
               extra_env: Optional[Dict[str, str]] = None) -> _Running:
        env = dict(os.environ)
        peers = [p.spec for p in self.peers] if peers is None else peers
        env.update(_env.worker_env(worker.spec, peers, version, self.opts.strategy))
        env.update(extra_env or {})
        if self.opts.gpu_per_worker:
            devices = visible_devices(worker.local_rank, self.gpus, self.user_devices)
            if devices is not None:
                env["CUDA_VISIBLE_DEVICES"] = devices
        if logger.isEnabledFor(logging.DEBUG):
            ident = " ".join(f"{k}={env[k]}" for k in (
                _env.SELF_SPEC.name, _env.INIT_CLUSTER_VERSION.name, *_env.STANDARD_RANK_VARS,
                "CUDA_VISIBLE_DEVICES") if k in env)
            logger.debug(f"worker {worker.rank}: {ident}: {shlex.join(self.opts.command)}")
        env[_env.JOB_TOKEN.name] = self.opts.job_token
        if self.opts.config_server_credentials is not None:
            env[_env.ETCD_CREDENTIALS.name] = self.opts.config_server_credentials
        env[_env.WATCHDOG_FD.name] = str(self._watchdog[0])
        notes = self._exit_notes[1]
        env[_env.EXIT_NOTE_FD.name] = f"{notes}:{os.fstat(notes).st_ino}"
        env["PYTHONUNBUFFERED"] = "1"
        if self.opts.timeline is not None:
            env[_env.TIMELINE.name] = self.opts.timeline
        log = None
        if self.opts.logdir is not None:
            log = open(os.path.join(self.opts.logdir, f"rank-{worker.rank}.log"), "wb")
        try:
            proc = subprocess.Popen(
                self.opts.command,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,  # own process group: signals reach its children too
                preexec_fn=_preexec_parent_death_signal(),
                pass_fds=(self._watchdog[0], notes),
            )
        except BaseException:
            if log is not None:
                log.close()
            raise
        return _Running(worker, proc, log)

    def _pump(self, run: _Running, pipe: BinaryIO, sink: _Output) -> None:
        prefix = f"[{run.worker.rank}] ".encode()
        for line in iter(pipe.readline, b""):
            if not line.endswith(b"\n"):
                line += b"\n"
            sink.write(prefix + line)
            if run.log is not None:
                with run.log_lock:
                    try:
                        run.log.write(line)
                        run.log.flush()
                    except (OSError, ValueError):
                        pass
        pipe.close()

    def _wait(self, run: _Running, key=None) -> None:
        code = run.proc.wait()
        logger.debug(f"worker {run.worker.rank} ({run.worker.spec}) {_describe_exit(code)} "
                     f"after {time.monotonic() - run.started:.1f}s")
        self.events.put(("exit", run.worker.rank if key is None else key, code, time.monotonic()))

    def _read_exit_notes(self) -> None:
        fd, pending = self._exit_notes[0], b""
        while True:
            try:
                data = os.read(fd, 4096)
            except OSError:
                return
            if not data:
                return
            *lines, pending = (pending + data).split(b"\n")
            for line in lines:
                try:
                    pgid, at = line.split()
                    self._exit_noted.setdefault(int(pgid), float(at))
                except ValueError:
                    continue  # not a note

    def _began_failing(self, event: tuple) -> float:
        """When the worker of an exit event began to exit: its note, else its exit (for a death
        by a signal, SIGNAL_SLACK before it)."""
        run = self.running.get(event[1])
        noted = None if run is None else self._exit_noted.get(run.proc.pid)
        if noted is not None:
            return min(noted, event[3])
        return event[3] - SIGNAL_SLACK if event[2] < 0 else event[3]

    def _first_failure(self, event: tuple) -> tuple:
        """The failing exit to blame: of those seen within BLAME_WINDOW of `event`, the one whose
        worker began to exit first. A worker that fails takes its peers down a moment later
        (PeerFailedError), and their exits can come first: a worker that has said goodbye still
        has its own exit to finish. So a worker that noted its exit before the failures seen
        began is waited for (up to EXITING_WAIT), and so is one whose process has ended but
        whose exit is not reported yet (a worker killed by a signal: see SIGNAL_SLACK)."""
        exits, others = [event], []
        start = time.monotonic()
        while True:
            failing = [e for e in exits if e[2] != 0]
            began = min(self._began_failing(e) for e in failing)
            seen = {e[1] for e in exits}
            exiting = any(run.returncode is None and key not in seen
                          and (self._exit_noted.get(run.proc.pid, began) < began
                               or _ended(run.proc))
                          for key, run in self.running.items())
            left = start + (EXITING_WAIT if exiting else BLAME_WINDOW) - time.monotonic()
            if left <= 0:
                break
            try:  # a note may come in meanwhile: look again soon
                e = self.events.get(timeout=min(left, 0.02))
            except queue.Empty:
                continue
            (exits if e[0] == "exit" else others).append(e)
        first = min(failing, key=self._began_failing)
        for e in others + sorted((e for e in exits if e is not first), key=lambda e: e[3]):
            self.events.put(e)  # handled in turn, after the culprit
        return first

    def _signal_all(self, sig: int) -> None:
        for run in self.running.values():
            if run.returncode is None:
                try:
                    os.killpg(run.proc.pid, sig)
                except (ProcessLookupError, PermissionError):
                    try:
                        run.proc.send_signal(sig)
                    except (ProcessLookupError, OSError):
                        pass

    def _alive(self) -> List[_Running]:
        return [r for r in self.running.values() if r.returncode is None]

    # main loop --------------------------------------------------------------------------
    def run(self) -> int:
        start = time.monotonic()
        started_at = time.time()
        previous = self._install_signal_handlers()
        try:
            return self._run(start)
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            if not self._drained:
                self._drain()
            for run in self.running.values():
                if run.log is not None:
                    with run.log_lock:
                        run.log.close()
            if self.opts.timeline is not None:
                self._merge_timeline(started_at)

    def _merge_timeline(self, since: float) -> None:
        """Joins the trace files this job's workers wrote here into DIR/timeline.json."""
        from kungfu import timeline

        try:
            out, files = timeline.merge(self.opts.timeline, since=since)
        except OSError as e:
            self.error(f"timeline: cannot merge the workers' traces in {self.opts.timeline}: {e}")
            return
        self.info(f"timeline: {out} ({_plural(files, 'worker trace')}; open it in "
                  f"ui.perfetto.dev or chrome://tracing)")

    def _drain(self, seconds: float = 2.0) -> None:
        """Waits for the workers' remaining output; a pipe held open by a process a worker
        left behind is abandoned after `seconds`."""
        self._drained = True
        until = time.monotonic() + seconds
        for run in self.running.values():
            for t in run.readers:
                t.join(timeout=max(0.0, until - time.monotonic()))

    def _start_all(self) -> Optional[int]:
        """Starts this host's workers; on failure stops the started ones, returns an exit code."""
        # All workers are forked before any thread of this launcher starts (preexec_fn).
        for worker in self.mine:
            try:
                self.running[worker.rank] = self._spawn(worker)
            except OSError as e:
                cmd = self.opts.command[0]
                if isinstance(e, FileNotFoundError):
                    self.error(f"cannot start worker {worker.rank}: command not found: {cmd}")
                    code = EXIT_NOT_FOUND
                elif isinstance(e, PermissionError):
                    self.error(f"cannot start worker {worker.rank}: permission denied: {cmd}")
                    code = EXIT_CANNOT_EXECUTE
                else:
                    self.error(f"cannot start worker {worker.rank}: {e}")
                    code = EXIT_CANNOT_EXECUTE
                self._signal_all(signal.SIGKILL)
                for run in self.running.values():
                    run.proc.wait()
                    run.returncode = run.proc.returncode
                return code
        for run in self.running.values():
            self._watch(run)
        return None

    def _watch(self, run: _Running, key=None) -> None:
        """Threads that copy the worker's output and report its exit (and, once, the one that
        reads the workers' exit notes)."""
        if self._notes_reader is None:
            self._notes_reader = threading.Thread(target=self._read_exit_notes, daemon=True)
            self._notes_reader.start()
        for pipe, sink in ((run.proc.stdout, self.out), (run.proc.stderr, self.err)):
            t = threading.Thread(target=self._pump, args=(run, pipe, sink), daemon=True)
            t.start()
            run.readers.append(t)
        threading.Thread(target=self._wait, args=(run, key), daemon=True).start()

    # the event loop: one for every mode; elastic mode (kungfu/_elastic_launcher.py) extends it
    # through _begin, _poll, _on_exit, _over, _conclude, _close and _success.

    POLL_SECONDS = 0.5  # the longest wait for an event between two polls

    def _run(self, start: float) -> int:
        self.start = start
        try:
            code = self._begin()
        except _Interrupted as e:
            code = e.code
        if code is not None:
            self._close()
            return code
        deadline = None if self.opts.timeout is None else start + self.opts.timeout
        try:
            while True:
                now = time.monotonic()
                if not self.stopping:
                    self._poll(now)
                if self._over():
                    break
                waits = [self.POLL_SECONDS]
                if deadline is not None and not self.stopping:
                    waits.append(deadline - now)
                if self.kill_at is not None and not self.killed:
                    waits.append(self.kill_at - now)
                try:
                    event = self.events.get(timeout=max(0.0, min(waits)))
                except queue.Empty:
                    event = None
                now = time.monotonic()
                if event is not None and event[0] == "exit":
                    self._on_exit(event, now)
                elif event is not None and event[0] == "signal":
                    self._on_signal_event(event[1], now)
                if deadline is not None and not self.stopping and now >= deadline:
                    self.error(f"timeout: the job did not finish within "
                               f"{_fmt_seconds(self.opts.timeout)}; stopping "
                               f"{_plural(len(self._alive()), 'worker')}")
                    self._stop(EXIT_TIMEOUT, signal.SIGTERM, now)
                if (self.kill_at is not None and not self.killed and now >= self.kill_at
                        and self._alive()):
                    alive = ", ".join(str(r.worker.rank) for r in self._alive())
                    self.error(f"workers {alive} still running {_fmt_seconds(GRACE_SECONDS)} "
                               f"after {signal.Signals(self.stop_signal).name}; sending SIGKILL")
                    self._signal_all(signal.SIGKILL)
                    self.killed = True
            self._conclude()
        finally:
            self._close()
        self._drain()
        if self.result is not None:
            return self.result
        if self.received_signal is not None:
            return 128 + self.received_signal
        return self._success()

    def _stop(self, result: Optional[int], sig: int, now: float) -> None:
        """Ends the job: `result` is its exit code (None: decided later); the workers get `sig`,
        and SIGKILL GRACE_SECONDS later."""
        if result is not None:
            self.result = result
        self.stopping = True
        self.stop_signal = sig
        self._signal_all(sig)
        self.kill_at = now + GRACE_SECONDS

    def _on_signal_event(self, signum: int, now: float) -> None:
        name = signal.Signals(signum).name
        if not self.stopping:
            self.received_signal = signum
            self.info(f"received {name}; forwarding it to "
                      f"{_plural(len(self._alive()), 'worker')}")
            self._stop(None, signum, now)
        elif not self.killed:
            self.error(f"received {name} again; killing the workers")
            self._signal_all(signal.SIGKILL)
            self.killed = True

    def _wait_at_start(self, what: str, seconds: float = 0.0, call=None):
        """A wait before the event loop runs, which honours what the loop would: SIGINT and
        SIGTERM end it at once (exit code 128+k) and so does -timeout (124), by _Interrupted.
        Waits `seconds`, or, given `call`, runs it on a helper thread and returns its result (or
        raises its exception), so that a call that blocks (a request to a host that does not
        answer) cannot hold a signal up. `what` names the wait in the line that ends it."""
        tag = object()
        if call is not None:
            def helper():
                try:
                    self.events.put(("call", tag, True, call()))
                except Exception as e:  # handed to the waiting thread
                    self.events.put(("call", tag, False, e))

            threading.Thread(target=helper, name="kungfu-run-start", daemon=True).start()
        until = None if call is not None else time.monotonic() + seconds
        deadline = None if self.opts.timeout is None else self.start + self.opts.timeout
        while True:
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                self.error(f"timeout: the job did not start within "
                           f"{_fmt_seconds(self.opts.timeout)} ({what})")
                raise _Interrupted(EXIT_TIMEOUT)
            if until is not None and now >= until:
                return None
            waits = [self.POLL_SECONDS] + [t - now for t in (until, deadline) if t is not None]
            try:
                event = self.events.get(timeout=max(0.0, min(waits)))
            except queue.Empty:
                continue
            if event[0] == "signal":
                self.received_signal = event[1]
                self.info(f"received {signal.Signals(event[1]).name} while {what}; exiting")
                raise _Interrupted(128 + event[1])
            if event[0] == "call" and event[1] is tag:
                if event[2]:
                    return event[3]
                raise event[3]
            # Anything else is a late answer of a call given up on: dropped.

    # What a static job does at each point of the loop.

    def _begin(self) -> Optional[int]:
        """Starts the job; an exit code if it cannot."""
        mine = self.mine
        hosts = ", ".join(dict.fromkeys(w.host for w in mine))
        self.info(
            f"starting {_plural(len(mine), 'worker')} of {len(self.peers)} on {hosts} "
            f"({_ranks(mine)}), strategy {self.opts.strategy}: {shlex.join(self.opts.command)}"
        )
        return self._start_all()

    def _poll(self, now: float) -> None:
        """Between events, while the job is not stopping."""

    def _over(self) -> bool:
        return not self._alive()

    def _on_exit(self, event: tuple, now: float) -> None:
        """A worker exited: the first failure stops the job (its exit code is the job's)."""
        if event[2] != 0 and self.result is None and not self.stopping:
            event = self._first_failure(event)
        _, rank, rc, _ = event
        run = self.running[rank]
        run.returncode = rc
        if rc != 0 and self.result is None and not self.stopping:
            others = len(self._alive())
            tail = f"; stopping the other {_plural(others, 'local worker')}"
            self.error(f"worker {rank} ({run.worker.spec}) {_describe_exit(rc)}"
                       + (tail if others else ""))
            self._stop(_exit_code(rc), signal.SIGTERM, now)
        elif rc != 0 and self.result is None and self.received_signal is not None:
            self.result = _exit_code(rc)

    def _conclude(self) -> None:
        """The loop ended (before _close)."""

    def _close(self) -> None:
        """After the loop, however it ended."""

    def _success(self) -> int:
        """The exit code when no failure, timeout or signal decided it."""
        n = len(self.mine)
        self.info(f"{'all ' if n > 1 else ''}{_plural(n, 'worker')} finished successfully in "
                  f"{time.monotonic() - self.start:.1f}s")
        return 0


def _taken(hosts: Sequence[HostSpec], port_range: Tuple[int, int]) -> List[str]:
    """host:port of the slots of `hosts` that cannot be bound now."""
    taken = []
    for h in hosts:
        for port in range(port_range[0], port_range[0] + h.slots):
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                try:
                    s.bind((h.host, port))
                except OSError:
                    taken.append(f"{h.host}:{port}")
    return taken


def _free_default_ports(opts: Options, hosts: Sequence[HostSpec]) -> Optional[str]:
    """A job that runs on this host alone and was given no -port-range: when the default
    ports are taken (another job, most likely), moves to a free range and says so."""
    taken = _taken(hosts, opts.port_range)
    if not taken:
        return None
    from kungfu._ports import free_port_block

    slots = max(h.slots for h in hosts)
    try:
        base = free_port_block(slots, [h.host for h in hosts])
    except RuntimeError as e:
        raise UsageError(f"ports {', '.join(taken)} are taken and {e}; give -port-range") from None
    old = "{}-{}".format(*opts.port_range)
    opts.port_range = (base, base + slots - 1)
    new = "{}-{}".format(*opts.port_range)
    logger.info(f"{', '.join(taken[:3])}{' ...' if len(taken) > 3 else ''} taken (another job "
                f"on this host?); using -port-range {new} instead of {old}")
    return new


def run(argv: Sequence[str]) -> int:
    try:
        opts = parse_args(argv)
        if opts.help:
            sys.stdout.write(HELP)
            sys.stdout.flush()
            return 0
        if opts.version:
            from kungfu import __version__

            sys.stdout.write(f"{PROG} (kungfu) {__version__}\n")
            sys.stdout.flush()
            return 0
        hosts = parse_hosts(opts.hosts) if opts.hosts is not None else [
            HostSpec("127.0.0.1", opts.np)
        ]
        configure_logging(opts, _Output(_binary(sys.stderr)))
        if opts.gpu_per_worker:
            try:
                _env.GPU_COUNT.get()
            except ValueError as e:
                raise UsageError(str(e)) from None
        peers = plan_workers(opts.np, hosts, opts.port_range)
        here = set(local_hosts(opts, hosts))
        mine = [w for w in peers if w.host in here]
        # Alone: this launcher starts every worker the job may have (elastic: every slot).
        alone = all(h.host in here for h in hosts) if opts.elastic else len(mine) == len(peers)
        if opts.port_range == DEFAULT_PORT_RANGE and alone:
            moved = _free_default_ports(opts, hosts)
            if moved is not None:
                peers = plan_workers(opts.np, hosts, opts.port_range)
                mine = [w for w in peers if w.host in here]
        opts.job_token = job_token(opts, alone)
        slots = ", ".join(f"{h.host}:{h.slots}" for h in hosts)
        logger.debug(f"plan: {_plural(opts.np, 'worker')} on {slots}; this host"
                     f" ({', '.join(sorted(here))}) starts {_ranks(mine) if mine else 'none'}"
                     f"; strategy {opts.strategy}{'; elastic' if opts.elastic else ''}")
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
        if opts.config_server is not None:
            _check_store_credentials(opts)
    except UsageError as e:
        sys.stderr.write(f"{PROG}: {e}\n")
        sys.stderr.flush()
        return EXIT_USAGE
    if opts.elastic:
        from kungfu._elastic_launcher import ElasticLauncher

        return ElasticLauncher(opts, peers, mine, hosts, here).run()
    if not mine:
        logger.info(f"none of the {opts.np} workers is placed on {', '.join(sorted(here))} "
                    f"(the hosts before it in -H take them all); nothing to run here")
        return 0
    return Launcher(opts, peers, mine).run()
