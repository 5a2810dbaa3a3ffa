"""Every KUNGFU_* environment variable, declared once: name, type, default, meaning.

`kungfu-run` writes the identity variables for each worker; users may set the tuning ones.
Nothing else in kungfu reads the environment: the native runtime takes these values as arguments.

Build time only (read by setup.py, which cannot import kungfu): KUNGFU_BUILD_TYPE (CMake build
type, default Release) and KUNGFU_BUILD_TENSORFLOW (default 1; 0 builds the numpy-only core
without the TensorFlow op library, which otherwise must be built or the build fails).
"""
from __future__ import annotations

import math
import os
import re
import shlex
from dataclasses import dataclass
from typing import Callable, Optional


def parse_duration(text: str) -> float:
    """Seconds from '90', '90s', '1.5m', '500ms', '2h' or a combination like '1m30s'."""
    s = text.strip().lower()
    if re.fullmatch(r"\d+(\.\d+)?", s):
        return float(s)
    units = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|s|m|h)", s)
    if not parts or "".join(n + u for n, u in parts) != s:
        raise ValueError(f"bad duration {text!r} (examples: 30s, 500ms, 2m, 1h30m)")
    return sum(float(n) * units[u] for n, u in parts)


@dataclass(frozen=True)
class Var:
    name: str
    parse: Callable[[str], object]
    default: object
    doc: str
    secret: bool = False  # an error about the value never shows it

    def get(self, environ: Optional[dict] = None):
        env = os.environ if environ is None else environ
        raw = env.get(self.name)
        if raw is None or raw == "":
            return self.default
        try:
            return self.parse(raw)
        except ValueError as e:
            shown = self.name if self.secret else f"{self.name}={raw!r}"
            raise ValueError(f"environment variable {shown} is invalid: {e}") from None


def _positive_int(s: str) -> int:
    v = int(s)
    if v <= 0:
        raise ValueError("must be a positive integer")
    return v


def _positive_duration(s: str) -> float:
    v = parse_duration(s)
    if v <= 0:
        raise ValueError("must be a positive duration")
    return v


# Identity: set by kungfu-run for each worker. Without SELF_SPEC a process is rank 0 of size 1.
SELF_SPEC = Var("KUNGFU_SELF_SPEC", str, None, "this worker's host:port")
INIT_PEERS = Var("KUNGFU_INIT_PEERS", str, None, "comma-separated host:port of all workers, in rank order")
INIT_CLUSTER_VERSION = Var("KUNGFU_INIT_CLUSTER_VERSION", int, 0, "cluster version the worker starts in")
ALLREDUCE_STRATEGY = Var("KUNGFU_ALLREDUCE_STRATEGY", str, "AUTO", "default collective strategy")

# The job token's strength. A listener proves the token to whoever says hello as a peer (an HMAC
# over a transcript the stranger knows), so a weak token can be guessed offline from one reply:
# a token must resist an offline search. Its strength is estimated from its length and alphabet,
# as if every character were drawn at random: bits = length x log2(the smallest of these
# alphabets that holds all its characters): decimal digits (10), hexadecimal digits of either
# case (16), base64 and base64url with '=' (64), anything else (95, printable ASCII). So 128
# bits take 39 digits, 32 hex digits or 22 base64 characters. The estimate cannot see that a
# long token is made of words or repeats itself: make tokens with a random generator.
MIN_TOKEN_BITS = 128
MAKE_TOKEN = 'python -c "import secrets; print(secrets.token_hex(32))"'
_TOKEN_ALPHABETS = ((10, re.compile(r"[0-9]+")), (16, re.compile(r"[0-9a-fA-F]+")),
                    (64, re.compile(r"[A-Za-z0-9+/_=-]+")))


def token_bits(token: str) -> float:
    """The strength of a job token in bits, estimated from its length and alphabet (above)."""
    size = next((n for n, chars in _TOKEN_ALPHABETS if chars.fullmatch(token)), 95)
    return len(token) * math.log2(size)


def check_job_token(token: str, what: str = "the job token") -> str:
    """`token` if it is strong enough (MIN_TOKEN_BITS), else a ValueError that says why and how
    to make one, without showing it (`what`: the secret's name in the message)."""
    bits = token_bits(token)
    if bits < MIN_TOKEN_BITS:
        raise ValueError(
            f"{what} is too weak: {len(token)} characters, about {int(bits)} bits, fewer "
            f"than {MIN_TOKEN_BITS} (judged by length and alphabet: 32 hex digits or 22 base64 "
            f"characters make {MIN_TOKEN_BITS}); make one with: {MAKE_TOKEN}")
    return token


def read_secret_file(path: str, what: str) -> str:
    """The stripped text of a file holding a secret (`what` names it in errors), which only its
    owner may read or write: a secret in a file others can read is theirs too. ValueError, naming
    the file and the fix, if it cannot be read, is open to others or is empty."""
    try:
        with open(path) as f:
            mode = os.fstat(f.fileno()).st_mode
            text = f.read().strip()
    except OSError as e:
        raise ValueError(f"cannot read {what} {path!r}: {e.strerror or e}") from None
    if mode & 0o077:
        raise ValueError(f"{what} {path!r} is open to other users (mode {mode & 0o7777:04o}): "
                         f"chmod 600 {shlex.quote(path)}")
    if not text:
        raise ValueError(f"{what} {path!r} is empty")
    return text


JOB_TOKEN = Var("KUNGFU_JOB_TOKEN", check_job_token, None,
                "the job's secret: peers prove they know it in every handshake (HMAC over a nonce) "
                "and the builtin config store requires it; kungfu-run makes one per job unless "
                "this is set (give every host's launcher the same value for a multi-host job). "
                f"At least {MIN_TOKEN_BITS} bits (see token_bits): kungfu-run and the workers "
                "refuse a weaker one", secret=True)

def check_checkpoint_key(key: str) -> str:
    return check_job_token(key, "the checkpoint key")


CHECKPOINT_KEY = Var("KUNGFU_CHECKPOINT_KEY", check_checkpoint_key, None,
                     "the authenticity key of kf.Hook's (and ElasticTrainer's) checkpoint file, "
                     "unless checkpoint_key= is given: the file is signed with its HMAC-SHA256, "
                     "and only a file signed with it is resumed from (a changed or forged one is "
                     "refused). Keep it apart from the checkpoints; the same strength rule as "
                     "KUNGFU_JOB_TOKEN", secret=True)

# Elastic jobs (kungfu-run -w): set by kungfu-run for each worker.
def _bool(s: str) -> bool:
    if s.lower() in ("1", "true", "yes", "on"):
        return True
    if s.lower() in ("0", "false", "no", "off"):
        return False
    raise ValueError("must be 0 or 1")


CONFIG_SERVER = Var("KUNGFU_CONFIG_SERVER", str, None,
                    "URL of the config store of an elastic job (http://... or etcd://...)")
ELASTIC_HOSTS = Var("KUNGFU_ELASTIC_HOSTS", str, None,
                    "an elastic job's hosts and slots (kungfu-run's -H); bounds kf.resize")
PORT_RANGE = Var("KUNGFU_PORT_RANGE", str, None, "the ports workers listen on (kungfu-run's -port-range)")
SPARE_FD = Var("KUNGFU_SPARE_FD", int, None,
               "set by kungfu-run -spares: this worker is a warm spare, which waits on this file "
               "descriptor for its place in the cluster (kungfu/_spare.py)")
LISTEN_FD = Var("KUNGFU_LISTEN_FD", int, None,
                "set by kungfu-run: a TCP socket it bound to this worker's address "
                "(KUNGFU_SELF_SPEC), listening, and holds for the whole job; the worker listens on "
                "it instead of binding the port itself, so no other process can take the port "
                "first (ignored where it is not that socket: a process the worker started)")
ELASTIC_JOINING = Var("KUNGFU_ELASTIC_JOINING", _bool, False,
                      "this worker joins a running elastic job (it syncs state before training)")
ETCD_CACERT = Var("KUNGFU_ETCD_CACERT", str, None,
                  "CA file that verifies an etcds:// config store (etcd's gateway over TLS)")
ETCD_CERT = Var("KUNGFU_ETCD_CERT", str, None, "client certificate for an etcds:// config store")
ETCD_KEY = Var("KUNGFU_ETCD_KEY", str, None, "the client certificate's key (KUNGFU_ETCD_CERT)")
ETCD_CREDENTIALS = Var("KUNGFU_ETCD_CREDENTIALS", str, None,
                       "a file holding USER:PASSWORD for an etcd:// or etcds:// config store "
                       "(etcd's authentication), readable by its owner only (chmod 600); kept out "
                       "of the URL, which every local user can read in ps. Set for the workers "
                       "by kungfu-run -config-server-credentials FILE")
WATCHDOG_FD = Var("KUNGFU_WATCHDOG_FD", int, None,
                  "set by kungfu-run: a pipe whose end of file means the launcher died; the "
                  "worker then ends its process group (wrappers like bash -c included)")
EXIT_NOTE_FD = Var("KUNGFU_EXIT_NOTE_FD", str, None,
                   "set by kungfu-run: FD:INODE of a pipe on which the worker notes the moment it "
                   "begins to exit, before it says goodbye to its peers (the launcher blames the "
                   "worker that began to fail first)")
RESIZE_TIMEOUT = Var("KUNGFU_RESIZE_TIMEOUT", _positive_duration, 120.0,
                     "how long a resize waits for its joiners before it is abandoned")
MIN_SIZE = Var("KUNGFU_MIN_SIZE", _positive_int, 1,
               "set by kungfu-run -min-np: an elastic job that loses workers fails rather than "
               "go on with fewer")
MAX_RESTARTS = Var("KUNGFU_MAX_RESTARTS", int, 3,
                   "set by kungfu-run -max-restarts: how many failures an elastic job survives; "
                   "after each, new workers replace the lost ones")
REPLACE = Var("KUNGFU_REPLACE", _bool, True,
              "set by kungfu-run -replace: after a failure, start new workers in place of the "
              "lost ones")
LEAVE_GRACE = Var("KUNGFU_LEAVE_GRACE", _positive_duration, 10.0,
                  "read by kungfu-run -w: how long a worker that the latest cluster version "
                  "leaves out may take to exit on its own before it is stopped (SIGTERM, then "
                  "SIGKILL)")
RECOVERY_WINDOW = Var("KUNGFU_RECOVERY_WINDOW", _positive_duration, 5.0,
                      "after a failure, how long the survivors wait for a peer that neither "
                      "checked in nor was reported dead by its launcher (then it is left out)")

def _count(s: str) -> int:
    v = int(s)
    if v < 0:
        raise ValueError("must be a number >= 0")
    return v


# Read by kungfu-run itself, not by workers.
GPU_COUNT = Var("KUNGFU_GPU_COUNT", _count, None,
                "how many GPUs kungfu-run assumes this host has (default: counted with "
                "`nvidia-smi -L`, or /proc/driver/nvidia/gpus); 0 turns the GPU mapping off")



def _command(s: str) -> list:
    words = shlex.split(s)
    if not words:
        raise ValueError("must name a command")
    return words


SSH = Var("KUNGFU_SSH", _command, ["ssh"],
          "the command (with its options, shell-quoted) with which kungfu-run starts the "
          "launchers of the other hosts of -H when it is given no -self or -nic (the ssh "
          "start, docs/kungfu-run.md), e.g. 'ssh -F ~/.ssh/cluster_config'; -ssh-port and "
          "-ssh-identity-file are added to it")
SSH_START_TIMEOUT = Var("KUNGFU_SSH_START_TIMEOUT", _positive_duration, 30.0,
                        "the ssh start: how long a host's launcher may take to start (ssh's "
                        "connection and log-in included) before the job fails naming the host")

# Tuning: users may set these.
OP_TIMEOUT = Var("KUNGFU_OP_TIMEOUT", _positive_duration, 300.0, "deadline of one collective")
PEER_TIMEOUT = Var("KUNGFU_PEER_TIMEOUT", _positive_duration, 10.0,
                   "silence after which a peer is declared dead")
MISMATCH_GRACE = Var("KUNGFU_MISMATCH_GRACE", parse_duration, 2.0,
                     "two workers each stuck this long in collectives the other has not called "
                     "(different names) fail them at once, naming both (docs/runtime.md, Names "
                     "that differ); 0: only the op deadline ends them")
CONNECT_TIMEOUT = Var("KUNGFU_CONNECT_TIMEOUT", _positive_duration, 120.0,
                      "how long a worker waits for all peers to come up")
PROGRESS_INTERVAL = Var("KUNGFU_PROGRESS_INTERVAL", parse_duration, 10.0,
                        "while a worker waits for its peers to come up, a line on its stderr this "
                        "often naming the peers it still waits for (0: none)")
CHUNK_BYTES = Var("KUNGFU_CHUNK_BYTES", _positive_int, 1 << 20, "largest message; bigger tensors are pipelined")
PARALLELISM = Var("KUNGFU_PARALLELISM", _positive_int, 2, "independent pipelines per large allreduce")
FUSION_BYTES = Var("KUNGFU_FUSION_BYTES", _count, 256 << 10,
                   "tensor fusion: allreduces with the default strategy (or AUTO) are agreed among "
                   "workers and run together, one allreduce over all their buffers, those of at "
                   "most this many bytes packed into one buffer first (0: off, each runs on its "
                   "own thread)")
NCCL_LIBRARY = Var("KUNGFU_NCCL_LIBRARY", str, None,
                   "NCCL to load for device tensors (a path or a soname), tried before the nvidia-nccl "
                   "pip package and the system's libnccl.so.2 (docs/torch.md, GPUs)")
CUDART_LIBRARY = Var("KUNGFU_CUDART_LIBRARY", str, None,
                     "the CUDA runtime to load with NCCL (a path or a soname), tried before the "
                     "nvidia-cuda-runtime pip package and the system's libcudart")


def _gpu_path(s: str) -> str:
    v = s.strip().lower()
    if v not in ("auto", "nccl", "staging", "off"):
        raise ValueError("must be auto, nccl, staging or off")
    return v


GPU = Var("KUNGFU_GPU", _gpu_path, "auto",
          "how collectives on device (CUDA) tensors run: nccl, staging (copied through pinned host "
          "memory and reduced over TCP), off (no GPU backend), or auto: NCCL where it is found "
          "and every worker of a host has a GPU of its own, staging where they share one")
GPU_CHUNK_BYTES = Var("KUNGFU_GPU_CHUNK_BYTES", _positive_int, 4 << 20,
                      "the staging path's chunk: device tensors move through two pinned host "
                      "buffers of this size, one chunk reduced while the next is copied")
RESULT_POOL_BYTES = Var("KUNGFU_RESULT_POOL_BYTES", _count, 1 << 30,
                        "results of numpy collectives called without out= (of at least 1 MiB) "
                        "take their memory from a pool that keeps freed results by size, up to "
                        "this many bytes in all, so a loop that reduces the same shapes every "
                        "step does not fault fresh pages in each time (0: off, np.empty)")

# Observability.
TIMELINE = Var("KUNGFU_TIMELINE", str, None,
               "a directory: each worker writes a Chrome trace of every collective it ran and "
               "of the elastic phases to DIR/<host>-<pid>.trace.json (kungfu/timeline.py); "
               "set by kungfu-run -timeline DIR")

# Experiments: emulated compute, so that adaptation to stragglers can be shown on one machine.
def _slowdown(text: str) -> list:
    """RANK:FACTOR[@STEP],... -> [(rank, factor, from_step)], sorted by step."""
    out = []
    for item in (t.strip() for t in text.split(",")):
        if not item:
            continue
        what, _, step = item.partition("@")
        rank, sep, factor = what.partition(":")
        try:
            entry = (int(rank), float(factor), int(step) if step else 0)
        except ValueError:
            entry = None
        if not sep or entry is None or entry[0] < 0 or not entry[1] > 0 or entry[2] < 0:
            raise ValueError(f"{item!r} is not RANK:FACTOR[@STEP] (e.g. 1:2.0 or 1:2.0@100)")
        out.append(entry)
    return sorted(out, key=lambda e: e[2])


def _seconds(s: str) -> float:
    v = float(s)
    if not v >= 0:
        raise ValueError("must be a number of seconds >= 0")
    return v


SAMPLE_TIME = Var("KUNGFU_SAMPLE_TIME", _seconds, 0.0,
                  "emulated compute: seconds per sample that kf.ElasticData spends (sleeping) "
                  "when it makes each batch of this worker, times its KUNGFU_SLOWDOWN factor")
SAMPLE_JITTER = Var("KUNGFU_SAMPLE_JITTER", _seconds, 0.0,
                    "emulated noise: each batch's emulated compute is multiplied by a factor drawn "
                    "uniformly from [1 - J, 1 + J] (J < 1)")
SLOWDOWN = Var("KUNGFU_SLOWDOWN", _slowdown, [],
               "emulated stragglers: RANK:FACTOR[@STEP],... makes the worker that started as "
               "RANK take FACTOR times KUNGFU_SAMPLE_TIME per sample, from its STEP-th batch "
               "on (default 0; later entries of a rank replace earlier ones)")

ALL = [SELF_SPEC, INIT_PEERS, INIT_CLUSTER_VERSION, ALLREDUCE_STRATEGY, JOB_TOKEN, CHECKPOINT_KEY,
       CONFIG_SERVER, ELASTIC_HOSTS, PORT_RANGE, ELASTIC_JOINING, SPARE_FD, ETCD_CACERT,
       ETCD_CERT, ETCD_KEY, ETCD_CREDENTIALS, WATCHDOG_FD, LISTEN_FD,
       EXIT_NOTE_FD, RESIZE_TIMEOUT, MIN_SIZE, MAX_RESTARTS, REPLACE, RECOVERY_WINDOW, OP_TIMEOUT,
       PEER_TIMEOUT, MISMATCH_GRACE, CONNECT_TIMEOUT, PROGRESS_INTERVAL, CHUNK_BYTES, PARALLELISM, FUSION_BYTES,
       RESULT_POOL_BYTES, NCCL_LIBRARY, CUDART_LIBRARY, GPU, GPU_CHUNK_BYTES,
       TIMELINE, GPU_COUNT, SSH, SSH_START_TIMEOUT, SAMPLE_TIME, SAMPLE_JITTER, SLOWDOWN]


# The variables other launchers set (torchrun, and Horovod's scripts read them too): the worker's
# place. In an elastic job the worker rewrites them when it switches clusters (kungfu._peer).
STANDARD_RANK_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")


# What worker_env gives: a warm spare (kungfu/_spare.py) starts without them.
IDENTITY_VARS = (SELF_SPEC.name, INIT_PEERS.name, INIT_CLUSTER_VERSION.name, ELASTIC_JOINING.name,
                 *STANDARD_RANK_VARS)
# A warm spare's identity: none (set_worker_env removes every identity variable).
NO_IDENTITY = {name: None for name in IDENTITY_VARS}


def worker_env(self_spec: str, peers: list[str], version: int, strategy: Optional[str] = None,
               joining: Optional[bool] = None) -> dict:
    """The variables that tell a worker who it is: the one place they are built, for kungfu-run
    starting a worker, a warm spare taking its place, and a worker that switched clusters
    (kungfu._peer.replace keeps its own os.environ true). `strategy` None leaves the strategy
    variable as it is; `joining` None leaves KUNGFU_ELASTIC_JOINING as it is, False removes it.
    A value None in the result means "remove" (set_worker_env)."""
    rank = peers.index(self_spec)
    host = self_spec.rsplit(":", 1)[0]
    local = [p.rsplit(":", 1)[0] == host for p in peers]
    env = {
        SELF_SPEC.name: self_spec,
        INIT_PEERS.name: ",".join(peers),
        INIT_CLUSTER_VERSION.name: str(version),
        **dict(zip(STANDARD_RANK_VARS, map(str, (rank, len(peers), sum(local[:rank]),
                                                  sum(local))))),
    }
    if strategy is not None:
        env[ALLREDUCE_STRATEGY.name] = strategy
    if joining is not None:
        env[ELASTIC_JOINING.name] = "1" if joining else None
    return env


def set_worker_env(environ, env: dict) -> None:
    """Writes a worker_env (or NO_IDENTITY) into `environ`, a child's environment or
    os.environ: each variable set, those whose value is None removed."""
    for name, value in env.items():
        if value is None:
            environ.pop(name, None)
        else:
            environ[name] = str(value)
