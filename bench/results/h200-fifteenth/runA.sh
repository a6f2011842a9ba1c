#!/usr/bin/env bash
# Lease 1, call 3: the long arrivals at C = 64, two rounds, the slow-step line now
# naming the kernels compiled in the step and the memory before -> after it; the
# suite's server (graphs on), the lane warm-up on (`warm`), graphs off (`nographs`).
set -u
export PYTHONUNBUFFERED=1 TRIO_MLX_BENCH_CACHE=/root/bench-cache
export PYTHONPATH=$PWD:$PWD/engine:$PWD/http:${PYTHONPATH:-} PATH=/root/site/bin:$PATH
step() { local t=$1 name=$2; shift 2; echo "== $name: $*"; date -u +%T
  timeout "$t" "$@" > "$OUT/$name.txt" 2>&1; echo "rc=$? $(date -u +%T)"; tail -n 12 "$OUT/$name.txt"; }
step 540 suite-long python -m bench.suite --profile gpu --only traffic --concurrency 64 \
  --traffic long --no-mlx-lm-server --variant warm:TRIO_MLX_CUDA_WARMUP=1 \
  --variant nographs:MLX_USE_CUDA_GRAPHS=0 --traffic-rounds 2 --out "$OUT/suite-long"
find "$OUT/suite-long" -name "*.log" | while read -r f; do echo "## $f"
  grep -h "slow \|traced decode:\|warm" "$f"; done > "$OUT/suite-logs.txt"
du -sh /tmp/mlx/*/ptx 2>/dev/null; ls /tmp/mlx/*/ptx 2>/dev/null | wc -l
