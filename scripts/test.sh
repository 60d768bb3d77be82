#!/usr/bin/env bash
# The lint check, then the test suite on 8 simulated CPU devices, two workers.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
.venv/bin/ruff check .
.venv/bin/python -m pytest -n 2 tests "$@"
