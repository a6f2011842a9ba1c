#!/usr/bin/env bash
# Lease 5, call 2: the long arrivals at C = 64, trio-mlx alone, with py-spy
# recording the server's threads (native frames, in time order) through them,
# to see what the MLX thread does in the step that queues for 2 s.
set -u
export PYTHONUNBUFFERED=1 TRIO_MLX_BENCH_CACHE=/root/bench-cache
export PYTHONPATH=$PWD:$PWD/engine:$PWD/http:${PYTHONPATH:-} PATH=/root/site/bin:$PATH
(
  for _ in $(seq 120); do
    pid=$(pgrep -f "trio_mlx_http|trio-mlx serve" | head -n 1)
    [ -n "$pid" ] && break; sleep 1
  done
  sleep 20
  echo "py-spy on $pid $(date -u +%T)"
  py-spy record --native --threads --idle -r 50 -f speedscope -o "$OUT/spy.json" -p "$pid" -d 110 \
    > "$OUT/py-spy.log" 2>&1
  echo "py-spy done $(date -u +%T)"
) &
timeout 240 python -m bench.suite --profile gpu --only traffic --concurrency 64 --traffic long \
  --no-mlx-lm-server --traffic-rounds 1 --out "$OUT/suite-long-spy" > "$OUT/suite-long-spy.txt" 2>&1
echo "suite rc=$? $(date -u +%T)"; tail -n 4 "$OUT/suite-long-spy.txt"
grep -h "slow \|traced decode:" "$OUT"/suite-long-spy/logs/*.log
wait; ls -la "$OUT"; tail -n 3 "$OUT/py-spy.log"
