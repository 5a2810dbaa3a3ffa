"""The ssh start: one kungfu-run command for a job on several hosts, as horovodrun and mpirun
start theirs. Given several hosts in -H and neither -self nor -nic, the launcher runs the
workers of the hosts that are this machine (a Launcher, or with -w an ElasticLauncher, as
always) and starts a launcher on each other host that has workers (-w: on every other host,
following this one's config store), over ssh. Those launchers run with -stdin-control:

1. The starter (SshLauncher) runs `ssh [-p P] [-i F] HOST "cd CWD && exec env VARS PYTHON -m
   kungfu.cmd -stdin-control -self HOST -np .. -H .. -- COMMAND"` (remote_command), each in a
   session of its own, so that a Ctrl-C in the terminal reaches only the starter, which decides.
   ssh runs in batch mode (a missing key is an error, never a password prompt), with a connect
   timeout and keep-alives, so a host that is down or goes silent ends its ssh.
2. It writes the job's secret and a newline on the ssh's stdin (never on a command line, which
   every user of the host can read) and keeps the pipe open: the pipe is the remote launcher's
   lifeline.
3. The remote launcher (run_remote) reads the secret from its first line of stdin, plans its
   part, writes READY on its stdout and runs its workers. A thread reads the rest of its stdin;
   the end of it (the starter closed the pipe, or died, or ssh's connection broke) stops the
   workers as SIGTERM does.
4. The starter copies each ssh's output (_copy_remote): READY marks the host as started; "[r] "
   lines are the workers', shown as -show-ranks says and written to -logdir/rank-r.log here; the
   remote launcher's own "kungfu-run: " lines get the host's name (they say what failed there);
   any other line is ssh's or the remote shell's, shown with the host's name and kept as its
   last words.
5. No READY within KUNGFU_SSH_START_TIMEOUT, or an ssh that exits non-zero while the job runs,
   fails the job with an error that names the host and its last words; the exit code is the
   remote launcher's (a worker's there), or EXIT_SSH when ssh itself failed or the launcher
   died. With -w, an ssh that exits non-zero after READY is a lost host instead: the job goes
   on, and the host cools down for good (ElasticSshLauncher).
6. Stopping (a failure, a signal, -timeout): the starter closes every ssh's stdin (step 3) and
   kills an ssh still running REMOTE_STOP_SECONDS later. A starter that dies, even by SIGKILL,
   closes the pipes too: step 3 without the kill.
"""
from __future__ import annotations

import math
import os
import re
import select
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import BinaryIO, Dict, List, Optional, Sequence, Set, Tuple

from kungfu import _env
from kungfu._hosts import HostSpec, UsageError, Worker, _is_loopback
from kungfu._launch.flags import EXIT_NOT_FOUND, GRACE_SECONDS, Options
from kungfu._launch.elastic import ElasticLauncher
from kungfu._launch.launcher import Launcher
from kungfu._launch.output import PROG, _Output, _plural, _ranks, logger, shown
from kungfu.store import StoreError

READY = b"kungfu-run: -stdin-control: started\n"  # step 3, on the remote launcher's stdout
EXIT_SSH = 255  # ssh's own exit code for a failure of its own (or a remote end killed)
# After the stdin of a remote launcher closed, how long it may take to stop its workers (its own
# GRACE_SECONDS before SIGKILL, then its drain) before its ssh is killed.
REMOTE_STOP_SECONDS = GRACE_SECONDS + 10.0
KEEPALIVE_SECONDS = 5  # ssh's ServerAliveInterval: 3 unanswered (15 s) end a silent connection
# Variables kungfu-run sets itself, per host or per worker, or keeps to this launcher.
_NOT_FORWARDED = {_env.JOB_TOKEN.name, _env.SSH.name, _env.SSH_START_TIMEOUT.name,
                  _env.WATCHDOG_FD.name, _env.EXIT_NOTE_FD.name, _env.SPARE_FD.name,
                  *_env.IDENTITY_VARS}
_RANKED = re.compile(rb"^\[(\d+)\] ")
_OWN = PROG.encode() + b": "


def settings() -> Tuple[List[str], float]:
    """KUNGFU_SSH and KUNGFU_SSH_START_TIMEOUT, checked (UsageError)."""
    try:
        return _env.SSH.get(), _env.SSH_START_TIMEOUT.get()
    except ValueError as e:
        raise UsageError(str(e)) from None


def remote_command(opts: Options, host: str, cwd: str, environ=None,
                   store: Optional[str] = None) -> str:
    """What ssh runs on `host` (step 1): its launcher, with this one's flags of the whole job,
    the KUNGFU_* settings and PYTHONPATH of this one, in the same folder. `store`: an elastic
    job's config store, as the other hosts reach it."""
    environ = os.environ if environ is None else environ
    env = [f"{k}={v}" for k, v in sorted(environ.items())
           if (k.startswith("KUNGFU_") and k not in _NOT_FORWARDED) or k == "PYTHONPATH"]
    flags = ["-stdin-control", "-self", host, "-np", str(opts.np), "-H", opts.hosts,
             "-port-range", "{}-{}".format(*opts.port_range), "-strategy", opts.strategy]
    flags += ["-q"] * opts.quiet + ["-v"] * opts.verbose
    flags += [] if opts.gpu_per_worker else ["-gpu-per-worker=false"]
    flags += [] if opts.timeline is None else ["-timeline", opts.timeline]
    flags += _elastic_flags(opts, store) if opts.elastic else []
    words = ["env", *env, sys.executable, "-m", "kungfu.cmd", *flags, "--", *opts.command]
    return f"cd {shlex.quote(cwd)} && exec {shlex.join(words)}"


def _elastic_flags(opts: Options, store: Optional[str]) -> List[str]:
    """-w and the elastic flags of this launcher, for another host's: the same store and rules
    (-spares is per host: each keeps as many)."""
    flags = ["-w", "-config-server", store or ""]
    for flag, value in (("-config-server-credentials", opts.config_server_credentials),
                        ("-min-np", opts.min_np), ("-max-restarts", opts.max_restarts),
                        ("-spares", opts.spares or None)):
        flags += [] if value is None else [flag, str(value)]
    flags += [] if opts.replace is None else [f"-replace={str(opts.replace).lower()}"]
    flags += [] if opts.host_cooldown is None else ["-host-cooldown", f"{opts.host_cooldown!r}s"]
    return flags


def address_toward(host: str) -> str:
    """This machine's address on the route to `host` (a UDP socket's connect sends nothing)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, 9))
        return s.getsockname()[0]


def ssh_command(opts: Options, host: str, remote: str) -> List[str]:
    """The ssh command line that runs `remote` on `host` (step 1)."""
    ssh, start = settings()
    argv = [*ssh, "-o", "BatchMode=yes", "-o", f"ConnectTimeout={math.ceil(start)}",
            "-o", f"ServerAliveInterval={KEEPALIVE_SECONDS}", "-o", "ServerAliveCountMax=3"]
    if opts.ssh_port is not None:
        argv += ["-p", str(opts.ssh_port)]
    if opts.ssh_identity_file is not None:
        argv += ["-i", opts.ssh_identity_file]
    return [*argv, host, remote]


class _Remote:
    """The launcher of another host, as its ssh process."""

    def __init__(self, host: str, workers: List[Worker], proc: subprocess.Popen):
        self.host = host
        self.workers = workers
        self.proc = proc
        self.ready = threading.Event()
        self.returncode: Optional[int] = None
        self.last_words = ""  # the last line of ssh's own (or the remote shell's)
        self.closed = False
        self.readers: List[threading.Thread] = []


class _RankLogs:
    """-logdir files of the ranks of other hosts: written here from the lines that come back."""

    def __init__(self, logdir: Optional[str]):
        self.logdir = logdir
        self.files: Dict[int, BinaryIO] = {}
        self.lock = threading.Lock()

    def open(self, ranks: List[int]) -> None:
        if self.logdir is not None:
            for r in ranks:
                self.files[r] = open(os.path.join(self.logdir, f"rank-{r}.log"), "wb")

    def write(self, rank: int, line: bytes) -> None:
        with self.lock:
            if rank not in self.files and self.logdir is not None:  # -w: a rank new here
                self.files[rank] = open(os.path.join(self.logdir, f"rank-{rank}.log"), "wb")
            f = self.files.get(rank)
            if f is not None and not f.closed:
                f.write(line)
                f.flush()

    def close(self) -> None:
        with self.lock:
            for f in self.files.values():
                f.close()


class _SshStart:
    """The other hosts' launchers as ssh processes, in the event loop of this host's launcher
    (the class this is mixed into: Launcher for a static job, ElasticLauncher with -w)."""

    def __init__(self, remote: List[HostSpec], *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.remote_hosts = remote
        self.remotes: Dict[str, _Remote] = {}
        self.logs = _RankLogs(self.opts.logdir)

    def run(self) -> int:
        try:
            return super().run()
        finally:
            self.logs.close()

    def _no_ssh(self) -> Optional[int]:
        ssh, _ = settings()
        if shutil.which(ssh[0]) is None:
            self.error(f"cannot start the other hosts' launchers: {ssh[0]} not found "
                       f"(KUNGFU_SSH names the ssh command)")
            return EXIT_NOT_FOUND
        return None

    def _start_remotes(self, store: Optional[str] = None) -> None:
        cwd = os.getcwd()
        for h in self.remote_hosts:
            self._start_remote(h.host, cwd, store)

    def _workers_of(self, host: str) -> List[Worker]:
        return [w for w in self.peers if w.host == host]

    def _start_remote(self, host: str, cwd: str, store: Optional[str]) -> None:
        """Steps 1 and 2, and the threads of steps 4 and 5."""
        argv = ssh_command(self.opts, host, remote_command(self.opts, host, cwd, store=store))
        logger.debug(f"{host}: {shlex.join(argv)}")
        proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, start_new_session=True)
        r = self.remotes[host] = _Remote(host, self._workers_of(host), proc)
        self.logs.open([w.rank for w in r.workers])
        try:
            proc.stdin.write(self.opts.job_token.encode() + b"\n")
            proc.stdin.flush()
        except OSError:
            pass  # ssh has ended already: its exit says why
        for pipe, sink in ((proc.stdout, self.out), (proc.stderr, self.err)):
            t = threading.Thread(target=self._copy_remote, args=(r, pipe, sink), daemon=True)
            t.start()
            r.readers.append(t)
        threading.Thread(target=self._wait_remote, args=(r,), daemon=True).start()

    def _wait_remote(self, r: _Remote) -> None:
        _, start = settings()
        if not r.ready.wait(start) and r.proc.poll() is None:
            self.events.put(("ssh-late", r.host, start))
        self.events.put(("ssh-exit", r.host, r.proc.wait(), time.monotonic()))

    def _copy_remote(self, r: _Remote, pipe: BinaryIO, sink: _Output) -> None:
        """Step 4, for one of an ssh's pipes."""
        host = r.host.encode()
        for line in iter(pipe.readline, b""):
            if not line.endswith(b"\n"):
                line += b"\n"
            m = _RANKED.match(line)
            if line == READY and sink is self.out:
                r.ready.set()
            elif m is not None:
                if shown(self.opts.show_ranks, m.group(1).decode()):
                    sink.write(line)
                self.logs.write(int(m.group(1)), line[m.end():])
            elif line.startswith(_OWN):
                sink.write(_OWN + host + b": " + line[len(_OWN):])
            else:
                sink.write(_OWN + host + b": " + line)
                r.last_words = line.decode(errors="replace").strip()
        pipe.close()

    # the event loop's hooks (kungfu/_launch/launcher.py)

    def _on_event(self, event: tuple, now: float) -> None:
        """Step 5: a remote launcher that ended or did not start in time."""
        if event[0] not in ("ssh-late", "ssh-exit"):
            return
        r = self.remotes[event[1]]
        if event[0] == "ssh-late":
            if self.result is None and not self.stopping:
                self.error(f"{r.host}: its launcher did not start within {event[2]:g}s over ssh"
                           f"{self._words(r)}; stopping the job")
                self._stop(EXIT_SSH, signal.SIGTERM, now)
            r.proc.kill()
            return
        r.returncode = rc = event[2]
        if rc == 0 and r.ready.is_set():
            logger.debug(f"{r.host}: its launcher finished")
            return
        code = rc if rc > 0 else EXIT_SSH
        if self.result is None and not self.stopping:
            if r.ready.is_set() and 0 < rc != EXIT_SSH:
                what = f"its launcher exited with code {rc}"
            else:
                what = (f"cannot be reached over ssh, or its launcher died (ssh exited with "
                        f"code {rc})")
            self._lost(r, f"{r.host}: {what}{self._words(r)}", code, now)
        elif self.result is None and self.received_signal is not None:
            self.result = code

    def _lost(self, r: _Remote, what: str, code: int, now: float) -> None:
        """A remote launcher failed or is gone: a static job stops."""
        self.error(f"{what}; stopping the job")
        self._stop(code, signal.SIGTERM, now)

    @staticmethod
    def _words(r: _Remote) -> str:
        return f" ({r.last_words})" if r.last_words else ""

    def _signal_all(self, sig: int) -> None:
        """Step 6: stopping this host's workers stops the other hosts' too."""
        super()._signal_all(sig)
        for r in self.remotes.values():
            self._stop_remote(r)

    def _stop_remote(self, r: _Remote) -> None:
        if r.closed:
            return
        r.closed = True
        try:
            r.proc.stdin.close()
        except OSError:
            pass  # ssh has ended: nothing to tell
        timer = threading.Timer(REMOTE_STOP_SECONDS, r.proc.kill)
        timer.daemon = True
        timer.start()

    def _over(self) -> bool:
        return super()._over() and all(r.returncode is not None for r in self.remotes.values())

    def _close(self) -> None:
        for r in self.remotes.values():
            if r.proc.poll() is None:
                self._stop_remote(r)
        super()._close()

    def _drain(self, seconds: float = 2.0) -> None:
        until = time.monotonic() + seconds
        super()._drain(seconds)
        for r in self.remotes.values():
            for t in r.readers:
                t.join(timeout=max(0.0, until - time.monotonic()))



class SshLauncher(_SshStart, Launcher):
    """A static job on several hosts from one command (see the module's doc): this host's
    workers as Launcher runs them, the other hosts' launchers over ssh, one event loop."""

    def __init__(self, opts: Options, peers: List[Worker], mine: List[Worker],
                 remote: List[HostSpec], listeners: Optional[Dict[str, socket.socket]] = None):
        super().__init__(remote, opts, peers, mine, listeners)

    def _begin(self) -> Optional[int]:
        code = self._no_ssh()
        if code is not None:
            return code
        there = "; ".join(f"{h.host} ({_ranks(self._workers_of(h.host))})"
                          for h in self.remote_hosts)
        here = f"here {_ranks(self.mine)}, " if self.mine else ""
        self.info(f"starting {_plural(len(self.peers), 'worker')}: {here}over ssh on {there}; "
                  f"strategy {self.opts.strategy}: {shlex.join(self.opts.command)}")
        code = self._start_all()  # forks this host's workers before any thread starts
        if code is None:
            self._start_remotes()
        return code

    def _success(self) -> int:
        self.info(f"all {_plural(len(self.peers), 'worker')} on "
                  f"{_plural(len(self.remotes) + bool(self.mine), 'host')} finished "
                  f"successfully in {time.monotonic() - self.start:.1f}s")
        return 0


class ElasticSshLauncher(_SshStart, ElasticLauncher):
    """An elastic job (-w) on several hosts from one command: this host's part as
    ElasticLauncher runs it, a launcher over ssh on every other host of -H (one with no worker
    yet gets workers when the job grows onto it), all of them following one config store. A
    host whose launcher is lost once started is a lost host, as with a launcher per host: its
    workers' peers recover without them, and it gets no new worker (its cool-down lasts for
    good); the job goes on."""

    def __init__(self, opts: Options, peers: List[Worker], mine: List[Worker],
                 hosts: Sequence[HostSpec], here: Set[str], remote: List[HostSpec],
                 listeners: Optional[Dict[str, socket.socket]] = None):
        super().__init__(remote, opts, peers, mine, hosts, here, listeners)

    def _store_address(self) -> str:
        """The builtin store's address: this host's in -H, else the one the others reach
        this machine at."""
        if self.here and not all(_is_loopback(h) for h in self.here):
            return super()._store_address()
        return address_toward(self.remote_hosts[0].host)

    def _begin(self) -> Optional[int]:
        code = self._no_ssh()
        if code is None:
            code = super()._begin()  # opens (or hosts) the store
        if code is None:
            self.info(f"starting the launchers of "
                      f"{', '.join(h.host for h in self.remote_hosts)} over ssh")
            self._start_remotes(self.url)
        return code

    def _lost(self, r: _Remote, what: str, code: int, now: float) -> None:
        if not r.ready.is_set():  # the job cannot start as planned
            super()._lost(r, what, code, now)
            return
        self.error(f"{what}; the job goes on without {r.host} (its workers' peers recover "
                   f"without them; it gets no new worker)")
        try:
            self.store.cool_down(r.host, math.inf)
        except StoreError as e:
            self._store_trouble(e)


# The remote side (step 3).


def read_secret(timeout: float) -> None:
    """-stdin-control: the job's secret, the first line of stdin, becomes this launcher's
    KUNGFU_JOB_TOKEN. Read from the descriptor itself (no buffer, so _watch_stdin sees the rest)
    within `timeout`; UsageError when it does not come."""
    data, until = b"", time.monotonic() + timeout
    while not data.endswith(b"\n"):
        left = until - time.monotonic()
        if left <= 0 or not select.select([0], [], [], left)[0]:
            raise UsageError(f"-stdin-control: no job secret on stdin within {timeout:g}s")
        chunk = os.read(0, 1)
        if not chunk:
            raise UsageError("-stdin-control: stdin ended before the job's secret")
        data += chunk
    os.environ[_env.JOB_TOKEN.name] = data.decode().strip()


def run_remote(opts: Options, job) -> int:
    """A launcher started by the ssh start, for `job` (plan.Plan): says READY, and stops its
    workers when its stdin ends. An elastic one runs even with no worker yet."""
    if opts.elastic:
        launcher = ElasticLauncher(opts, job.peers, job.mine, job.hosts, job.here, job.listeners)
    else:
        launcher = Launcher(opts, job.peers, job.mine, job.listeners)
    sys.stdout.buffer.write(READY)
    sys.stdout.buffer.flush()
    threading.Thread(target=_watch_stdin, args=(launcher,), daemon=True).start()
    return launcher.run() if job.mine or opts.elastic else 0


def _watch_stdin(launcher: Launcher) -> None:
    try:
        while os.read(0, 4096):
            pass
    except OSError:
        pass
    logger.info("the launcher that started this one over ssh stopped the job, or is gone; "
                "stopping")
    launcher.events.put(("signal", signal.SIGTERM))
