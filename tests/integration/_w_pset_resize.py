"""A process set across a resize (run under kungfu-run -w -np 2): _w_pset_resize.py OUT

The two first workers make ProcessSet([0, 1]) and reduce in it, grow the cluster to 3, then use
the old set again (refused: it belongs to the old version) and make a new one. Every worker,
the joiner too, then reduces in ProcessSet([1, 2]) of the new version. Each worker writes one
JSON object to OUT/<pid>.json.
"""
import json
import os
import sys

import numpy as np

import kungfu as kf
import kungfu.python as kp
from kungfu.errors import InvalidArgumentError


def main() -> int:
    out = {"first_size": kf.size()}
    if kf.size() == 2:
        old = kf.ProcessSet([0, 1])
        out["before"] = float(kf.allreduce(np.float64(kf.rank() + 1), process_set=old))
        changed, detached = kp.resize(3)
        out["changed"] = bool(changed)
        try:
            kf.allreduce(np.float64(1), process_set=old)
            out["stale"] = None
        except InvalidArgumentError as e:
            out["stale"] = str(e)
        again = kf.ProcessSet([0, 1])
        out["again"] = float(kf.allreduce(np.float64(kf.rank() + 1), process_set=again))
    new = kf.ProcessSet([1, 2])
    if new.included():
        out["after"] = float(kf.allreduce(np.float64(kf.rank() + 1), process_set=new))
    out["rank"], out["size"] = kf.rank(), kf.size()
    kf.barrier(name="done")
    with open(os.path.join(sys.argv[1], f"{os.getpid()}.json"), "w") as f:
        json.dump(out, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
