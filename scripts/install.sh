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
# OpenSSL's headers: the runtime's handshake uses libcrypto (CMakeLists.txt). Required: without
# them the build stops, so they are installed as root with apt-get where they are missing.
if [ ! -e /usr/include/openssl/evp.h ] && command -v apt-get >/dev/null 2>&1 \
    && [ "$(id -u)" = 0 ]; then
  if { timeout 300 apt-get update -qq && DEBIAN_FRONTEND=noninteractive timeout 600 \
         apt-get install -y -qq libssl-dev; } >/dev/null 2>&1; then
    echo "libssl-dev installed"
  else
    echo "libssl-dev not installed (apt-get failed): the build needs OpenSSL's headers" >&2
  fi
fi
pip install --quiet --upgrade pip
pip install --quiet "setuptools>=64" wheel "pybind11>=2.12" "cmake>=3.18" \
  "tensorflow-cpu==2.21.*" scikit-learn
pip install --quiet --no-build-isolation -e ".[test]"
.venv/bin/python -c "import kungfu, kungfu._kungfu; print('kungfu', kungfu.__version__, 'installed')"
# torch for kungfu.torch (docs/torch.md), optional: without it kungfu works and its tests skip.
if pip install --quiet "torch==2.13.0"; then
  echo "torch 2.13.0 installed (kungfu.torch)"
else
  echo "torch not installed: kungfu.torch and its tests (tests/integration/test_torch.py) skip"
fi
# Debian packages for optional tests: installed as root with apt-get (their services are not
# started: the tests start their own); where they cannot be, those tests skip and the install
# still succeeds. optional_apt COMMAND "PACKAGES" "what skips without them".
optional_apt() {
  local cmd=$1 packages=$2 without=$3 policy=""
  command -v "$cmd" >/dev/null 2>&1 && return 0
  if ! command -v apt-get >/dev/null 2>&1 || [ "$(id -u)" != 0 ]; then
    echo "$packages not installed (no apt-get, or not root): $without"
    return 0
  fi
  if [ ! -e /usr/sbin/policy-rc.d ]; then  # keep apt from starting the packages' services
    policy=/usr/sbin/policy-rc.d
    printf '#!/bin/sh\nexit 101\n' > "$policy" && chmod 755 "$policy"
  fi
  # shellcheck disable=SC2086 - a list of packages
  if { timeout 300 apt-get update -qq && DEBIAN_FRONTEND=noninteractive timeout 600 \
         apt-get install -y -qq $packages; } >/dev/null 2>&1 \
      && command -v "$cmd" >/dev/null 2>&1; then
    echo "$packages installed"
  else
    echo "$packages not installed (apt-get failed): $without"
  fi
  [ -z "$policy" ] || rm -f "$policy"
}
# etcd: EtcdStore against a real etcd server (tests/unit/test_store_etcd.py).
optional_apt etcd etcd-server "the etcd test (tests/unit/test_store_etcd.py) will be skipped"
# clang: the libFuzzer run of the frame and handshake parsers in scripts/test.sh (the seeded
# random-frame tests still run under gcc).
optional_apt clang++ clang "the libFuzzer run in scripts/test.sh will be skipped"
# Slurm: kungfu-run in a real two-node Slurm cluster (tests/integration/test_slurm.py).
optional_apt slurmd "slurmctld slurmd slurm-client iproute2" \
  "the Slurm tests (tests/integration/test_slurm.py) will be skipped"
# OpenSSH's server: the ssh start of a job on several hosts, from one kungfu-run command, between
# network namespaces (tests/integration/test_ssh_start.py).
optional_apt sshd "openssh-server openssh-client" \
  "the ssh start's tests (tests/integration/test_ssh_start.py) will be skipped"
