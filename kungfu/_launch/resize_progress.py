"""The progress of a resize as one launcher sees it, in lines of its log.

The launcher sees three moments of a resize in the store (kungfu/elastic/_protocol.py): the new
version, each joiner's ready/<v>/<peer> key, and switched/<v>. The training pause of the
existing workers (the switch and the state broadcast) happens inside the workers; the timeline
shows it, the launcher cannot.
"""
from __future__ import annotations

from typing import Callable, Optional, Set

from kungfu._launch.output import _plural
from kungfu.store import ClusterConfig, Store, StoreError

PROGRESS_POLL = 0.5  # seconds between the store reads that follow a pending resize


class _Resize:
    """A version that adds workers, followed through the store until the cluster switches to
    it: what this launcher can measure, from the moment it saw the version (its polls are
    PROGRESS_POLL apart, so every time is that coarse)."""

    def __init__(self, version: int, joiners: Set[str], seen: float):
        self.version = version
        self.joiners = joiners
        self.seen = seen  # when this launcher first read the version
        self.ready: Set[str] = set()
        self.all_ready: Optional[float] = None
        self.next_poll = seen


class ResizeProgress:
    """Follows the pending resize that adds workers, if any: says when its joiners are ready and
    when the cluster switched to it, or that a later version replaced it."""

    def __init__(self, info: Callable[[str], None], trouble: Callable[[Exception], None]):
        self.info = info  # writes a line of the launcher's log
        self.trouble = trouble  # reports a store error (once per message)
        self.resize: Optional[_Resize] = None  # the pending resize followed

    def new_version(self, store: Store, old: Optional[ClusterConfig], cfg: ClusterConfig,
                    now: float) -> None:
        """The launcher read `cfg`, newer than `old` (None: the first version it read)."""
        if self.resize is not None:
            self._follow(store, old, now)  # it may have switched since the last read
        if self.resize is not None:
            self.info(f"version {self.resize.version}: not switched to; version {cfg.version} "
                      f"replaced it (resize abandoned) after {now - self.resize.seen:.1f}s")
            self.resize = None
        if old is None or cfg.version == 0:
            return
        joiners = set(cfg.peers) - set(old.peers)
        if joiners:
            self.resize = _Resize(cfg.version, joiners, now)
            self.info(f"version {cfg.version}: {len(old.peers)} -> {len(cfg.peers)} workers; "
                      f"waiting for {_plural(len(joiners), 'joiner')} to start and be ready")

    def poll(self, store: Store, latest: ClusterConfig, now: float) -> None:
        """Between events: reads the store every PROGRESS_POLL while a resize is pending."""
        if self.resize is not None and now >= self.resize.next_poll:
            self._follow(store, latest, now)

    def _follow(self, store: Store, latest: ClusterConfig, now: float) -> None:
        r = self.resize
        r.next_poll = now + PROGRESS_POLL
        try:
            ready = set(store.ready_peers(r.version)) & r.joiners
            switched = store.switched(r.version)
        except StoreError as e:
            self.trouble(e)
            return
        if ready - r.ready:
            r.ready |= ready
            self.info(f"version {r.version}: {len(r.ready)} of {len(r.joiners)} joiners ready "
                      f"after {now - r.seen:.1f}s")
            if r.ready == r.joiners:
                r.all_ready = now
        if switched:
            after = "" if r.all_ready is None else \
                f", {now - r.all_ready:.1f}s after the last joiner was ready"
            self.info(f"version {r.version}: switched to {len(latest.peers)} workers "
                      f"{now - r.seen:.1f}s after the version was written{after}")
            self.resize = None
