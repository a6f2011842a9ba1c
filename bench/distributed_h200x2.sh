#!/usr/bin/env bash
# The 1-GPU vs 2-GPU (tensor parallel, NCCL) decode comparison on the lent 2x H200
# machine, after `source .gpuB/unpack-b.sh` (see bench/README.md). Writes
# $OUT/h200x2/pass$PASS/{1,2}-{engine,bare}.json, logs and README.md; copy them to
# bench/results/h200x2/. PASS=1 runs 1-rank bare, 1-rank engine, 2-rank bare, 2-rank
# engine; PASS=2 the reverse order (run both: single runs on this shared host vary by
# up to ~50%, and the order then shows whether a drift favours one side). Every step is
# bounded; a failed step leaves its log.
set -u
export NCCL_NVLS_ENABLE=0  # NVLink multicast stays off on the lent machines
M=${MODEL_DIR:-/root/llama-8b-random}
PASS=${PASS:-1}
R=$OUT/h200x2/pass$PASS
mkdir -p "$R" /root/logs
D=bench/distributed_decode.py
ARGS=(--batches "${BATCHES:-1,8,32}" --tokens "${TOKENS:-128}" --rounds "${ROUNDS:-3}")
LAUNCH=(python3 -c 'from mlx._distributed_utils.launch import main; main()')
clean() { pkill -9 -f distributed_decode.py 2>/dev/null; sleep 1; }

one() {  # ranks mode
  echo "== $(date +%T) $1 rank(s) $2"
  local out="$R/$1-$2.json" log="/root/logs/$PASS-$1-$2.txt" extra=()
  if [ "$1" = 1 ]; then
    CUDA_VISIBLE_DEVICES=0 timeout -k 5 150 python3 $D run "$M" "$out" --mode "$2" \
      "${ARGS[@]}" >"$log" 2>&1
  else
    [ "$2" = bare ] && extra=(--loader direct)
    timeout -k 5 150 "${LAUNCH[@]}" -n 2 --backend nccl --python python3 -- $D run "$M" \
      "$out" --mode "$2" "${extra[@]}" "${ARGS[@]}" >"$log" 2>&1
  fi
  tail -4 "$log"; clean
}

echo "== $(date +%T) make-model"
[ -f "$M/config.json" ] || timeout 240 python3 $D make-model "$M" --shape 8b --no-check 2>&1 | tail -2
# RUNS="2-engine 2-bare" (say) runs only those, in that order.
if [ -n "${RUNS:-}" ]; then
  for run in $RUNS; do one "${run%%-*}" "${run#*-}"; done
elif [ "$PASS" = 1 ]; then
  one 1 bare; one 1 engine; one 2 bare; one 2 engine
else
  one 2 engine; one 2 bare; one 1 engine; one 1 bare
fi
python3 $D report "$R"/*.json --markdown "$R/README.md" 2>&1 | head -8
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv >"$R/gpus.txt"
