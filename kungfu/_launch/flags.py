"""kungfu-run's command line: the flags, their defaults (Options), their checks and -help.

What the command line promises (exit codes, the grace before SIGKILL, the default ports and
strategy) is declared here, where -help states it.
"""
from __future__ import annotations

import difflib
import functools
import itertools
import os
import sys
import textwrap
from dataclasses import dataclass, field
from typing import FrozenSet, List, Optional, Sequence, Tuple

from kungfu import _env, _native, store
from kungfu._hosts import UsageError, parse_port_range
from kungfu._launch import cluster
from kungfu._launch.output import PROG, logger

EXIT_USAGE = 2
EXIT_TIMEOUT = 124
EXIT_CANNOT_EXECUTE = 126
EXIT_NOT_FOUND = 127

DEFAULT_PORT_RANGE = (10000, 11000)
DEFAULT_STRATEGY = "AUTO"
# After SIGTERM, how long a worker may take to exit before it gets SIGKILL.
GRACE_SECONDS = 5.0


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
    builtin_config_port: Optional[int] = None  # 0: auto
    config_server: Optional[str] = None
    config_server_credentials: Optional[str] = None  # a file with etcd's USER:PASSWORD
    job_token_file: Optional[str] = None
    job_token: str = ""  # resolved by run(), never printed
    leave_grace: float = 10.0  # -w: KUNGFU_LEAVE_GRACE, resolved by plan.prepare
    min_np: Optional[int] = None  # -w: the fewest workers a failure may leave
    max_restarts: Optional[int] = None  # -w: how many failures the job survives
    replace: Optional[bool] = None  # -w: start new workers in place of lost ones
    host_cooldown: Optional[float] = None  # -w: seconds a host that failed twice gets no worker
    spares: int = 0  # -w: warm spare processes this launcher keeps (kungfu/_launch/spares.py)
    manager: Optional[str] = None  # what was taken from Slurm or Kubernetes (_launch/cluster.py)
    show_ranks: Optional[FrozenSet[int]] = None  # -show-ranks: the ranks whose output is printed
    ssh_port: Optional[int] = None  # the ssh start (kungfu/_launch/ssh.py): ssh's -p
    ssh_identity_file: Optional[str] = None  # the ssh start: ssh's -i
    stdin_control: bool = False  # started over ssh by another launcher (kungfu/_launch/ssh.py)


_HELP = """\
usage: kungfu-run [flags] [--] command [args...]

Starts the workers of a kungfu job. Workers are numbered host-major in -H order: the first
host's slots get ranks 0, 1, ..., then the next host's, until -np workers are placed. A worker on
its host's slot i listens on port (first port of -port-range) + i. A job on several hosts starts
from one command: given no -self or -nic, kungfu-run starts the workers of the hosts of -H that
are this machine, and the launchers of the others over ssh (below). Or run one kungfu-run per
host, each with the same -np and -H and its own -self or -nic.

Flags (single or double dash: -np 4, --np 4, -np=4):
  -np N               number of workers in the whole job (default 1)
  -H HOST:SLOTS,...   hosts and how many workers each may run; HOST is an IPv4 address or a
                      host name, SLOTS defaults to 1 (default 127.0.0.1:N, all workers here)
  -self IP            this host's address as written in -H; only workers on it are started
  -nic IFACE          take this host's address from the first IPv4 address of IFACE
                      (with neither, this launcher starts every worker when -H names one host
                      or only loopback addresses, and otherwise the ssh start below)
  -port-range A-B     ports the workers of a host listen on (default {ports}; a launcher that
                      runs the whole job moves to free ports when those are taken)
  -strategy S         default allreduce strategy, case-insensitive (default {strategy}):
{strategies}
  -logdir DIR         also write the output of worker r to DIR/rank-r.log (DIR is created);
                      every rank's output, whatever -show-ranks shows
  -show-ranks LIST    print the output of these ranks only, e.g. 0 or 0,2,4-7 (default: all);
                      kungfu-run's own lines are always printed
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
                      (one launcher of the job hosts it; the others use -config-server);
                      auto: a port the system gives, shown in the "config store at" line
  -config-server URL  the job's config store: http://HOST:P (a builtin one; KungFu's
                      http://HOST:P/config too), or etcd's gateway:
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
  -spares K           -w: keep K warm spares on this host (at most its free slots): worker
                      processes started ahead of need, which import and run the script up to
                      the first call that needs their place in the cluster (kf.rank(),
                      kf.size(), a collective; kf.Hook rehearses a joiner's step first) and
                      wait there. A grow or a replacement on this host takes a spare, and
                      another is started (default 0: joiners start from scratch)
  -job-token-file F   the job's secret, read from file F. Workers prove it to each other in
                      every handshake and the builtin config store answers only requests that
                      carry it, so no other process can join or change the job. Default:
                      KUNGFU_JOB_TOKEN if set, else a random secret for this job; a job on
                      several hosts must give every launcher the same one. A given secret
                      needs 128 bits (32 hex digits or 22 base64 characters); make one with
                      python -c "import secrets; print(secrets.token_hex(32))"; the file must
                      be its owner's alone (chmod 600)
  -ssh-port P         the ssh start: the port of the other hosts' ssh servers (ssh -p P)
  -ssh-identity-file F  the ssh start: the private key ssh logs in with (ssh -i F)
  -stdin-control      what the ssh start gives the launchers it starts: the job's secret is the
                      first line of stdin, and the end of stdin (the starting launcher stopped
                      the job, or is gone) stops this launcher's workers as SIGTERM does
  -V, -version        print kungfu-run's version and exit
  -h, -help, --help   print this help and exit

The ssh start: with several hosts in -H and neither -self nor -nic (and not under Slurm or
Kubernetes), kungfu-run starts the workers of the hosts of -H that are this machine (by their
addresses) and, for each other host, "cd $PWD && PYTHON -m kungfu.cmd -stdin-control -self HOST
..." over ssh (PYTHON: the one running kungfu-run; ssh: {ssh} or KUNGFU_SSH, in batch mode, so
never a password prompt) with the same -np, -H, -port-range and -strategy, the KUNGFU_* settings
and PYTHONPATH of this launcher, and the job's secret on its stdin. Their output comes back here
(-show-ranks and -logdir see every rank). A host whose launcher cannot be reached, does not
start within {ssh_start:g}s (KUNGFU_SSH_START_TIMEOUT) or fails fails the job with an error that
names it; SIGINT, SIGTERM, -timeout and a failure stop the other hosts' workers too. With -w,
every other host of -H gets a launcher, following this one's config store (-builtin-config-port
here, or the -config-server given) with the same -min-np, -max-restarts, -replace,
-host-cooldown and -spares; a host whose launcher is lost after it started is a lost host: the
others recover without its workers, it gets no new one, and the job goes on.

In a Slurm job step (srun --ntasks-per-node=1 kungfu-run ...) and without -H, the hosts are the
step's nodes, this host is the node it runs on, -np defaults to one worker per allocated GPU (else
per node), and with -w the first node hosts the config store; the job's secret must still be the
same on every node (KUNGFU_JOB_TOKEN, which srun passes on). See docs/slurm.md. In a pod of a
Kubernetes Indexed Job, the same come from the Job (docs/kubernetes.md).

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
"""


@functools.lru_cache(maxsize=None)
def strategy_names() -> Tuple[str, ...]:
    """The runtime's strategy names (its one table, through kungfu._native), the default last:
    it chooses among the others. The runtime names a code past its last strategy UNKNOWN. Only
    -help and -strategy load the native module; a launcher that is given neither never does."""
    native = _native.lib()
    names = itertools.takewhile(lambda name: name != "UNKNOWN",
                                (native.strategy_name(k) for k in itertools.count()))
    return tuple(sorted(names, key=lambda name: name == DEFAULT_STRATEGY))


def help_text() -> str:
    """What -help prints."""
    return _HELP.format(
        ports="{}-{}".format(*DEFAULT_PORT_RANGE),
        strategies=textwrap.fill(", ".join(strategy_names()), width=96,
                                 initial_indent=" " * 22, subsequent_indent=" " * 22),
        strategy=DEFAULT_STRATEGY,
        identity=", ".join(
            [_env.SELF_SPEC.name, _env.INIT_PEERS.name, _env.INIT_CLUSTER_VERSION.name,
             _env.ALLREDUCE_STRATEGY.name]
        ),
        grace=GRACE_SECONDS,
        ssh=" ".join(_env.SSH.default),
        ssh_start=_env.SSH_START_TIMEOUT.default,
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
    "spares": "spares",
    "show-ranks": "show_ranks",
    "ssh-port": "ssh_port",
    "ssh-identity-file": "ssh_identity_file",
}
# Flags that take no value, or =true / =false.
_BOOL_FLAGS = {"q": "quiet", "v": "verbose", "gpu-per-worker": "gpu_per_worker", "w": "elastic",
               "replace": "replace", "stdin-control": "stdin_control"}
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


def _did_you_mean(name: str) -> str:
    """"; did you mean ...?" for an unknown flag: another launcher's spelling of one of ours
    (_SPELLINGS), or the flag (or spelling) closest to it as difflib measures (a typo such as
    -nps, -logdr, --nproc-per-nodes); "" when none is close."""
    known = [*_VALUE_FLAGS, *_BOOL_FLAGS, *_SPELLINGS, "help", "version"]
    close = [name] if name in _SPELLINGS else difflib.get_close_matches(name, known, n=1,
                                                                        cutoff=0.75)
    if not close:
        return ""
    if close[0] in _SPELLINGS:
        return f"; did you mean {_SPELLINGS[close[0]]}?"
    return f"; did you mean -{close[0]}?"


def parse_ranks(text: str) -> FrozenSet[int]:
    """-show-ranks: "0,2,4-7" -> {0, 2, 4, 5, 6, 7}."""
    ranks = set()
    for part in text.split(","):
        low, dash, high = part.strip().partition("-")
        if not low.isdigit() or (dash and not high.isdigit()) or (dash and int(high) < int(low)):
            raise UsageError(f"-show-ranks takes ranks and ranges such as 0,2,4-7, got {text!r}")
        ranks.update(range(int(low), int(high if dash else low) + 1))
    return frozenset(ranks)


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
    names = strategy_names()
    if name not in names:
        raise UsageError(f"unknown -strategy {text!r} (choose one of {', '.join(names)})")
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
    given = set()  # the value flags given (their Options attributes)
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
            raise UsageError(f"unknown flag {arg.split('=', 1)[0]!r}{_did_you_mean(name)} "
                             f"(see {PROG} -help)")
        if eq:
            value = inline
        else:
            if i >= len(args):
                raise UsageError(f"flag -{name} needs a value")
            value = args[i]
            i += 1
        _set_value(opts, name, value)
        given.add(_VALUE_FLAGS[name])
    opts.command = _command(args[i:])
    opts.manager = cluster.configure(opts, np_given="np" in given)
    _check_together(opts)
    return opts


def _set_value(opts: Options, name: str, value: str) -> None:
    """Sets the option of value flag -name from its text, checked."""
    attr = _VALUE_FLAGS[name]
    if attr == "np":
        opts.np = _parse_np(value)
    elif attr == "min_np":
        opts.min_np = _parse_np(value, "min-np")
    elif attr == "max_restarts":
        if not value.isdigit():
            raise UsageError(f"-max-restarts needs a number >= 0, got {value!r}")
        opts.max_restarts = int(value)
    elif attr == "spares":
        if not value.isdigit():
            raise UsageError(f"-spares needs a number >= 0, got {value!r}")
        opts.spares = int(value)
    elif attr == "host_cooldown":
        opts.host_cooldown = _parse_timeout(value, "host-cooldown", zero=True)
    elif attr == "port_range":
        opts.port_range = parse_port_range(value)
    elif attr == "strategy":
        opts.strategy = parse_strategy(value)
    elif attr == "timeout":
        opts.timeout = _parse_timeout(value)
    elif attr == "show_ranks":
        opts.show_ranks = parse_ranks(value)
    elif attr == "ssh_port":
        if not value.isdigit() or not 0 < int(value) < 65536:
            raise UsageError(f"-ssh-port must be a port number, got {value!r}")
        opts.ssh_port = int(value)
    elif attr == "builtin_config_port":
        if value == "auto":
            opts.builtin_config_port = 0  # the store binds port 0: the system picks a free one
        elif not value.isdigit() or not 0 < int(value) < 65536:
            raise UsageError(f"-builtin-config-port must be a port number or auto, "
                             f"got {value!r}")
        else:
            opts.builtin_config_port = int(value)
    else:
        if value == "":
            raise UsageError(f"flag -{name} needs a non-empty value")
        setattr(opts, attr, value)


def _command(args: List[str]) -> List[str]:
    """The worker command: a path to a .py file is run with this Python."""
    command = list(args)
    if command and command[0].endswith(".py") and os.path.isfile(command[0]):
        command = [sys.executable, *command]  # a script: run with this Python
    if not command:
        raise UsageError(f"no command to run (usage: {PROG} -np N [flags] [--] command args...)")
    return command


def _check_together(opts: Options) -> None:
    """The checks of flags that go (or do not go) together."""
    if opts.self_host is not None and opts.nic is not None:
        raise UsageError("give only one of -self and -nic")
    if opts.stdin_control and (opts.self_host is None or opts.builtin_config_port is not None):
        raise UsageError("-stdin-control is for a launcher that the ssh start runs: with -self "
                         "(and with -w, -config-server: the store is the starter's)")
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
                             or opts.replace is not None or opts.host_cooldown is not None
                             or opts.spares):
        raise UsageError("-builtin-config-port, -config-server, -min-np, -max-restarts, "
                         "-replace, -host-cooldown and -spares are for elastic jobs (-w)")
    if opts.config_server is not None and not opts.config_server.startswith(
            ("http://", "etcd://", "etcds://")):
        raise UsageError(f"-config-server must be http://HOST:P, etcd://HOST:P or etcds://HOST:P, "
                         f"got {opts.config_server!r}")


def check_store_credentials(opts: Options) -> None:
    """Reads -config-server-credentials (or KUNGFU_ETCD_CREDENTIALS) once, so that a bad file is
    a usage error here rather than every worker's; warns, once, when the -config-server URL
    holds a password: kungfu-run's command line is readable by every local user."""
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
