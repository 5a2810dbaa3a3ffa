"""The `kungfu-run` command: see `kungfu-run -help` and docs/kungfu-run.md."""
from __future__ import annotations

import sys
from typing import Optional, Sequence


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of kungfu-run; returns (and, as a script, exits with) the job's exit code."""
    try:
        from kungfu import _launcher

        return _launcher.run(sys.argv[1:] if argv is None else argv)
    except KeyboardInterrupt:
        # Interrupted before the workers' signal handling was in place.
        sys.stderr.write("kungfu-run: interrupted\n")
        return 130


__all__ = ["main"]
