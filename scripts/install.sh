#!/usr/bin/env bash
# Creates .venv (if missing) and installs kungfu into it in editable mode with its test
# dependencies. The native libraries are built by CMake through setup.py.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --upgrade pip
.venv/bin/python -m pip install --quiet -e ".[test]"
.venv/bin/python -c "import kungfu, kungfu._kungfu; print('kungfu', kungfu.__version__, 'installed')"
