#!/usr/bin/env bash
# Lease 2: a prompt longer than the new prefill chunk (768 on a GPU) is prefilled
# alone, a chunk a step, while chat-sized arrivals still share passes of up to the
# 1,536-token budget. The long arrivals at C = 64, two rounds: the default (now the
# chunk), the previous default (`--prefill-chunk 1536`: passes of up to 1,536 for
# every prompt) and a 768-token budget for every pass (run D's b768); then the
# closed loop at C = 32, 64 with the previous default as a variant (the chunk
# should leave chat-sized arrivals as they were).
set -u
export PYTHONUNBUFFERED=1 TRIO_MLX_BENCH_CACHE=/root/bench-cache
export PYTHONPATH=$PWD:$PWD/engine:$PWD/http:${PYTHONPATH:-} PATH=/root/site/bin:$PATH
step() { local t=$1 name=$2; shift 2; echo "== $name: $*"; date -u +%T
  timeout "$t" "$@" > "$OUT/$name.txt" 2>&1; echo "rc=$? $(date -u +%T)"; tail -n 20 "$OUT/$name.txt"; }
step 300 suite-long-f python -m bench.suite --profile gpu --only traffic --concurrency 64 \
  --traffic long --no-mlx-lm-server --variant c1536:--prefill-chunk=1536 \
  --variant b768:--prefill-budget=768 --traffic-rounds 2 --out "$OUT/suite-long-f"
step 200 suite-closed-f python -m bench.suite --profile gpu --only traffic --concurrency 32,64 \
  --traffic closed --no-mlx-lm-server --variant c1536:--prefill-chunk=1536 --traffic-rounds 1 \
  --out "$OUT/suite-closed-f"
for d in suite-long-f suite-closed-f; do find "$OUT/$d" -name "*.log" | while read -r f; do
  echo "## $f"; head -n 1 "$f"; grep -h "slow \|traced decode:" "$f"; done; done > "$OUT/logs-f.txt"
cut -c1-250 "$OUT/logs-f.txt"
