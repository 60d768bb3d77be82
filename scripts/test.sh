#!/usr/bin/env bash
# The lint check, then the test suite on 8 simulated CPU devices, two workers (the 15 slowest
# tests listed at the end: the suite is kept under 15 minutes on 2 cores); an idle worker takes
# tests queued for the other, so the slow tests do not end the run on one worker alone. The
# end-to-end scenarios (tests marked `scenario`, half a minute or more each in the suite's
# run) are scripts/scenarios.sh's; CI runs both.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
.venv/bin/ruff check .
.venv/bin/python -m pytest -n 2 --dist worksteal --durations=15 -m "not scenario" tests "$@"
