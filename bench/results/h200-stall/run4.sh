#!/usr/bin/env bash
# Lease 4: does a write at an array index copy the KV buffer on CUDA, and does
# the traced step with mx.put_along_axis keep its gain at long buffers.
set -u
export PYTHONUNBUFFERED=1 TRIO_MLX_BENCH_CACHE=/root/bench-cache
export PYTHONPATH=$PWD:$PWD/engine:$PWD/http:${PYTHONPATH:-} PATH=/root/site/bin:$PATH
step() { local t=$1 name=$2; shift 2; echo "== $name: $*"; date -u +%T
  timeout "$t" "$@" > "$OUT/$name.txt" 2>&1; echo "rc=$? $(date -u +%T)"; tail -n 12 "$OUT/$name.txt"; }
step 60 dynamic_write python bench/experiments/dynamic_write.py
step 150 compiled_decode-put python bench/experiments/compiled_decode.py llama-1b 64 1000 128 write=put
step 100 compiled_decode-put-100 python bench/experiments/compiled_decode.py llama-1b 64 100 128 write=put
