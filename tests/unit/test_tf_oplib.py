"""Loading the TensorFlow op library: the TensorFlow version check, a missing library, and the
numpy-only top-level package.

The version and missing-library cases run in a fresh interpreter against a temporary copy of the
kungfu package, whose files the script changes between imports (a failed import leaves no module
behind, so importing again re-runs the checks).
"""
import importlib.util
import json
import os
import shutil
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(120)

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PACKAGE = os.path.join(REPO_ROOT, "kungfu")
LIB = "libkungfu_tensorflow_ops.so"
VERSION_FILE = "kungfu_tensorflow_ops.tf_version"
REBUILD_HINT = "pip install --no-build-isolation -e ."

needs_tf = pytest.mark.skipif(importlib.util.find_spec("tensorflow") is None,
                              reason="TensorFlow is not installed")

# Run in the fresh interpreter: argv = [dir holding the kungfu copy, library, version file].
LOAD_SCRIPT = r"""
import json, os, sys
root, lib_name, version_name = sys.argv[1:4]
sys.path.insert(0, root)
os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
import tensorflow as tf
pkg = os.path.join(root, "kungfu")
lib = os.path.join(pkg, lib_name)
version_file = os.path.join(pkg, version_name)
out = {"tf_version": tf.__version__}

def attempt(key):
    try:
        import kungfu.tensorflow
        out[key] = {"error": None}
    except BaseException as e:
        out[key] = {"error": type(e).__name__, "message": str(e),
                    "left": sorted(m for m in sys.modules if m.startswith("kungfu.tensorflow"))}

with open(version_file, "w") as f:
    f.write("0.0.0\n")
attempt("other_version")

with open(version_file, "w") as f:
    f.write(tf.__version__ + "\n")
os.rename(lib, lib + ".away")
attempt("missing_library")

os.rename(lib + ".away", lib)
attempt("restored")
import kungfu
out["kungfu_file"] = kungfu.__file__
if out["restored"]["error"] is None:
    from kungfu.tensorflow import ops
    rank, size = ops.peer_info()
    out["peer_info"] = [int(rank), int(size)]
    out["all_reduce"] = ops.all_reduce(tf.constant([1.5, 2.0]), name="x").numpy().tolist()
print("RESULT " + json.dumps(out))
"""


def _env():
    env = {k: v for k, v in os.environ.items() if not k.startswith("KUNGFU_")}
    env.pop("PYTHONPATH", None)  # only the copy may provide kungfu
    env["TF_CPP_MIN_LOG_LEVEL"] = "3"
    return env


@pytest.fixture(scope="module")
def load_results(tmp_path_factory):
    if not os.path.exists(os.path.join(PACKAGE, LIB)):
        pytest.fail(f"{LIB} is not built in {PACKAGE}: build kungfu with TensorFlow installed")
    root = tmp_path_factory.mktemp("pkg")
    shutil.copytree(PACKAGE, root / "kungfu", ignore=shutil.ignore_patterns("__pycache__"))
    p = subprocess.run([sys.executable, "-c", LOAD_SCRIPT, str(root), LIB, VERSION_FILE],
                       check=False, env=_env(), cwd=str(root), capture_output=True, text=True,
                       timeout=100)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    assert p.returncode == 0 and lines, f"rc {p.returncode}\n{p.stdout}\n{p.stderr[-4000:]}"
    out = json.loads(lines[-1][len("RESULT "):])
    out["root"] = str(root)
    return out


@needs_tf
def test_library_built_for_another_tensorflow_is_refused(load_results):
    o = load_results["other_version"]
    tf_version = load_results["tf_version"]
    assert o["error"] == "ImportError", o
    msg = o["message"]
    assert "0.0.0" in msg and tf_version in msg, msg  # both versions
    assert "TensorFlow" in msg, msg
    assert REBUILD_HINT in msg, msg  # how to fix it
    assert o["left"] == [], o  # nothing half-imported


@needs_tf
def test_missing_library_is_an_import_error_that_says_so(load_results):
    o = load_results["missing_library"]
    assert o["error"] == "ImportError", o
    msg = o["message"]
    assert "missing" in msg and "op library" in msg, msg
    assert "TensorFlow" in msg and REBUILD_HINT in msg, msg
    assert o["left"] == [], o


@needs_tf
def test_matching_library_loads_and_runs(load_results):
    # The positive control: the same copy loads once its files are right again, so the errors
    # above came from the checks, not from a broken copy.
    assert load_results["kungfu_file"].startswith(load_results["root"]), load_results
    assert load_results["restored"] == {"error": None}, load_results["restored"]
    assert load_results["peer_info"] == [0, 1]
    assert load_results["all_reduce"] == [1.5, 2.0]


def test_version_stamp_matches_the_installed_tensorflow():
    """The in-tree build is stamped with the TensorFlow version it was built against."""
    if importlib.util.find_spec("tensorflow") is None:
        pytest.skip("TensorFlow is not installed")
    stamp = os.path.join(PACKAGE, VERSION_FILE)
    assert os.path.exists(os.path.join(PACKAGE, LIB)) and os.path.exists(stamp)
    with open(stamp) as f:
        built = f.read().strip()
    # Read the installed version from package metadata: importing TensorFlow here costs seconds.
    from importlib import metadata

    installed = {metadata.version(d) for d in ("tensorflow", "tensorflow-cpu", "tensorflow_cpu")
                 if _has_dist(metadata, d)}
    assert built in installed, (built, installed)


def _has_dist(metadata, name):
    try:
        metadata.version(name)
        return True
    except metadata.PackageNotFoundError:
        return False


def test_import_kungfu_does_not_import_tensorflow():
    code = (
        "import sys, numpy as np\n"
        "import kungfu, kungfu.errors, kungfu.python\n"
        "kungfu.init(); kungfu.allreduce(np.ones(2), name='x'); kungfu.python.run_barrier()\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('tensorflow', 'keras')\n"
        "             or m.startswith('kungfu.tensorflow'))\n"
        "print('LOADED', bad)\n")
    env = _env()
    env["PYTHONPATH"] = REPO_ROOT
    p = subprocess.run([sys.executable, "-c", code], check=False, env=env, cwd=REPO_ROOT,
                       capture_output=True, text=True, timeout=30)
    assert p.returncode == 0, p.stderr
    assert "LOADED []" in p.stdout, p.stdout
