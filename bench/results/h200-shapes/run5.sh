#!/usr/bin/env bash
# Lease 5: the engine-overhead part (rows inserted at once) with the traced step
# on by default, B = 1..128.
set -u
export PYTHONUNBUFFERED=1 TRIO_MLX_BENCH_CACHE=/root/bench-cache
export PYTHONPATH=$PWD:$PWD/engine:$PWD/http:${PYTHONPATH:-} PATH=/root/site/bin:$PATH
step() { local t=$1 name=$2; shift 2; echo "== $name: $*"; date -u +%T
  timeout "$t" "$@" > "$OUT/$name.txt" 2>&1; echo "rc=$? $(date -u +%T)"; tail -n 30 "$OUT/$name.txt"; }
step 250 overhead python -m bench.suite --profile gpu --only overhead --batches 1,8,32,64,128 \
  --out "$OUT/overhead"
