#!/usr/bin/env bash
# The end-to-end scenarios (tests marked `scenario`): the decorator's whole budget search on
# default-size zoo and reference models, the studies' quick runs, two processes planning one
# step. Half a minute or more each in the suite's run; scripts/test.sh runs the rest of the
# suite. Two workers, as there.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
.venv/bin/python -m pytest -n 2 --dist worksteal --durations=10 -m scenario tests "$@"
