#!/usr/bin/env bash
# Lease 1, call 3: with the long-prompt stall gone (fifteenth round), the
# long arrivals at C = 64 over three rounds: the default prefill (1,536-token
# budget), the stall bound (`--prefill-stall 3`: each step's chunk sized to
# about three decode steps) and a 768-token budget. Before, every setting's
# gap was swamped by the stall; this is the first clean read of the knob.
set -u
export PYTHONUNBUFFERED=1 TRIO_MLX_BENCH_CACHE=/root/bench-cache
export PYTHONPATH=$PWD:$PWD/engine:$PWD/http:${PYTHONPATH:-} PATH=/root/site/bin:$PATH
step() { local t=$1 name=$2; shift 2; echo "== $name: $*"; date -u +%T
  timeout "$t" "$@" > "$OUT/$name.txt" 2>&1; echo "rc=$? $(date -u +%T)"; tail -n 24 "$OUT/$name.txt"; }
step 560 suite-long python -m bench.suite --profile gpu --only traffic --concurrency 64 \
  --traffic long --no-mlx-lm-server --variant stall3:--prefill-stall=3 \
  --variant b768:--prefill-budget=768 --traffic-rounds 3 --out "$OUT/suite-long"
find "$OUT/suite-long" -name "*.log" | while read -r f; do echo "## $f"; head -n 1 "$f"
  grep -h "slow \|traced decode:\|decode attention" "$f"; done > "$OUT/suite-logs.txt"
cut -c1-300 "$OUT/suite-logs.txt"
