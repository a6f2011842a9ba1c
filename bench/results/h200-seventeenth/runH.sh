#!/usr/bin/env bash
# The widened prefill-chunk rule (GPU default 768: while a prompt longer than the
# chunk waits or prefills, every pass holds at most the chunk) at its first H200
# run: long arrivals at C = 64, four rounds, the default beside the passes as they
# were before the chunk (`c1536`), a smaller chunk (`c512`) and a 768-token budget
# for every pass (`b768`, which the rule should reproduce while a long prompt is about).
set -u
export PYTHONUNBUFFERED=1 TRIO_MLX_BENCH_CACHE=/root/bench-cache
export PYTHONPATH=$PWD:$PWD/engine:$PWD/http:${PYTHONPATH:-} PATH=/root/site/bin:$PATH
step() { local t=$1 name=$2; shift 2; echo "== $name: $*"; date -u +%T
  timeout "$t" "$@" > "$OUT/$name.txt" 2>&1; echo "rc=$? $(date -u +%T)"; tail -n 24 "$OUT/$name.txt"; }
step 540 suite-long-h python -m bench.suite --profile gpu --only traffic --concurrency 64 \
  --traffic long --no-mlx-lm-server --variant c1536:--long-prompt-chunk=1536 \
  --variant c512:--long-prompt-chunk=512 --variant b768:--prefill-budget=768 --traffic-rounds 4 \
  --out "$OUT/suite-long-h"
find "$OUT/suite-long-h" -name "*.log" | while read -r f; do
  echo "## $f"; head -n 1 "$f"; grep -h "slow \|traced decode:" "$f"; done > "$OUT/logs-h.txt"
cut -c1-250 "$OUT/logs-h.txt" | head -40
