"""A custom training loop that resizes without kf.Hook, on numpy only (run under kungfu-run -w).

    _w_custom_resize.py OUT MODE SCHEDULE

MODE "resize": every worker calls kungfu.python.resize(n); "propose": rank 0 calls
propose_new_size(n), every worker resize(); "disagree": the workers ask for different sizes;
"replace": kf.resize(size, leave=[n]) replaces rank n by a new worker; "outside": every step
ends with kungfu.python.resize() (no size: the cluster PUT into the config store from outside,
test_outside_resize.py), and the loop runs until OUT/stop exists (SCHEDULE unused).
SCHEDULE "3:3,8:1": after step 3 resize to 3, after step 8 to 1; 12 steps in all.

The model is a vector that every step adds the mean of the workers' ones to (so +1 per step at
any size). The program syncs its own state the KungFu way: the vector and the step are
broadcast from rank 0 when a worker starts (a joiner meets the others there) and after every
resize that changed the cluster. Each worker appends {"step", "size", "rank", "w"} per step
to OUT/<pid>.jsonl, then {"end": ...}.
"""
import json
import os
import sys
import time

import numpy as np

import kungfu as kf
import kungfu.python as kp

STEPS = 12
OUTSIDE_STEPS = 600  # at most, in mode "outside"


def main() -> int:
    out, mode, schedule = sys.argv[1], sys.argv[2], sys.argv[3]
    schedule = {int(a): int(b) for a, b in (p.split(":") for p in schedule.split(","))}
    log = open(os.path.join(out, f"{os.getpid()}.jsonl"), "a")
    w, step = np.zeros(4), 0

    def sync():
        nonlocal w, step
        w = kf.broadcast(w, name="sync/w")
        step = int(kf.broadcast(np.int64(step), name="sync/step"))

    sync()
    end = "done"
    while step < (OUTSIDE_STEPS if mode == "outside" else STEPS):
        w = w + kf.allreduce(np.ones(4), name="grad") / kf.size()
        log.write(json.dumps({"step": step, "size": kf.size(), "rank": kf.rank(),
                              "w": float(w[0])}) + "\n")
        log.flush()
        step += 1
        if mode == "outside":
            # Everyone stops at the same step: rank 0's word.
            stop = np.int64(kf.rank() == 0 and os.path.exists(os.path.join(out, "stop")))
            if kf.broadcast(stop, name="stop"):
                break
            time.sleep(0.05)
        elif step not in schedule:
            continue
        n = schedule.get(step)
        if mode == "outside":
            changed, detached = kp.resize()
        elif mode == "propose":
            if kf.rank() == 0:
                kp.propose_new_size(n)
            changed, detached = kp.resize()
        elif mode == "replace":
            changed = kf.resize(kf.size(), leave=[n])
            detached = kf.detached()
        elif mode == "disagree":
            try:
                changed, detached = kp.resize(n + kf.rank())
            except ValueError as e:
                end = f"refused: {e}"
                break
        else:
            changed, detached = kp.resize(n)
        if detached:
            end = "detached"
            break
        if changed:
            sync()
    log.write(json.dumps({"end": end, "w": float(w[0]), "size": kf.size()}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
