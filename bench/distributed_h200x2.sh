#!/usr/bin/env bash
# The 1-GPU vs 2-GPU (tensor parallel, NCCL) decode run on the lent 2x H200
# machine, after `source .gpuB/unpack-b.sh` (see bench/README.md). Writes
# $OUT/h200x2/{1,2}-{engine,bare}.json, logs and README.md; copy them to
# bench/results/h200x2/. Every step is bounded; a failed step leaves its log.
set -u
export NCCL_NVLS_ENABLE=0  # NVLink multicast stays off on the lent machines
M=${MODEL_DIR:-/root/llama-8b-random}
R=$OUT/h200x2
mkdir -p "$R"
D=bench/distributed_decode.py
ARGS=(--batches "${BATCHES:-1,8,32}" --tokens "${TOKENS:-128}" --rounds "${ROUNDS:-2}")
LAUNCH=(python3 -c 'from mlx._distributed_utils.launch import main; main()')
clean() { pkill -9 -f distributed_decode.py 2>/dev/null; sleep 1; }
step() { echo "== $(date +%T) $1"; }

step make-model
[ -f "$M/config.json" ] || timeout 240 python3 $D make-model "$M" --shape 8b --no-check 2>&1 | tail -4
step "2 ranks engine"
timeout -k 5 150 "${LAUNCH[@]}" -n 2 --backend nccl --python python3 -- $D run "$M" "$R/2-engine.json" \
  --mode engine "${ARGS[@]}" >"$R/log-2-engine.txt" 2>&1; tail -5 "$R/log-2-engine.txt"; clean
[ -n "${ONLY_TWO:-}" ] || {
step "1 rank engine"
CUDA_VISIBLE_DEVICES=0 timeout -k 5 120 python3 $D run "$M" "$R/1-engine.json" --mode engine \
  "${ARGS[@]}" >"$R/log-1-engine.txt" 2>&1; tail -3 "$R/log-1-engine.txt"; clean
}
step "2 ranks bare"
timeout -k 5 120 "${LAUNCH[@]}" -n 2 --backend nccl --python python3 -- $D run "$M" "$R/2-bare.json" \
  --mode bare --loader direct "${ARGS[@]}" >"$R/log-2-bare.txt" 2>&1; tail -3 "$R/log-2-bare.txt"; clean
[ -n "${ONLY_TWO:-}" ] || {
step "1 rank bare"
CUDA_VISIBLE_DEVICES=0 timeout -k 5 120 python3 $D run "$M" "$R/1-bare.json" --mode bare \
  "${ARGS[@]}" >"$R/log-1-bare.txt" 2>&1; tail -3 "$R/log-1-bare.txt"; clean
}
step report
python3 $D report "$R"/*.json --markdown "$R/README.md" 2>&1 | tail -20
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv >"$R/gpus.txt"
