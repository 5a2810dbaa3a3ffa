"""kungfu-run -w: an elastic job's launcher on one host.

It watches the job's config store and keeps this host's workers matching the latest cluster
version (kungfu/elastic/ has the workers' side of a resize):

1. at start, the initial configuration (version 0: the first -np slots of -H) is proposed; a
   launcher that finds one stored already uses it;
2. on every new version, the workers of this host that it lists and that are not running are
   started, with that version's peers, KUNGFU_CONFIG_SERVER and, for versions after 0,
   KUNGFU_ELASTIC_JOINING=1; but never in the place of a worker that died while a version
   still lists it as a member (only after the survivors recovered without it: _may_start);
3. running workers that a new version leaves out detach themselves and exit 0; one still running
   KUNGFU_LEAVE_GRACE (10 s) later (a joiner of an abandoned resize, stuck connecting) is stopped.

A worker that exits 0, or that was left out and stopped, is expected. A joiner that fails
before it reported ready is reported and the job goes on (its resize is abandoned). Any other
worker that fails is written to the store as dead (dead/<peer>): the others recover without it
(kungfu/elastic/) and the job goes on; the launcher lists at the end what the job survived.
The launcher exits once none of its workers runs, the latest version lists none of this host's
workers that has not finished or died, and the job is over (see _job_over); a launcher whose
host has no worker yet keeps watching. Its exit code is 0 if training finished, else the first
failure's.
"""
from __future__ import annotations

import dataclasses
import itertools
import json
import signal
import socket
import time
from typing import Dict, List, Optional, Sequence, Set

from kungfu import _env
from kungfu._hosts import HostSpec, Worker, _is_loopback
from kungfu._launch.flags import EXIT_USAGE, GRACE_SECONDS, Options
from kungfu._launch.launcher import Launcher
from kungfu._launch.output import _fmt_seconds, _plural
from kungfu._launch.processes import _describe_exit, _ended, _exit_code
from kungfu._launch.resize_progress import ResizeProgress
from kungfu._launch.spares import Spares
from kungfu.store import (
    DONE_KEY,
    RECOVERED_PREFIX,
    ClusterConfig,
    ConfigServer,
    StoreError,
    connect,
    shown_url,
)

STORE_WAIT = 60.0  # how long a launcher waits for the store to answer at start
STORE_PROGRESS = 10.0  # seconds between the lines that say it is still waiting
DEFAULT_HOST_COOLDOWN = 60.0  # seconds; kungfu-run -host-cooldown
FAILURE_MERGE = 5.0  # seconds: a host's failures this close are one (a host lost at once)
FAILURE_WINDOW = 600.0  # seconds: two failures of a host this close make it cool down


class ElasticLauncher(Launcher):
    def __init__(self, opts: Options, peers: List[Worker], mine: List[Worker],
                 hosts: Sequence[HostSpec], here: Set[str],
                 listeners: Optional[Dict[str, socket.socket]] = None):
        super().__init__(opts, peers, mine, listeners)
        self.hosts = hosts
        self.here = here
        self.server: Optional[ConfigServer] = None
        self.url = opts.config_server
        self.ids = itertools.count()
        self.by_spec: Dict[str, int] = {}  # running worker of each local peer
        self.version_of: Dict[int, int] = {}  # the cluster version a worker was started for
        self.finished: Dict[str, int] = {}  # local peer -> latest version seen when it exited 0
        self.latest: Optional[ClusterConfig] = None
        self.leaving: Dict[int, float] = {}  # worker -> when it must be gone
        self.stopped: Set[int] = set()  # workers this launcher stopped (expected exits)
        self.store_problem: Optional[str] = None  # the store error last reported, if any
        # [seconds since start, rank, spec, how, exit code, version that replaced it or None]
        # (+ whether the cluster switched to that version, once the job ended)
        self.failures: List[list] = []
        self.done_seen = False  # rank 0 wrote DONE_KEY (see _done)
        # (peer, version) of dead workers the store lacks; version -1: a new worker replaced it
        self.unreported: List[tuple] = []
        self.completed: Set[str] = set()  # local peers whose worker exited 0 (not left out)
        # local peer -> the version its worker that died was started for, until the survivors
        # recovered without it (see _may_start)
        self.died: Dict[str, int] = {}
        self.held: Set[tuple] = set()  # (peer, version) not restarted, said once (_may_start)
        self.host_failures: Dict[str, List[float]] = {}  # host -> when its workers failed
        self.store = None  # the config store's client, once open
        self.seen = -1  # the latest cluster version seen
        self.done = False  # training finished (see _conclude)
        self.progress = ResizeProgress(self.info, self._store_trouble)  # lines of a resize
        self.spares = Spares(self, opts.spares, sorted(here)[0] if here else "127.0.0.1",
                             self._job_env)

    def _store_trouble(self, e: Optional[Exception]) -> None:
        """Reports a store error once per change of message, and the recovery; not every poll."""
        msg = None if e is None else str(e)
        if msg == self.store_problem:
            return
        if msg is not None:
            self.error(f"elastic job: {msg}")
        else:
            self.info("elastic job: the config store answers again")
        self.store_problem = msg

    def _hosts_text(self) -> str:
        return ",".join(f"{h.host}:{h.slots}" for h in self.hosts)

    def _open_store(self):
        if self.opts.builtin_config_port is not None:
            self.server = ConfigServer(self._store_address(), self.opts.builtin_config_port,
                                       token=self.opts.job_token).start()
            self.url = self.server.url
            self.info(f"config store at {self.url}")
        store = connect(self.url, token=self.opts.job_token,
                        credentials=self.opts.config_server_credentials)
        initial = ClusterConfig(0, [w.spec for w in self.peers])
        start = time.monotonic()
        said = 0  # progress lines so far, one every STORE_PROGRESS seconds
        what = f"waiting for the config store at {shown_url(self.url)}"
        while True:
            try:
                # Only the first proposal of version 0 is stored. On a helper thread, as the
                # pause below: a signal or -timeout ends the wait at once (_wait_at_start).
                # The job's slots go with it: a cluster PUT from outside is checked against
                # them (Store.request_cluster).
                self._wait_at_start(what, call=lambda: (store.propose(initial), store.describe_job(
                    self._hosts_text(), "{}-{}".format(*self.opts.port_range))))
                if said:
                    self.info(f"the config store at {shown_url(self.url)} answers")
                return store
            except StoreError as e:
                waited = time.monotonic() - start
                if waited > STORE_WAIT:
                    raise StoreError(f"the config store does not answer: {e}") from None
                if waited >= (said + 1) * STORE_PROGRESS:
                    said = int(waited // STORE_PROGRESS)
                    self.info(f"waiting for the config store ({int(waited)} s so far; gives up "
                              f"after {int(STORE_WAIT)} s): {e}")
                self._wait_at_start(what, 0.5)

    def _store_address(self) -> str:
        """Where the builtin store listens: this host's address in -H (loopback if none)."""
        mine = sorted(self.here)
        return "127.0.0.1" if all(_is_loopback(h) for h in mine) else mine[0]

    def _local(self, cfg: ClusterConfig) -> List[Worker]:
        out = []
        for rank, spec in enumerate(cfg.peers):
            host, _, port = spec.rpartition(":")
            if host in self.here:
                # The slot on its host: the GPU it gets (Launcher._spawn) follows it.
                out.append(Worker(rank, host, int(port), int(port) - self.opts.port_range[0]))
        return out

    def _job_env(self) -> Dict[str, str]:
        """The job's variables every worker of this launcher gets (besides its identity)."""
        extra = {_env.CONFIG_SERVER.name: self.url,
                 _env.ELASTIC_HOSTS.name: self._hosts_text(),
                 _env.PORT_RANGE.name: "{}-{}".format(*self.opts.port_range)}
        if self.opts.min_np is not None:
            extra[_env.MIN_SIZE.name] = str(self.opts.min_np)
        if self.opts.max_restarts is not None:
            extra[_env.MAX_RESTARTS.name] = str(self.opts.max_restarts)
        if self.opts.replace is not None:
            extra[_env.REPLACE.name] = "1" if self.opts.replace else "0"
        return extra

    def _free_slots(self) -> int:
        """This host's slots that the latest version does not use."""
        if self.latest is None:
            return 0
        slots = sum(h.slots for h in self.hosts if h.host in self.here)
        return max(0, slots - len(self._local(self.latest)))

    def _apply(self, store, cfg: ClusterConfig) -> Optional[int]:
        wanted = {w.spec for w in self._local(cfg)}
        for w in self._local(cfg):
            if w.spec in self.by_spec or self.finished.get(w.spec, -1) >= cfg.version:
                continue  # running, or finished in this version (a later one may want it again)
            if not self._may_start(store, w, cfg):
                continue
            joining = cfg.version > 0
            spare = None
            if joining:  # a joiner: a warm spare, if one is alive, becomes it
                spare = self.spares.take(w, _env.worker_env(w.spec, list(cfg.peers), cfg.version,
                                                            self.opts.strategy, joining=True),
                                         self.listener_fd(w.spec))
            if spare is not None:
                key, run, number = spare
                how = f"spare {number}, started {time.monotonic() - run.started:.1f}s ago, is"
            else:
                try:
                    run = self._spawn(w, list(cfg.peers), cfg.version, self._job_env(),
                                      joining=joining)
                except OSError as e:
                    self.error(f"cannot start worker {w.rank} ({w.spec}): {e}")
                    return 127 if isinstance(e, FileNotFoundError) else 126
                key, how = next(self.ids), "started"
                self._watch(run, key)
            self.running[key] = run
            self.by_spec[w.spec] = key
            self.version_of[key] = cfg.version
            lost = [f for f in self.failures if f[2] == w.spec and f[5] is None]
            if lost:
                lost[0][5] = cfg.version  # replaced
                self.unreported.append((w.spec, -1))  # the new worker there is not dead
                self._flush_dead(store)
            self.info(f"version {cfg.version}: {how} worker {w.rank} ({w.spec})"
                      + (" in place of the lost one" if lost else ""))
        now = time.monotonic()
        for spec, key in self.by_spec.items():
            if spec not in wanted and key not in self.leaving:
                self.leaving[key] = now + self.opts.leave_grace
        return None

    def _may_start(self, store, w: Worker, cfg: ClusterConfig) -> bool:
        """Whether a new worker may be started for this host's peer in `cfg`. Any new worker
        after version 0 is a joiner, which only a resize that adds the peer expects. A peer
        whose worker died is a member of every version until the survivors recover without
        it (a recovery never adds a peer; a worker that dies after it checked in may even be
        in the recovered version): a worker started there would wait for rank 0's state while
        the members wait for it in a collective. So it is started again only in a version
        after a stored recovery decision, made since the dead worker was started, that left
        it out: a replacement (or a later resize) asked for by the workers."""
        since = self.died.get(w.spec)
        if since is None:
            return True
        try:
            decisions = store.list(RECOVERED_PREFIX)
        except StoreError as e:
            self._store_trouble(e)
            return False
        for key, value in decisions.items():
            failed = key[len(RECOVERED_PREFIX):]
            try:
                got = json.loads(value)
                left_out = w.spec not in got["peers"] and int(got["version"]) < cfg.version
            except (ValueError, KeyError, TypeError):
                continue
            if failed.isdigit() and int(failed) >= since and left_out:
                del self.died[w.spec]
                return True
        if (w.spec, cfg.version) not in self.held:
            self.held.add((w.spec, cfg.version))
            self.info(f"version {cfg.version} lists worker {w.rank} ({w.spec}), which died: "
                      "no new worker is started there until the others recover without it")
        return False

    def _job_over(self, store) -> bool:
        """With none of this host's workers running: whether to exit. Not while the latest
        version lists a worker of this host that has not finished (or died); then yes if
        training has ended (rank 0 wrote DONE_KEY), if every worker of the job is on this host,
        or if the store is gone (the launcher that hosted it has exited). Otherwise keep
        watching: the job may grow onto this host later."""
        latest = self.latest
        if latest is None:
            return False
        if any(self.finished.get(w.spec, -1) < latest.version and w.spec not in self.died
               for w in self._local(latest)):
            return False  # (a dead worker that a version still lists is not waited for)
        if all(p.rpartition(":")[0] in self.here for p in latest.peers):
            return True
        try:
            return self._done(store, strict=True)
        except StoreError:
            return True

    def _joiner_failed(self, store, key: int) -> bool:
        """Whether a worker that failed was a joiner the cluster had not switched to yet (ready
        or not). If so, it is written to the store as failed, and rank 0 gives its resize up;
        the failure is written before the switch is read, and rank 0 writes the switch before it
        reads the failures, so one of the two sees the other. A store that cannot say counts as
        not switched: the job goes on (the workers abandon the resize when it times out), rather
        than ending for want of an answer; if they had switched, their own failures end it."""
        version = self.version_of[key]
        if version == 0 or (self.latest is not None and version < self.latest.version):
            return False
        spec = self.running[key].worker.spec
        try:
            store.mark_failed(version, spec)
            return not store.switched(version)
        except StoreError as e:
            self._store_trouble(e)
            return True

    def _report_dead(self, store, key: int, rc: int) -> None:
        """A worker failed: the store says so at once (the others recover without it) and the
        launcher keeps watching."""
        run = self.running[key]
        spec, how = run.worker.spec, _describe_exit(rc)
        self.error(f"worker {run.worker.rank} ({spec}) {how}; {self._what_follows(store, spec)}")
        self.unreported.append((spec, self.version_of[key]))
        self.died[spec] = self.version_of[key]
        self._flush_dead(store)
        self._failed(run, how, rc)

    def _what_follows(self, store, spec: str) -> str:
        """What a worker's failure means for the job, as far as this launcher knows: training
        said it cannot recover (rank 0's word in the store, with why: said at the first
        failure), no worker is left (this host's workers that ended at the same time, not yet
        reported, count as gone: a failure of every worker at once), or the others are told to
        recover without it (whether they did, the line of the version they recover to says:
        _say_recovered)."""
        try:
            why = store.no_recovery()
        except StoreError as e:
            self._store_trouble(e)
            why = None
        if why and not self.failures:
            return f"training cannot recover from it, so the job ends: {why}"
        gone = {f[2] for f in self.failures} | {spec} | {
            r.worker.spec for r in self._alive()
            if _ended(r.proc) or r.proc.pid in self._exit_noted}
        left = [p for p in (self.latest.peers if self.latest else ()) if p not in gone]
        if not left:
            return "no other worker of the job is left"
        if why:
            return "the job ends"
        return f"the others ({len(left)}) are told to recover without it"

    def _say_recovered(self, store, old: Optional[ClusterConfig], cfg: ClusterConfig) -> None:
        """The recoveries since the version before `cfg` (the survivors' decisions in the
        store): who they left out, and how many go on."""
        for v in range(0 if old is None else old.version, cfg.version):
            try:
                decided = store.recovery(v)
            except StoreError as e:
                self._store_trouble(e)
                return
            if decided is None:
                continue
            try:
                got = json.loads(decided)
                peers, version = list(got["peers"]), int(got["version"])
            except (ValueError, KeyError, TypeError):
                continue
            lost = [p for p in (old.peers if old is not None and v == old.version else ())
                    if p not in peers]
            self.info(f"version {version}: the others recovered from the failure in version {v}"
                      f"{' without ' + ', '.join(lost) if lost else ''}; "
                      f"{_plural(len(peers), 'worker')} go on")

    def _failed(self, run, how: str, rc: int) -> None:
        """Counts a failure the job survives (listed at the end), and against its host: a host
        that failed twice within FAILURE_WINDOW (failures FAILURE_MERGE apart or less count
        once: a host lost at once) gets no new worker for the cool-down (-host-cooldown; the
        workers read it from the store when they plan a resize)."""
        now = time.monotonic()
        self.failures.append([now - self.start, run.worker.rank, run.worker.spec, how, rc, None])
        cooldown = self.opts.host_cooldown
        cooldown = DEFAULT_HOST_COOLDOWN if cooldown is None else cooldown
        host = run.worker.host
        times = self.host_failures.setdefault(host, [])
        if not cooldown or (times and now - times[-1] <= FAILURE_MERGE):
            return
        times.append(now)
        recent = [t for t in times if now - t <= FAILURE_WINDOW]
        if len(recent) < 2:
            return
        try:
            self.store.cool_down(host, time.time() + cooldown)
        except StoreError as e:
            self._store_trouble(e)
            return
        self.info(f"host {host}: its workers failed {len(recent)} times in "
                  f"{_fmt_seconds(round(now - recent[0], 1))}; it gets no new worker for "
                  f"{_fmt_seconds(cooldown)}")

    def _flush_dead(self, store) -> None:
        """Writes the deaths not yet in the store (it may be down for a while; the survivors
        leave a peer nobody reported out when their recovery window ends)."""
        while self.unreported:
            try:
                store.mark_dead(*self.unreported[0])
            except StoreError as e:
                self._store_trouble(e)
                return
            self.unreported.pop(0)

    def _left_by_recovery(self, store, key: int) -> bool:
        """Whether the others recovered without this worker (it hung), rather than resized."""
        try:
            versions = [k[len(RECOVERED_PREFIX):] for k in store.list(RECOVERED_PREFIX)]
        except StoreError:
            return False
        return any(v.isdigit() and int(v) >= self.version_of[key] for v in versions)

    def _replacements_joined(self) -> None:
        """Notes on each failure whose replacement was started whether the cluster switched to
        it (the store says; read before a builtin store stops): a replacement whose resize was
        abandoned (training ended first, say) never took the lost worker's place."""
        for failure in self.failures:
            version = failure[5]
            if version is not None and len(failure) == 6:
                try:
                    failure.append(self.store.switched(version))
                except StoreError:
                    pass

    def _summary(self, done: bool) -> Optional[int]:
        """The failures, last: survived when training finished, else lost (the job ended
        with them); the exit code if training did not finish."""
        for t, rank, spec, how, _, version, *joined in self.failures:
            by = ("not replaced" if version is None
                  else f"a replacement started in version {version} never joined (its resize "
                       f"was abandoned)" if joined == [False]
                  else f"replaced in version {version}")
            self.info(f"{'survived' if done else 'lost'}: worker {rank} ({spec}) {how} at "
                      f"{t:.1f}s; {by}")
        if done or not self.failures:
            return None
        self.error("elastic job: training did not finish after the failures above")
        return _exit_code(self.failures[0][4])

    # The event loop is the launcher's (Launcher._run); elastic mode extends these points.

    POLL_SECONDS = 0.1

    def _begin(self) -> Optional[int]:
        if self.opts.spares and self.opts.gpu_per_worker and (
                self.gpus or self.user_devices is not None):
            # The device of a slot is chosen before the process starts (CUDA_VISIBLE_DEVICES),
            # and a spare does not know its slot until it is taken.
            self.error("-spares on a host with GPUs needs -gpu-per-worker=false (each worker "
                       "then chooses its device itself, e.g. from kf.local_rank())")
            return EXIT_USAGE
        try:
            self.store = self._open_store()
        except (StoreError, OSError) as e:
            self.error(f"elastic job: {e}")
            return 1
        spares = f", {_plural(self.opts.spares, 'warm spare')} here" if self.opts.spares else ""
        self.info(f"elastic job: {_plural(len(self.peers), 'worker')} to start with, at most "
                  f"{sum(h.slots for h in self.hosts)}{spares}; {self.opts.command[0]} ...")
        return None

    def _poll(self, now: float) -> None:
        """Follows the stored configuration (starting this host's workers that it lists) and
        stops the workers it left out that are still running after KUNGFU_LEAVE_GRACE."""
        store = self.store
        try:
            cfg, _ = store.config()
            self._store_trouble(None)
            self._flush_dead(store)
        except StoreError as e:
            self._store_trouble(e)
            cfg = None
        if cfg is not None and cfg.version >= self.seen:
            # Every poll, not only on a new version: a peer whose old worker was still leaving
            # when its version came is started once that one is gone.
            if cfg.version > self.seen:
                self.progress.new_version(store, self.latest, cfg, now)
                self._say_recovered(store, self.latest, cfg)
                self._renumber(cfg)
            self.seen, self.latest = cfg.version, cfg
            code = self._apply(store, cfg)
            if code is not None:
                self._stop(code, signal.SIGTERM, now)
                return
        if self.latest is not None:
            self.progress.poll(store, self.latest, now)
            if not self.done_seen:
                self.spares.fill(self._free_slots())
        for key, when in list(self.leaving.items()):
            run = self.running[key]
            if run.returncode is None and now >= when and key not in self.stopped:
                self.info(f"worker {run.worker.rank} ({run.worker.spec}) is not in the cluster "
                          f"any more; stopping it")
                self.stopped.add(key)
                run.proc.terminate()
                try:  # a stopped (SIGSTOP) worker takes the SIGTERM once it runs again
                    run.proc.send_signal(signal.SIGCONT)
                except OSError:
                    pass
                if self._left_by_recovery(store, key):
                    self._failed(run, "stopped answering", 1)
            elif run.returncode is None and now >= when + GRACE_SECONDS:
                run.proc.kill()  # one that ignores SIGTERM

    def _renumber(self, cfg: ClusterConfig) -> None:
        """The running workers that `cfg` lists take their rank in it (the prefix of their
        output lines, the launcher's messages): after a recovery or a resize a survivor's rank
        is its place in the new cluster, as its own RANK is once it switched."""
        for spec, key in self.by_spec.items():
            run = self.running.get(key)
            if run is not None and spec in cfg.peers and run.worker.spec == spec:
                run.worker = dataclasses.replace(run.worker, rank=cfg.peers.index(spec))

    def _over(self) -> bool:
        if self._alive():
            return False
        return self.stopping or self._job_over(self.store)

    def _on_exit(self, event: tuple, now: float) -> None:
        """A worker exited: expected (finished, or left out by a version), a joiner that failed
        before the switch (its resize is abandoned), or a failure the others recover from."""
        _, key, rc, _ = event
        if self.spares.exited(key, rc):
            return
        store = self.store
        run = self.running[key]
        run.returncode = rc
        spec = run.worker.spec
        if self.by_spec.get(spec) == key:
            del self.by_spec[spec]
        if rc == 0 and key in self.leaving:
            pass  # left out by a version: a later one may want this peer again
        elif rc == 0:
            self.finished[spec] = self._version_now(store)
            self.completed.add(spec)
            if self.latest is not None and self.latest.peers[0] == spec:
                self._rank_zero_finished(store)
        elif key in self.stopped or self.stopping:
            pass
        elif key in self.leaving:  # left out (a hung worker that woke up late)
            self.info(f"worker {run.worker.rank} ({spec}), no longer in the cluster, "
                      f"{_describe_exit(rc)}")
            if self._left_by_recovery(store, key):
                self._failed(run, "stopped answering", rc)
        elif self._joiner_failed(store, key):
            self.error(f"joining worker {run.worker.rank} ({spec}) {_describe_exit(rc)} before "
                       "the cluster switched to it; its resize will be abandoned")
            self.finished[spec] = self.seen
        else:
            self._report_dead(store, key, rc)
            self.finished[spec] = self.seen

    def _version_now(self, store) -> int:
        """The latest cluster version, read now: a worker that exits 0 finished every version
        written before its exit, also one this launcher's polls have not seen yet (else the next
        poll would start it again there: the script run a second time)."""
        try:
            cfg, _ = store.config()
        except StoreError:
            return self.seen
        return self.seen if cfg is None else max(self.seen, cfg.version)

    def _rank_zero_finished(self, store) -> None:
        """Rank 0 of the latest version exited 0: training is over. kf.Hook says so itself; a
        script without it does not, and the launchers of the other hosts would wait for the job
        to grow onto them again. (A store that does not answer is reported by the polls; the
        other launchers then stop waiting for it anyway.)"""
        if all(p.rpartition(":")[0] in self.here for p in self.latest.peers):
            return  # no other launcher to tell
        try:
            if store.get(DONE_KEY)[0] is None:
                store.put(DONE_KEY, str(self.latest.version))
            self.done_seen = True
        except StoreError:
            pass

    def _conclude(self) -> None:
        # Before the builtin store goes with _close.
        self.done = self.result is None and self._done(self.store)
        self._replacements_joined()

    def _close(self) -> None:
        self.spares.stop()
        if self.server is not None:
            self.server.stop()

    def _success(self) -> int:
        code = self._summary(self.done)
        if code is not None:
            return code
        self.info(f"elastic job finished in {time.monotonic() - self.start:.1f}s")
        return 0

    def _done(self, store, strict: bool = False) -> bool:
        """Whether training finished (rank 0 wrote DONE_KEY). Once seen it is remembered: the
        store may be gone by the time this launcher exits (its host's launcher exited). Without
        an answer: whether a worker of this host finished training (exit 0), unless `strict`
        (then the StoreError)."""
        if self.done_seen:
            return True
        try:
            self.done_seen = store.get(DONE_KEY)[0] is not None
        except StoreError:
            if strict:
                raise
            return bool(self.completed)
        return self.done_seen
