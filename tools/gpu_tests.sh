#!/usr/bin/env bash
# Run the engine's tests on a CUDA machine, one process per test file, and
# write a summary: one line per file (passed/failed/skipped/errors), the
# totals, the commit and the date.
#
# Usage, on the GPU machine from the repository root, with MLX's CUDA build
# and the test dependencies importable (`pip install -e ".[cuda,test]"`, or
# the wheels unpacked on PYTHONPATH with engine/ and http/):
#     bash tools/gpu_tests.sh [SUMMARY_FILE] [TEST_FILE...]
# SUMMARY_FILE defaults to $OUT/gpu-tests.txt when OUT is set, else
# gpu-tests.txt. With no TEST_FILE, every engine test file runs (the HTTP
# tests exercise no CUDA path the engine tests miss). Each file's own log
# come back in gpu-test-logs.tgz beside the summary when the summary's folder is $OUT.
# JOBS=N runs N files at once.
#
# One process per file: a CUDA fault (a bad kernel launch poisons the
# context) or a leaked setting then costs one file, not the rest of the run.
#
# MLX_ENABLE_TF32 defaults to 0 here: the tests compare float32 results exactly
# (a batch against each row alone, a stacked adapter against mlx-lm's own
# LoRALinear), which TF32 matmuls (MLX's default on CUDA) do not keep; see
# design/engine.md, "Backends and model families".
set -uo pipefail
export MLX_ENABLE_TF32=${MLX_ENABLE_TF32:-0}
summary=${1:-${OUT:+$OUT/gpu-tests.txt}}
summary=${summary:-gpu-tests.txt}
shift || true
if [ $# -eq 0 ]; then
  set -- tests/test_engine_*.py tests/test_cuda_*.py tests/test_multilora_layers.py \
    tests/test_traced_decode.py tests/test_decode_attention.py tests/test_fused_projections.py \
    tests/test_model_families.py tests/test_structured.py tests/test_structured_mask.py \
    tests/test_foundation.py tests/test_blas.py tests/test_speculative.py tests/test_vision.py \
    tests/test_vision_gemma3.py tests/test_vision_qwen2_vl.py \
    tests/test_prompt_cache_kinds.py tests/test_prompt_cache_disk.py tests/test_batch_lane.py \
    tests/test_embeddings.py tests/test_host.py tests/test_host_residency.py
fi
# The optimized BLAS preloaded as `nox -s tests` does (the tests check it is).
eval "$(python3 -c 'import os, shlex
from trio_mlx._start.blas import preload_env
env = preload_env(dict(os.environ))
for k in ("LD_PRELOAD", "OPENBLAS_NUM_THREADS", "MKL_INTERFACE_LAYER"):
    if env.get(k):
        print(f"export {k}={shlex.quote(env[k])}")')"
logs=$(mktemp -d)
commit=${GIT_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
{
  echo "trio-mlx engine tests on $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 || echo 'no GPU')"
  echo "commit: $commit   date: $(date -u +%Y-%m-%dT%H:%MZ)"
  python3 -c 'import mlx.core as mx, mlx_lm; print("mlx", mx.__version__, "mlx-lm", mlx_lm.__version__, "cuda", mx.cuda.is_available())' 2>&1
  echo "MLX_ENABLE_TF32=$MLX_ENABLE_TF32"
} > "$summary"
run_file() {  # run one test file; its log and its summary lines land in $logs
  local file=$1 name
  name=$(basename "$file" .py)
  PYTHONUNBUFFERED=1 timeout "${FILE_TIMEOUT:-540}" python3 -m pytest -q -p no:cacheprovider -rfE --tb=short \
    "$file" > "$logs/$name.log" 2>&1
  echo $? > "$logs/$name.rc"
}
# JOBS files at a time (default 1): the tests' models are tiny, so several
# processes share the one GPU well and the whole set fits one device call.
jobs_max=${JOBS:-1}
for file in "$@"; do
  while [ "$(jobs -rp | wc -l)" -ge "$jobs_max" ]; do wait -n; done
  run_file "$file" &
done
wait
total_p=0 total_f=0 total_s=0 total_e=0
for file in "$@"; do
  name=$(basename "$file" .py)
  rc=$(cat "$logs/$name.rc" 2>/dev/null || echo "?")
  tail_line=$(grep -E '^(=+ )?[0-9]+ (passed|failed|error|skipped)|no tests ran' "$logs/$name.log" | tail -1)
  count() { echo "$tail_line" | grep -oE "[0-9]+ $1" | grep -oE '[0-9]+' || echo 0; }
  p=$(count passed) f=$(count failed) s=$(count skipped) e=$(count error)
  # A file cut at FILE_TIMEOUT (124), or one pytest could not run (rc 2-5),
  # counts as an error even when its log has no counts.
  if [ "$rc" != 0 ] && [ "$rc" != 1 ] && [ "$e" = 0 ]; then e=1; fi
  total_p=$((total_p + p)) total_f=$((total_f + f)) total_s=$((total_s + s)) total_e=$((total_e + e))
  printf '%-40s rc=%-3s passed=%-4s failed=%-3s skipped=%-3s errors=%s\n' "$name" "$rc" "$p" "$f" "$s" "$e" >> "$summary"
  grep -E '^(FAILED|ERROR) ' "$logs/$name.log" | cut -c1-300 | sed 's/^/    /' >> "$summary"
done
echo "total: passed=$total_p failed=$total_f skipped=$total_s errors=$total_e" >> "$summary"
if [ -n "${OUT:-}" ] && [ "$(dirname "$summary")" = "$OUT" ]; then
  # $OUT brings back at most 8 files: the summary and one archive of the logs.
  tar -czf "$OUT/gpu-test-logs.tgz" -C "$logs" .
fi
cat "$summary"
[ "$total_f" -eq 0 ] && [ "$total_e" -eq 0 ]
