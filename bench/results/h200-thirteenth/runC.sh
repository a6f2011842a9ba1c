#!/usr/bin/env bash
# Lease 1, call 4: MLX's CUDA graphs off against on (its default) with the traced
# step: the closed loop both servers up, rounds alternating; then the suite's
# closed loop and long arrivals at C = 32, 64 with graphs off as a variant.
set -u
export PYTHONUNBUFFERED=1 TRIO_MLX_BENCH_CACHE=/root/bench-cache
export PYTHONPATH=$PWD:$PWD/engine:$PWD/http:${PYTHONPATH:-} PATH=/root/site/bin:$PATH
step() { local t=$1 name=$2; shift 2; echo "== $name: $*"; date -u +%T
  timeout "$t" "$@" > "$OUT/$name.txt" 2>&1; echo "rc=$? $(date -u +%T)"; tail -n 20 "$OUT/$name.txt"; }
step 200 ab-graphs python bench/ab_servers.py . .:MLX_USE_CUDA_GRAPHS=0 --model llama-1b \
  --concurrency 64,32 --rounds 3 --seconds 8 --tokens 128 --max-batch 64
step 250 suite-graphs python -m bench.suite --profile gpu --only traffic --concurrency 32,64 \
  --traffic closed,long --no-mlx-lm-server --variant nographs:MLX_USE_CUDA_GRAPHS=0 \
  --traffic-rounds 1 --out "$OUT/suite-graphs"
