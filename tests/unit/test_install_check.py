"""A build where TensorFlow is not importable (pip's isolated build environment, for one) stops
with an error that says how to install, unless the numpy-only core is asked for on purpose.

This runs CMake's configure step, where the decision is made, with a Python that has no
TensorFlow (a fresh venv without site packages), instead of a full `pip wheel .` with build
isolation: that one downloads setuptools, pybind11 and cmake and compiles for minutes.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import venv
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(120)

REPO = Path(__file__).resolve().parents[2]
pybind11 = pytest.importorskip("pybind11")
needs_cmake = pytest.mark.skipif(shutil.which("cmake") is None, reason="cmake is not on PATH")


@pytest.fixture(scope="module")
def python_without_tf(tmp_path_factory) -> str:
    home = tmp_path_factory.mktemp("venv-no-tf")
    venv.create(home, with_pip=False, system_site_packages=False, symlinks=True)
    python = str(home / "bin" / "python")
    r = subprocess.run([python, "-c", "import tensorflow"], capture_output=True, timeout=60)
    assert r.returncode != 0, "the bare venv must not see TensorFlow"
    return python


def configure(python: str, build: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["cmake", "-S", str(REPO), "-B", str(build), f"-DPython_EXECUTABLE={python}",
         f"-Dpybind11_DIR={pybind11.get_cmake_dir()}", *extra],
        capture_output=True, text=True, timeout=100, check=False)


@needs_cmake
def test_configure_without_tensorflow_fails_and_says_how_to_install(python_without_tf, tmp_path):
    r = configure(python_without_tf, tmp_path / "b")
    assert r.returncode != 0, r.stdout
    msg = " ".join(r.stderr.split())  # CMake wraps the message
    assert "TensorFlow is not importable" in msg, r.stderr
    assert "No module named 'tensorflow'" in msg, r.stderr
    assert "pip install --no-build-isolation ." in msg
    assert "bash scripts/install.sh" in msg
    assert "KUNGFU_BUILD_TENSORFLOW=0" in msg


@needs_cmake
def test_configure_without_tensorflow_on_purpose(python_without_tf, tmp_path):
    r = configure(python_without_tf, tmp_path / "b", "-DKUNGFU_BUILD_TENSORFLOW=OFF")
    assert r.returncode == 0, r.stderr
    assert "TensorFlow" not in r.stderr


def test_setup_py_rejects_a_bad_opt_out_value(tmp_path):
    env = dict(os.environ, KUNGFU_BUILD_TENSORFLOW="maybe")
    r = subprocess.run([sys.executable, "setup.py", "build_ext", "--build-temp", str(tmp_path),
                        "--build-lib", str(tmp_path / "lib")], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=100, check=False)
    assert r.returncode != 0
    assert "KUNGFU_BUILD_TENSORFLOW='maybe': give 0 or 1" in r.stderr, r.stderr


def _source_copy(dest: Path) -> Path:
    """The checkout's files as git sees them (tracked and not ignored), without build outputs."""
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                           cwd=REPO, capture_output=True, timeout=60, check=True).stdout
    for name in filter(None, files.decode().split("\0")):
        src = REPO / name
        if src.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)
    return dest


@pytest.mark.timeout(300)
@pytest.mark.skipif(shutil.which("git") is None or not (REPO / ".git").exists(),
                    reason="needs a git checkout to copy the sources from")
def test_pip_wheel_with_build_isolation_fails_with_the_command_to_use(tmp_path):
    """The real thing: pip builds in an isolated environment, where TensorFlow is not
    importable; the build must fail and say what to run, not ship a wheel without the ops."""
    src = _source_copy(tmp_path / "src")
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("KUNGFU_", "PIP_NO_BUILD_ISOLATION", "PYTHONPATH"))}
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--disable-pip-version-check",
                        "--no-deps", "-w", str(tmp_path / "wheels"), str(src)],
                       env=env, capture_output=True, text=True, timeout=280, check=False)
    out = r.stdout + r.stderr
    if "TensorFlow is not importable" not in out and (
            "Could not find a version that satisfies" in out or "No matching distribution" in out):
        pytest.skip("the package registry is out of reach: pip cannot set up build isolation")
    assert r.returncode != 0, out[-3000:]
    assert not list(tmp_path.glob("wheels/*.whl")), "a wheel without the op library was built"
    flat = " ".join(out.split())
    assert "TensorFlow is not importable" in flat, out[-3000:]
    assert "pip install --no-build-isolation ." in flat
    assert "CMake's configure step failed" in flat
