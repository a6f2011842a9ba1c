#!/usr/bin/env bash
# Lease 1, call 4: the closed loop at C = 8, 32, 64 after the fifteenth round's
# change, with mlx_lm.server and MLX's CUDA graphs off as a variant (the
# GPU-busy goal at C = 64) and a 768-token prefill budget (what it costs
# the closed loop); first the decode kernel's and the traced step's
# tests on CUDA (pytest-trio staged this time); last the engine-overhead part at
# B = 1, 8, 64 (B = 1 read 0.83 in the fourteenth round, 1.13-1.50 before).
set -u
export PYTHONUNBUFFERED=1 TRIO_MLX_BENCH_CACHE=/root/bench-cache
export PYTHONPATH=$PWD:$PWD/engine:$PWD/http:${PYTHONPATH:-} PATH=/root/site/bin:$PATH
step() { local t=$1 name=$2; shift 2; echo "== $name: $*"; date -u +%T
  timeout "$t" "$@" > "$OUT/$name.txt" 2>&1; echo "rc=$? $(date -u +%T)"; tail -n 24 "$OUT/$name.txt"; }
step 70 kernel-tests python -m pytest -q -p no:cacheprovider tests/test_decode_attention.py \
  tests/test_traced_decode.py
step 420 suite-closed python -m bench.suite --profile gpu --only traffic --concurrency 8,32,64 \
  --traffic closed --variant nographs:MLX_USE_CUDA_GRAPHS=0 --variant b768:--prefill-budget=768 \
  --traffic-rounds 1 \
  --out "$OUT/suite-closed"
step 90 overhead python -m bench.suite --profile gpu --only overhead --batches 1,8,64 \
  --out "$OUT/overhead"
find "$OUT/suite-closed" -name "*.log" | while read -r f; do echo "## $f"; head -n 1 "$f"
  grep -h "slow \|traced decode:\|decode attention" "$f"; done > "$OUT/suite-closed-logs.txt"
