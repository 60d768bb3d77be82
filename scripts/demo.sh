#!/usr/bin/env bash
# The main job: build the costed problem of the 4-layer KIWI-config GPT (abstract shapes), then
# plan a CPU-size GPT jointly (sharding + recomputation) under 75% of its fastest plan's peak,
# on a 2x4 mesh of 8 simulated CPU devices, with the embedded solver.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
export XLA_FLAGS="${XLA_FLAGS:-} --xla_force_host_platform_device_count=8"
.venv/bin/kiwi-jax problem --model gpt --preset kiwi --layers 4 --mesh 2x4 --cluster v100-nvlink
.venv/bin/kiwi-jax plan --model gpt --layers 2 --hidden 256 --heads 4 --seq 128 --batch 8 \
    --mesh 2x4 --cluster v100-nvlink --budget 75% --solver kiwi "$@"
