#!/usr/bin/env bash
# Lease 2: the ratios with the traced step on by default (e0b4782):
# the suite's closed loop at C = 32, 64 against the bare loops, 2 rounds, and
# the eager step as a variant.
set -u
export PYTHONUNBUFFERED=1 TRIO_MLX_BENCH_CACHE=/root/bench-cache
export PYTHONPATH=$PWD:$PWD/engine:$PWD/http:${PYTHONPATH:-} PATH=/root/site/bin:$PATH
step() { local t=$1 name=$2; shift 2; echo "== $name: $*"; date -u +%T
  timeout "$t" "$@" > "$OUT/$name.txt" 2>&1; echo "rc=$? $(date -u +%T)"; tail -n 30 "$OUT/$name.txt"; }
step 540 suite python -m bench.suite --profile gpu --only traffic --concurrency 32,64 \
  --traffic closed --no-mlx-lm-server --traffic-rounds 2 --out "$OUT/suite" \
  --variant eager:TRIO_MLX_TRACED_DECODE=0
grep -h "traced" "$OUT"/suite/logs/*.log 2>/dev/null | tail -n 6
