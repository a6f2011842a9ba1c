#!/usr/bin/env bash
# Lease 1, call 2: MLX's CUDA graphs off against on at 1 and 8 streams (the
# concurrencies the thirteenth round left unmeasured), both servers up, rounds
# alternating; then the long-prompt arrivals at C = 64, graphs on (the suite's
# server) and off (a variant), with the lane's slow-step and slow-admission lines.
set -u
export PYTHONUNBUFFERED=1 TRIO_MLX_BENCH_CACHE=/root/bench-cache
export PYTHONPATH=$PWD:$PWD/engine:$PWD/http:${PYTHONPATH:-} PATH=/root/site/bin:$PATH
step() { local t=$1 name=$2; shift 2; echo "== $name: $*"; date -u +%T
  timeout "$t" "$@" > "$OUT/$name.txt" 2>&1; echo "rc=$? $(date -u +%T)"; tail -n 20 "$OUT/$name.txt"; }
step 280 ab-graphs-c1-8 python bench/ab_servers.py . .:MLX_USE_CUDA_GRAPHS=0 --model llama-1b \
  --concurrency 1,8 --rounds 3 --seconds 8 --tokens 128 --max-batch 64
grep -h "Traceback\|Error\|slow " /tmp/ab-logs/*.log 2>/dev/null | tail -n 8
step 270 suite-long python -m bench.suite --profile gpu --only traffic --concurrency 64 \
  --traffic long --no-mlx-lm-server --variant nographs:MLX_USE_CUDA_GRAPHS=0 \
  --traffic-rounds 1 --out "$OUT/suite-long"
