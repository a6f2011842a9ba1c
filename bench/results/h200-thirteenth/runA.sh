#!/usr/bin/env bash
# Lease 1, call 2: the suite's closed loop at C = 1, 8, 128 with mlx_lm.server
# (the concurrencies not re-run since the traced step); then the long-prompt
# arrivals at C = 64 with MLX's CUDA graphs off as a variant.
set -u
export PYTHONUNBUFFERED=1 TRIO_MLX_BENCH_CACHE=/root/bench-cache
export PYTHONPATH=$PWD:$PWD/engine:$PWD/http:${PYTHONPATH:-} PATH=/root/site/bin:$PATH
step() { local t=$1 name=$2; shift 2; echo "== $name: $*"; date -u +%T
  timeout "$t" "$@" > "$OUT/$name.txt" 2>&1; echo "rc=$? $(date -u +%T)"; tail -n 24 "$OUT/$name.txt"; }
step 330 suite-c1-8-128 python -m bench.suite --profile gpu --only traffic --concurrency 1,8,128 \
  --traffic closed --traffic-rounds 1 --out "$OUT/suite-c1-8-128"
step 230 suite-long python -m bench.suite --profile gpu --only traffic --concurrency 64 \
  --traffic long --no-mlx-lm-server --variant nographs:MLX_USE_CUDA_GRAPHS=0 \
  --traffic-rounds 1 --out "$OUT/suite-long"
