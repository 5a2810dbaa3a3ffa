"""Entry point of one worker process started by the `spawn` fixture (see conftest.py).

    python _worker.py JOB RESULT

JOB is a pickle of (module, qualname, args, kwargs). The worker imports `module` (from this
directory or the repository root), calls the function with its arguments and writes a pickle to
RESULT: ("ok", value) or ("error", type name, message, traceback text, exception or None, time).
It exits 0 after success and 1 after an exception; kungfu's own exit handler (which stops the
native peer) runs in both cases, so a worker that hangs or aborts on exit is caught by the fixture.

Worker bodies live in modules that do not import pytest, which keeps process start-up short.
"""
import faulthandler
import importlib
import os
import pickle
import signal
import sys
import time
import traceback


def _write(path, payload):
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        pickle.dump(payload, f, protocol=pickle.HIGHEST_PROTOCOL)
    os.replace(tmp, path)


def main(job_path, result_path):
    # The fixture sends SIGUSR1 before killing a worker that ran out of time: dump every
    # thread's Python stack to stderr so the test report shows where it hung.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    with open(job_path, "rb") as f:
        module, qualname, args, kwargs = pickle.load(f)
    try:
        obj = importlib.import_module(module)
        for part in qualname.split("."):
            obj = getattr(obj, part)
        value = obj(*args, **kwargs)
    except BaseException as e:  # noqa: BLE001 - everything goes back to the test
        try:
            pickle.dumps(e)
            exc = e
        except Exception:  # noqa: BLE001
            exc = None
        _write(result_path, ("error", type(e).__name__, str(e), traceback.format_exc(), exc,
                             time.time()))
        sys.stderr.flush()
        return 1
    try:
        _write(result_path, ("ok", value))
    except Exception:  # noqa: BLE001 - an unpicklable result is the body's bug: report it
        _write(result_path, ("error", "PicklingError", "result is not picklable",
                             traceback.format_exc(), None, time.time()))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
