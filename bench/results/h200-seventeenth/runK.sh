#!/usr/bin/env bash
# The long-prompt window with the backlog rule (it yields to the budget while the
# prompts beside the longest hold more than the budget): the long arrivals at C = 64
# and the open loop in one invocation, one round (the last 350 s of device time), the default beside the passes as
# they were before the chunk (`c1536`).
set -u
export PYTHONUNBUFFERED=1 TRIO_MLX_BENCH_CACHE=/root/bench-cache
export PYTHONPATH=$PWD:$PWD/engine:$PWD/http:${PYTHONPATH:-} PATH=/root/site/bin:$PATH
step() { local t=$1 name=$2; shift 2; echo "== $name: $*"; date -u +%T
  timeout "$t" "$@" > "$OUT/$name.txt" 2>&1; echo "rc=$? $(date -u +%T)"; tail -n 24 "$OUT/$name.txt"; }
step 320 suite-k python -m bench.suite --profile gpu --only traffic --concurrency 64 \
  --traffic long,open --no-mlx-lm-server --variant c1536:--long-prompt-chunk=1536 \
  --traffic-rounds 1 --out "$OUT/suite-k"
