#!/usr/bin/env bash
# Lease 4: the table with the traced step on by default: the suite's
# closed loop at C = 32, 64 and the long prompts arriving at both, against the
# bare loops and mlx_lm.server, one round.
set -u
export PYTHONUNBUFFERED=1 TRIO_MLX_BENCH_CACHE=/root/bench-cache
export PYTHONPATH=$PWD:$PWD/engine:$PWD/http:${PYTHONPATH:-} PATH=/root/site/bin:$PATH
step() { local t=$1 name=$2; shift 2; echo "== $name: $*"; date -u +%T
  timeout "$t" "$@" > "$OUT/$name.txt" 2>&1; echo "rc=$? $(date -u +%T)"; tail -n 30 "$OUT/$name.txt"; }
step 550 suite-table python -m bench.suite --profile gpu --only traffic --concurrency 32,64 \
  --traffic closed,long --traffic-rounds 1 --out "$OUT/suite-table"
