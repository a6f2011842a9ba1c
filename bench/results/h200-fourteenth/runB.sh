#!/usr/bin/env bash
# Lease 1, call 3: the long arrivals once more in the other order (graphs off for
# the suite's own server, on for the variant), then the engine-overhead part.
set -u
export PYTHONUNBUFFERED=1 TRIO_MLX_BENCH_CACHE=/root/bench-cache
export PYTHONPATH=$PWD:$PWD/engine:$PWD/http:${PYTHONPATH:-} PATH=/root/site/bin:$PATH
step() { local t=$1 name=$2; shift 2; echo "== $name: $*"; date -u +%T
  timeout "$t" "$@" > "$OUT/$name.txt" 2>&1; echo "rc=$? $(date -u +%T)"; tail -n 24 "$OUT/$name.txt"; }
MLX_USE_CUDA_GRAPHS=0 step 260 suite-long-reversed python -m bench.suite --profile gpu \
  --only traffic --concurrency 64 --traffic long --no-mlx-lm-server \
  --variant graphs:MLX_USE_CUDA_GRAPHS=1 --traffic-rounds 1 --out "$OUT/suite-long-reversed"
step 250 overhead python -m bench.suite --profile gpu --only overhead --batches 1,8,32,64,128 \
  --out "$OUT/overhead"
