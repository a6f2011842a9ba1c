#!/usr/bin/env bash
# Lease 1 of the tenth round's H200 runs (issue 16): the prefill stall bound
# served, and the long prompt's stalls in process with prefill keys padded.
# Run after `source .gpuB/unpack-b.sh`; writes to $OUT.
set -u
export PYTHONUNBUFFERED=1 TRIO_MLX_BENCH_CACHE=/root/bench-cache
export PYTHONPATH=$PWD:$PWD/engine:$PWD/http:$PYTHONPATH PATH=/root/site/bin:$PATH
step() { local t=$1 name=$2; shift 2; echo "== $name: $*"; date -u +%T
  timeout "$t" "$@" > "$OUT/$name.txt" 2>&1; echo "rc=$? $(date -u +%T)"; tail -n 4 "$OUT/$name.txt"; }
step 110 long_stall python bench/experiments/long_stall.py llama-1b 63 3000 3500 4000 4000 budget=768
step 110 long_stall-keys256 python bench/experiments/long_stall.py llama-1b 63 3000 3500 4000 4000 budget=768 keys=256
(nvidia-smi --query-gpu=timestamp,utilization.gpu,memory.used --format=csv -l 2 > "$OUT/smi.csv" 2>&1 &)
step 330 suite python -m bench.suite --profile gpu --only traffic --concurrency 64 \
  --traffic closed,long --no-mlx-lm-server --traffic-rounds 2 --out "$OUT/suite" \
  --variant stall2:--prefill-stall=2 --variant stall3:--prefill-stall=3
pkill nvidia-smi
step 60 admission python bench/experiments/admission_cost.py llama-1b
