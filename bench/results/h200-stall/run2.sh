#!/usr/bin/env bash
# Lease 2: a decode step compiled by mx.compile against the eager one (llama-1b).
set -u
export PYTHONUNBUFFERED=1 TRIO_MLX_BENCH_CACHE=/root/bench-cache
export PYTHONPATH=$PWD:$PWD/engine:$PWD/http:$PYTHONPATH PATH=/root/site/bin:$PATH
step() { local t=$1 name=$2; shift 2; echo "== $name: $*"; date -u +%T
  timeout "$t" "$@" > "$OUT/$name.txt" 2>&1; echo "rc=$? $(date -u +%T)"; tail -n 12 "$OUT/$name.txt"; }
step 200 compiled_decode python bench/experiments/compiled_decode.py llama-1b 8,32,64 100 128
step 150 compiled_decode-1000 python bench/experiments/compiled_decode.py llama-1b 64 1000 128
