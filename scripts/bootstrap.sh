#!/usr/bin/env bash
# Creates ./.venv (if missing) and installs the pinned dependencies and this package into it.
# PYTHON names the interpreter (default python3.11, else python3); the lock pins jax and flax
# by its version.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -n "${PYTHON:-}" ]; then
  PY=$PYTHON
  command -v "$PY" >/dev/null 2>&1 || { echo "bootstrap: PYTHON=$PY is not on PATH" >&2; exit 1; }
else
  PY=python3.11
  command -v "$PY" >/dev/null 2>&1 || PY=python3
fi
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
elif [ -n "${PYTHON:-}" ]; then
  version() { "$1" -c 'import sys; print("%d.%d" % sys.version_info[:2])'; }
  want=$(version "$PY")
  have=$(version .venv/bin/python)
  if [ "$want" != "$have" ]; then
    echo "bootstrap: .venv is Python $have, PYTHON=$PYTHON is Python $want;" \
         "remove .venv (rm -r .venv) to build it with $PYTHON" >&2
    exit 1
  fi
fi
stamp=.venv/.kiwi-installed
if [ ! -f "$stamp" ] || [ requirements.lock -nt "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  .venv/bin/python -m pip install --quiet --upgrade pip==24.3.1 setuptools==75.6.0
  .venv/bin/python -m pip install --quiet -r requirements.lock
  .venv/bin/python -m pip install --quiet --no-deps -e .
  touch "$stamp"
fi
