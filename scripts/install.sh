#!/usr/bin/env bash
# Creates .venv (if missing) and installs kungfu into it in editable mode, with TensorFlow (CPU)
# and the test dependencies. kungfu is built without build isolation so that CMake sees the
# TensorFlow it must build its op library against.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
pip() { .venv/bin/python -m pip --disable-pip-version-check "$@"; }
pip install --quiet --upgrade pip
pip install --quiet "setuptools>=64" wheel "pybind11>=2.12" "cmake>=3.18" \
  "tensorflow-cpu==2.21.*" scikit-learn
pip install --quiet --no-build-isolation -e ".[test]"
.venv/bin/python -c "import kungfu, kungfu._kungfu; print('kungfu', kungfu.__version__, 'installed')"
# etcd for tests/unit/test_store_etcd.py (EtcdStore against a real etcd server). Optional: where
# it cannot be installed, that test skips and the install still succeeds.
if ! command -v etcd >/dev/null 2>&1; then
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ] \
      && { timeout 300 apt-get update -qq \
           && DEBIAN_FRONTEND=noninteractive timeout 600 apt-get install -y -qq etcd-server; } \
         >/dev/null 2>&1 \
      && command -v etcd >/dev/null 2>&1; then
    echo "etcd installed: $(command -v etcd)"
  else
    echo "etcd-server not installed (no apt-get, not root, or apt-get failed): the etcd test (tests/unit/test_store_etcd.py) will be skipped"
  fi
fi
# clang, for the libFuzzer run of the frame and handshake parsers in scripts/test.sh. Optional:
# without it that run is skipped (the seeded random-frame tests still run under gcc).
if ! command -v clang++ >/dev/null 2>&1; then
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ] \
      && { timeout 300 apt-get update -qq \
           && DEBIAN_FRONTEND=noninteractive timeout 600 apt-get install -y -qq clang; } \
         >/dev/null 2>&1 \
      && command -v clang++ >/dev/null 2>&1; then
    echo "clang installed: $(command -v clang++)"
  else
    echo "clang not installed (no apt-get, not root, or apt-get failed): the libFuzzer run in scripts/test.sh will be skipped"
  fi
fi
