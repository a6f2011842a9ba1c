#!/usr/bin/env bash
# Lease 3: where an admission's time goes, step by step; the compiled step's
# long-buffer cost with and without mx.compile.
set -u
export PYTHONUNBUFFERED=1 TRIO_MLX_BENCH_CACHE=/root/bench-cache
export PYTHONPATH=$PWD:$PWD/engine:$PWD/http:$PYTHONPATH PATH=/root/site/bin:$PATH
step() { local t=$1 name=$2; shift 2; echo "== $name: $*"; date -u +%T
  timeout "$t" "$@" > "$OUT/$name.txt" 2>&1; echo "rc=$? $(date -u +%T)"; tail -n 12 "$OUT/$name.txt"; }
step 120 admission-steps python bench/experiments/admission_cost.py llama-1b 54 10 8
step 150 compiled_decode-2 python bench/experiments/compiled_decode.py llama-1b 32,64 100 128
step 120 compiled_decode-1000-2 python bench/experiments/compiled_decode.py llama-1b 64 1000 128
