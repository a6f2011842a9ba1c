#!/usr/bin/env bash
# Lease 3: where the server's time goes at 64 streams with the traced step on
# (py-spy, raw stacks per thread; summarised by bench/pyspy_summary.py).
set -u
export PYTHONUNBUFFERED=1 TRIO_MLX_BENCH_CACHE=/root/bench-cache
export PYTHONPATH=$PWD:$PWD/engine:$PWD/http:${PYTHONPATH:-} PATH=/root/site/bin:$PATH
step() { local t=$1 name=$2; shift 2; echo "== $name: $*"; date -u +%T
  timeout "$t" "$@" > "$OUT/$name.txt" 2>&1; echo "rc=$? $(date -u +%T)"; tail -n 12 "$OUT/$name.txt"; }
python3 -m pip install -q --no-index --no-deps --target /root/spy .gpuC/py_spy*.whl; export PATH=/root/spy/bin:$PATH; which py-spy
step 300 servecost-c64 python -m bench.servecost --model llama-1b --streams 64 --max-batch 64 \
  --requests 4 --tokens 128 --prompt-words 60 --py-spy "$OUT/c64.raw"
python bench/pyspy_summary.py "$OUT/c64.raw" > "$OUT/servecost-c64-py-spy.txt" 2>&1
head -n 60 "$OUT/servecost-c64-py-spy.txt"
