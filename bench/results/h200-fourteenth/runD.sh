#!/usr/bin/env bash
# Lease 3, call 2: the long arrivals at C = 64 once more, the slow-step line now
# splitting the step (the decode pass built, queued, waited for); graphs on (the
# suite's server) and off (a variant). Then the engine-overhead part.
set -u
export PYTHONUNBUFFERED=1 TRIO_MLX_BENCH_CACHE=/root/bench-cache
export PYTHONPATH=$PWD:$PWD/engine:$PWD/http:${PYTHONPATH:-} PATH=/root/site/bin:$PATH
step() { local t=$1 name=$2; shift 2; echo "== $name: $*"; date -u +%T
  timeout "$t" "$@" > "$OUT/$name.txt" 2>&1; echo "rc=$? $(date -u +%T)"; tail -n 8 "$OUT/$name.txt"; }
step 300 suite-long-phases python -m bench.suite --profile gpu --only traffic --concurrency 64 \
  --traffic long --no-mlx-lm-server --variant nographs:MLX_USE_CUDA_GRAPHS=0 \
  --traffic-rounds 1 --out "$OUT/suite-long-phases"
for f in "$OUT"/suite-long-phases/logs/*.log; do grep -h "slow \|traced decode:" "$f"; done
step 200 overhead python -m bench.suite --profile gpu --only overhead --batches 1,8,32,64,128 \
  --out "$OUT/overhead"
