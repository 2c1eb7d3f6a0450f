#!/usr/bin/env bash
# One device call for paged attention: the GPU tests of the attention kernels and of the engine
# (`pytest -m gpu`), then the micro-bench (`python -m loraplex.bench.attention`); logs and
# attention.json under $OUT (bench-results/attention-check when run by hand). Prints a short table last.
#   usage: [SKIP_TESTS=1] scripts/attention_gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench-results/attention-check}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/env.txt"
$PY -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)' | tee -a "$OUT/env.txt"

t0=$(date +%s)
if [ -z "${SKIP_TESTS:-}" ]; then
  # time limits: a kernel that hangs must not eat the device call
  timeout "${TEST_TIMEOUT:-170}" $PY -m pytest -m gpu -p no:cacheprovider -p no:warnings -rs \
    tests/layers/test_attention_kernels.py tests/engine/test_engine_gpu.py 2>&1 | tee "$OUT/pytest-gpu.log"
fi
touch "$OUT/pytest-gpu.log"
t1=$(date +%s)
timeout "${BENCH_TIMEOUT:-100}" $PY -m loraplex.bench.attention --out "$OUT" 2>&1 | tee "$OUT/bench.log"
t2=$(date +%s)

echo
echo "================ summary ================"
echo "pytest -m gpu ($((t1 - t0)) s): $(grep -E '(passed|failed|error|skipped)' "$OUT/pytest-gpu.log" | tail -1)"
grep -E '^FAILED|^ERROR' "$OUT/pytest-gpu.log" | head -8
echo "micro-bench ($((t2 - t1)) s):"
sed -n '/^device /,$p' "$OUT/bench.log"
