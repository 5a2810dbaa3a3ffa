"""What the benchmark drivers share."""
from __future__ import annotations

import json
from typing import List, Optional


class JsonLines:
    """The measurements of a run: each is printed as one JSON line as it comes (and appended to
    `path`, if given, flushed at once so that an interrupted run keeps what it measured);
    `rows` keeps them for the tables at the end."""

    def __init__(self, path: Optional[str] = None):
        self.rows: List[dict] = []
        self._file = open(path, "w") if path else None

    def emit(self, row: dict) -> None:
        self.rows.append(row)
        line = json.dumps(row)
        print(line, flush=True)
        if self._file:
            self._file.write(line + "\n")
            self._file.flush()

    def close(self) -> None:
        if self._file:
            self._file.close()
            self._file = None


def read_json_lines(path: str) -> List[dict]:
    """The records of a JSON-lines file (a --json file), blank lines skipped."""
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]
