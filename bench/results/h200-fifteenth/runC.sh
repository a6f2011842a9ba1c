#!/usr/bin/env bash
# Lease 2: the fused decode attention's warps a launch setting, not a template
# argument (both variants primed when a head shape is first checked), and the
# traced step growing a full buffer itself (no eager step). First the long
# arrivals at C = 64, one round, two fresh servers, each with an empty PTX cache
# of its own, as on a fresh machine (the stall was in the first round of every
# fresh server before): the suite's, and `warm` (the CUDA warm-up's lane pass at
# load): do the first requests' compiles move to the load? Then the decode
# kernel's first calls in a fresh process (kernel_compile.py) and the kernel's
# and the traced step's tests on CUDA.
set -u
export PYTHONUNBUFFERED=1 TRIO_MLX_BENCH_CACHE=/root/bench-cache
export PYTHONPATH=$PWD:$PWD/engine:$PWD/http:${PYTHONPATH:-} PATH=/root/site/bin:$PATH
step() { local t=$1 name=$2; shift 2; echo "== $name: $*"; date -u +%T
  timeout "$t" "$@" > "$OUT/$name.txt" 2>&1; echo "rc=$? $(date -u +%T)"; tail -n 16 "$OUT/$name.txt"; }
step 240 suite-long env MLX_PTX_CACHE_DIR=/root/ptx-cold python -m bench.suite --profile gpu \
  --only traffic --concurrency 64 --traffic long --no-mlx-lm-server \
  --variant warm:TRIO_MLX_CUDA_WARMUP=1,MLX_PTX_CACHE_DIR=/root/ptx-warm \
  --traffic-rounds 1 --out "$OUT/suite-long"
find "$OUT/suite-long" -name "*.log" | while read -r f; do echo "## $f"; head -n 1 "$f"
  grep -h "slow \|traced decode:\|warm\|decode attention" "$f"; done > "$OUT/suite-logs.txt"
cut -c1-330 "$OUT/suite-logs.txt"
step 40 kernel-compile python bench/experiments/kernel_compile.py
step 80 kernel-tests python -m pytest -q -p no:cacheprovider tests/test_decode_attention.py \
  tests/test_traced_decode.py
