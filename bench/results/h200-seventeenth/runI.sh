#!/usr/bin/env bash
# The open loop on the H200 with today's engine (its only H200 run was the first
# round's, before the planner): Poisson arrivals at 50%, 80% and 100% of trio-mlx's
# capacity for the spread of prompts (20-2,000 words and three 4,000-token prompts),
# the default (the 768-token chunk) beside the passes as they were before it (`c1536`).
set -u
export PYTHONUNBUFFERED=1 TRIO_MLX_BENCH_CACHE=/root/bench-cache
export PYTHONPATH=$PWD:$PWD/engine:$PWD/http:${PYTHONPATH:-} PATH=/root/site/bin:$PATH
step() { local t=$1 name=$2; shift 2; echo "== $name: $*"; date -u +%T
  timeout "$t" "$@" > "$OUT/$name.txt" 2>&1; echo "rc=$? $(date -u +%T)"; tail -n 24 "$OUT/$name.txt"; }
step 420 suite-open-i python -m bench.suite --profile gpu --only traffic --concurrency 64 \
  --traffic open --no-mlx-lm-server --variant c1536:--long-prompt-chunk=1536 --traffic-rounds 1 \
  --out "$OUT/suite-open-i"
