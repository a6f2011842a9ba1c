#!/usr/bin/env bash
# Lease 5: the traced decode step in the lane (on by default on CUDA): tokens and
# step time in process, then served at C = 64 against TRIO_MLX_TRACED_DECODE=0.
set -u
export PYTHONUNBUFFERED=1 TRIO_MLX_BENCH_CACHE=/root/bench-cache
export PYTHONPATH=$PWD:$PWD/engine:$PWD/http:${PYTHONPATH:-} PATH=/root/site/bin:$PATH
step() { local t=$1 name=$2; shift 2; echo "== $name: $*"; date -u +%T
  timeout "$t" "$@" > "$OUT/$name.txt" 2>&1; echo "rc=$? $(date -u +%T)"; tail -n 8 "$OUT/$name.txt"; }
step 90 traced_lane python bench/experiments/traced_lane.py llama-1b 64 96
step 300 suite-traced python -m bench.suite --profile gpu --only traffic --concurrency 64 \
  --traffic closed --no-mlx-lm-server --traffic-rounds 2 --out "$OUT/suite-traced" \
  --variant eager:TRIO_MLX_TRACED_DECODE=0
