#!/usr/bin/env bash
# The main job: a GPT small enough for CPU (2 layers, hidden 256, seq 128, batch 8) on a 2x4 mesh
# of 8 simulated CPU devices, under a per-device budget the plain step does not fit. kiwi-jax
# plans sharding and recomputation jointly (embedded solver), applies the plan, compiles it,
# compares compiled memory and collectives with the plan, runs 3 steps against the plain step,
# and writes the memory timeline to results/memory_timeline.png.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
export XLA_FLAGS="${XLA_FLAGS:-} --xla_force_host_platform_device_count=8"
mkdir -p results
.venv/bin/kiwi-jax verify --model gpt --layers 2 --hidden 256 --heads 4 --seq 128 --batch 8 \
    --mesh 2x4 --cluster v100-nvlink --budget 80% --solver kiwi --no-cache \
    --explain --png results/memory_timeline.png "$@"
