#!/usr/bin/env bash
# pyinfinity's GPU checks and training benchmarks in one go, on a machine with one CUDA GPU:
#   bash examples/gpu_benchmarks.sh RESULTS_DIR [SWAP_DIR]
# 1. the CUDA tests (engine, stager, GPU figures of bench io);
# 2. `pyinfinity bench train` under an 8 GiB device cap, every run appended to RESULTS_DIR/bench.json:
#    1.1B: plain torch without a cap, pyinfinity auto / cpu and every DeepSpeed configuration that fits
#    (ZeRO-3 with everything in RAM, ZeRO-2 with the optimizer in RAM, ZeRO-3 with the parameters on
#    the GPU); the same pair with 4 micro-batches a step (--grad-accum 4); the same with clipping to
#    1.0; 20 steps of plain torch and pyinfinity for the loss curves; optimizer on NVMe
#    (pyinfinity and DeepSpeed); 10B with pyinfinity auto; 7B with pyinfinity auto and DeepSpeed with
#    its optimizer on NVMe (a row that says so when the disk cannot hold its state) and with its
#    parameters on NVMe and optimizer in RAM;
# 3. DeepSpeed as the engine with pyinfinity as its I/O backend (examples/deepspeed_backend_h200.py),
#    its JSON in RESULTS_DIR/ds_backend.json.
# DeepSpeed runs need `deepspeed` importable (they are reported as failed otherwise). Each stage's
# log is RESULTS_DIR/<stage>.log; a failed stage does not stop the next one.
set -u
OUT=${1:?usage: gpu_benchmarks.sh RESULTS_DIR [SWAP_DIR]}
SWAP=${2:-${TMPDIR:-/tmp}/pyinfinity-bench-swap}
mkdir -p "$OUT" "$SWAP"
JSON="$OUT/bench.json"
PY=${PYTHON:-python3}
stage() {  # stage NAME CMD...: runs CMD, its output to the console and NAME.log
  local name=$1; shift
  echo "== $(date +%T) $name: $*"
  "$@" 2>&1 | tee "$OUT/$name.log" | grep -E "^(==|\||[0-9]+ (passed|failed)|FAILED|ERROR)|passed|failed" || true
}
bench() { stage "$1" "$PY" -m pyinfinity bench train --device cuda --gpu-memory 8GiB --json "$JSON" --nvme "$SWAP" \
  --no-progress "${@:2}"; }
stage gpu_tests "$PY" -m pytest -q -p no:cacheprovider tests/python/test_engine_gpu.py tests/python/test_stager.py \
  tests/python/test_bench_gpu.py
bench b11 --sizes 1.1b --steps 6 --warmup 2 \
  --systems torch-nocap,pyinfinity-auto,pyinfinity-cpu,deepspeed-cpu,deepspeed-z2-cpu,deepspeed-z3-gpu-params
bench b11_accum --sizes 1.1b --systems torch-nocap,pyinfinity-auto --grad-accum 4 --steps 6 --warmup 2 --no-trace
bench b11_clip --sizes 1.1b --systems pyinfinity-auto,pyinfinity-cpu,deepspeed-cpu,deepspeed-z2-cpu --clip 1.0 \
  --steps 6 --warmup 2 --no-trace
bench b11_losses --sizes 1.1b --systems torch-nocap,pyinfinity-auto --steps 20 --warmup 0 --no-trace
bench b11_nvme --sizes 1.1b --systems pyinfinity-nvme,deepspeed-nvme --steps 5 --warmup 1 --no-trace
bench b10 --sizes 10b --systems pyinfinity-auto --steps 3 --warmup 1 --no-trace
bench b7 --sizes 7b --systems pyinfinity-auto,deepspeed-nvme,deepspeed-nvme-params --steps 4 --warmup 1 --no-trace
stage ds_backend "$PY" examples/deepspeed_backend_h200.py \
  --configs pyinf-cpu-nvme,ds-cpu-nvme,pyinf-cpu-nvme-pipe,ds-cpu-nvme-pipe,pyinf-nvme-nvme,pyinf-nvme-nvme-fix \
  --steps 4 --nvme-dir "$SWAP/ds_backend" --json "$OUT/ds_backend.json"
echo "== $(date +%T) done"
