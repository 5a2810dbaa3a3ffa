#!/usr/bin/env bash
# Runs every test: the C++ runtime tests (ctest) and the Python tests (pytest).
# Expects scripts/install.sh to have run.
set -euo pipefail
cd "$(dirname "$0")/.."
jobs=$(nproc 2>/dev/null || echo 2)
cmake -S . -B build/cpp-tests -DKUNGFU_BUILD_TESTS=ON -DKUNGFU_BUILD_PYTHON=OFF > build-cpp-tests.log
cmake --build build/cpp-tests -j "$jobs" >> build-cpp-tests.log || { cat build-cpp-tests.log; exit 1; }
rm -f build-cpp-tests.log
(cd build/cpp-tests && ctest --output-on-failure)
.venv/bin/python -m pytest -q -p no:cacheprovider tests "$@"
