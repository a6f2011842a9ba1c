#!/usr/bin/env bash
# Lease 2, call 2: what mx.clear_cache() costs on CUDA with a server's buffers
# cached (mlx-lm's BatchGenerator clears every 512 decode steps), then the long
# arrivals at C = 64 with the clear (the suite's server) and without it (a variant).
set -u
export PYTHONUNBUFFERED=1 TRIO_MLX_BENCH_CACHE=/root/bench-cache
export PYTHONPATH=$PWD:$PWD/engine:$PWD/http:${PYTHONPATH:-} PATH=/root/site/bin:$PATH
step() { local t=$1 name=$2; shift 2; echo "== $name: $*"; date -u +%T
  timeout "$t" "$@" > "$OUT/$name.txt" 2>&1; echo "rc=$? $(date -u +%T)"; tail -n 24 "$OUT/$name.txt"; }
step 100 clear-cache python bench/experiments/clear_cache.py
step 300 suite-long-clear python -m bench.suite --profile gpu --only traffic --concurrency 64 \
  --traffic long --no-mlx-lm-server --variant keep:TRIO_MLX_PERIODIC_CLEAR=0 \
  --traffic-rounds 1 --out "$OUT/suite-long-clear"
for f in "$OUT"/suite-long-clear/logs/*.log; do grep -h "slow \|traced decode:" "$f"; done
