#!/usr/bin/env bash
# Lease 4, call 2: whether the traced step stalls on views (strided_trace.py),
# then the long arrivals at C = 64 with fresh inputs made contiguous (this tree),
# graphs on (the suite's server) and off (a variant).
set -u
export PYTHONUNBUFFERED=1 TRIO_MLX_BENCH_CACHE=/root/bench-cache
export PYTHONPATH=$PWD:$PWD/engine:$PWD/http:${PYTHONPATH:-} PATH=/root/site/bin:$PATH
step() { local t=$1 name=$2; shift 2; echo "== $name: $*"; date -u +%T
  timeout "$t" "$@" > "$OUT/$name.txt" 2>&1; echo "rc=$? $(date -u +%T)"; tail -n 16 "$OUT/$name.txt"; }
step 150 strided-trace python bench/experiments/strided_trace.py llama-1b
step 300 suite-long-contiguous python -m bench.suite --profile gpu --only traffic \
  --concurrency 64 --traffic long --no-mlx-lm-server --variant nographs:MLX_USE_CUDA_GRAPHS=0 \
  --traffic-rounds 1 --out "$OUT/suite-long-contiguous"
for f in "$OUT"/suite-long-contiguous/logs/*.log; do grep -h "slow \|traced decode:" "$f"; done
