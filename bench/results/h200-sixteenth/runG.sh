#!/usr/bin/env bash
# Lease 2, last call (the session's last 210 s of device time): the long arrivals
# at C = 64 once more, two rounds, the default (the 768-token chunk) beside a
# 768-token budget for every pass. Run inline as one command; kept here as run.
source .gpuB/unpack-b.sh >/dev/null
export PYTHONUNBUFFERED=1 TRIO_MLX_BENCH_CACHE=/root/bench-cache
export PYTHONPATH=$PWD:$PWD/engine:$PWD/http:$PYTHONPATH
timeout 185 python -m bench.suite --profile gpu --only traffic --concurrency 64 --traffic long \
  --no-mlx-lm-server --variant b768:--prefill-budget=768 --traffic-rounds 2 \
  --out "$OUT/suite-long-g" 2>&1 | grep -v tokenizer | tee "$OUT/suite-long-g.txt" | tail -12
