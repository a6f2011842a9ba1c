#!/usr/bin/env bash
# Lease 1: the traced decode step with its buffers padded to the cache's step,
# served against the eager step: both servers up, rounds alternating (C = 64, 32).
set -u
export PYTHONUNBUFFERED=1 TRIO_MLX_BENCH_CACHE=/root/bench-cache
export PYTHONPATH=$PWD:$PWD/engine:$PWD/http:${PYTHONPATH:-} PATH=/root/site/bin:$PATH
step() { local t=$1 name=$2; shift 2; echo "== $name: $*"; date -u +%T
  timeout "$t" "$@" > "$OUT/$name.txt" 2>&1; echo "rc=$? $(date -u +%T)"; tail -n 24 "$OUT/$name.txt"; }
step 500 ab-traced python bench/ab_servers.py . .:TRIO_MLX_TRACED_DECODE=1 --model llama-1b \
  --concurrency 64,32 --rounds 5 --seconds 8 --tokens 128 --max-batch 64
mkdir -p "$OUT/logs"; cp /tmp/ab-logs/*.log "$OUT/logs/" 2>/dev/null
grep -h "traced\|Traceback\|Error" /tmp/ab-logs/*.log | tail -n 20
