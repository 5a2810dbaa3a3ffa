"""Converts a checkpoint of format version 1 (a pickle, which kungfu no longer loads: loading one
runs whatever code it names) to the current format, in place:

    python -m kungfu.elastic.convert_checkpoint PATH

Only for a file you wrote and trust: this loads its pickle. The converted file is signed with
KUNGFU_CHECKPOINT_KEY when that is set. It records no description of the data it was written
for (version 1 had none), so the data is not checked when training resumes from it.
"""
from __future__ import annotations

import sys

from kungfu import _env
from kungfu.elastic import _checkpoint, _checkpoint_content


def convert(path: str, key: _checkpoint.Key = None) -> None:
    old = _checkpoint.read_v1_trusted(path)
    content = _checkpoint_content.pack_commit(
        old["arrays"], old["variables"], old["state"], old["policies"], old["data"], None,
        old["epochs_total"])
    _checkpoint.write(path, content, key)


def main(argv=None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or args[0].startswith("-"):
        print(__doc__, file=sys.stderr)
        return 2
    try:
        convert(args[0], _env.CHECKPOINT_KEY.get())
    except (OSError, ValueError, KeyError) as e:
        print(f"kungfu: cannot convert {args[0]}: {e}", file=sys.stderr)
        return 1
    print(f"kungfu: {args[0]} converted to checkpoint format version {_checkpoint.VERSION}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
