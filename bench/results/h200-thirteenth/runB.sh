#!/usr/bin/env bash
# Lease 1, calls 3 and 4: the one-read compaction and prompt-batch split (this tree)
# against the tree without them (.abold: engine/ and http/ of 7c88a6f), both
# servers up, rounds alternating; then where a long prompt's steps stall, with
# MLX's CUDA graphs on (its default) and off.
set -u
export PYTHONUNBUFFERED=1 TRIO_MLX_BENCH_CACHE=/root/bench-cache
export PYTHONPATH=$PWD:$PWD/engine:$PWD/http:${PYTHONPATH:-} PATH=/root/site/bin:$PATH
step() { local t=$1 name=$2; shift 2; echo "== $name: $*"; date -u +%T
  timeout "$t" "$@" > "$OUT/$name.txt" 2>&1; echo "rc=$? $(date -u +%T)"; tail -n 20 "$OUT/$name.txt"; }
step 330 ab-compaction python bench/ab_servers.py . .abold --model llama-1b \
  --concurrency 64,32 --rounds 4 --seconds 8 --tokens 128 --max-batch 64
mkdir -p "$OUT/logs"; cp /tmp/ab-logs/*.log "$OUT/logs/" 2>/dev/null
grep -h "Traceback\|Error" /tmp/ab-logs/*.log | tail -n 5
step 100 long-stall python bench/experiments/long_stall.py llama-1b 63 3000 3500 4000 4000
MLX_USE_CUDA_GRAPHS=0 step 100 long-stall-nographs python bench/experiments/long_stall.py \
  llama-1b 63 3000 3500 4000 4000
# The long arrivals once more with the order reversed: graphs off for the
# suite's own server (started first), on for the variant.
MLX_USE_CUDA_GRAPHS=0 step 230 suite-long-reversed python -m bench.suite --profile gpu \
  --only traffic --concurrency 64 --traffic long --no-mlx-lm-server \
  --variant graphs:MLX_USE_CUDA_GRAPHS=1 --traffic-rounds 1 --out "$OUT/suite-long-reversed"
