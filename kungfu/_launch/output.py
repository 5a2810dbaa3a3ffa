"""What kungfu-run prints: the workers' lines with their rank in front, and its own lines
through the logger "kungfu.run"; both share a stream's lock so that no line is cut by another."""
from __future__ import annotations

import logging
import threading
from typing import BinaryIO, Callable, FrozenSet, Optional, Sequence

from kungfu._hosts import Worker

PROG = "kungfu-run"


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


def shown(ranks: Optional[FrozenSet[int]], label: str) -> bool:
    """Whether -show-ranks `ranks` (None: all) print the lines labelled `label` (a rank, or
    "spare N": a spare has no rank, and is shown only when every rank is)."""
    return ranks is None or (label.isdigit() and int(label) in ranks)


def copy_lines(label: Callable[[], str], pipe: BinaryIO, sink: _Output, log: Optional[BinaryIO],
               log_lock: threading.Lock, ranks: Optional[FrozenSet[int]] = None) -> None:
    """Copies a worker's pipe to `sink` line by line with "[label] " in front (its rank; it may
    change: a warm spare gets a rank when it is taken) when -show-ranks `ranks` show it, and to
    its -logdir file `log` as it is, always, until the pipe ends."""
    for line in iter(pipe.readline, b""):
        if not line.endswith(b"\n"):
            line += b"\n"
        tag = label()
        if shown(ranks, tag):
            sink.write(f"[{tag}] ".encode() + line)
        if log is not None:
            with log_lock:
                try:
                    log.write(line)
                    log.flush()
                except (OSError, ValueError):
                    pass
    pipe.close()


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


def configure_logging(sink: _Output, quiet: bool, verbose: bool) -> None:
    """Points the launcher's logger at `sink` (replacing an earlier sink) at the level that
    -q (`quiet`) / -v (`verbose`) ask for."""
    for h in list(logger.handlers):
        logger.removeHandler(h)
    logger.addHandler(_LogHandler(sink))
    logger.setLevel(logging.WARNING if quiet else logging.DEBUG if verbose
                    else logging.INFO)
    logger.propagate = False
