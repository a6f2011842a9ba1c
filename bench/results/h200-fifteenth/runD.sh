#!/usr/bin/env bash
# The same lease, next call: the suite's closed loop at C = 8, 32, 64 and the long
# arrivals at C = 64, trio-mlx and mlx_lm.server, one round, after the decode
# kernel's change (a table for the README beside the thirteenth round's).
set -u
export PYTHONUNBUFFERED=1 TRIO_MLX_BENCH_CACHE=/root/bench-cache
export PYTHONPATH=/root/site:$PWD:$PWD/engine:$PWD/http PATH=/root/site/bin:$PATH
step() { local t=$1 name=$2; shift 2; echo "== $name: $*"; date -u +%T
  timeout "$t" "$@" > "$OUT/$name.txt" 2>&1; echo "rc=$? $(date -u +%T)"; tail -n 24 "$OUT/$name.txt"; }
step 560 suite-traffic python -m bench.suite --profile gpu --only traffic --concurrency 8,32,64 \
  --traffic closed,long --out "$OUT/suite-traffic"
find "$OUT/suite-traffic" -name "*.log" | while read -r f; do echo "## $f"
  grep -h "slow \|traced decode:" "$f"; done > "$OUT/suite-traffic-logs.txt"
cut -c1-330 "$OUT/suite-traffic-logs.txt" | head -20
