#!/usr/bin/env bash
# One device call for the GPU engine (issue 5): the engine's GPU tests, then `bench engine`
# (issue 5's case); logs and results under $OUT (bench-results/engine-gpu-check by hand).
#   usage: [SKIP_TESTS=1] [TESTS="tests/engine ..."] scripts/engine_gpu_check.sh [extra `bench engine` args]
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench-results/engine-gpu-check}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/env.txt"
t0=$(date +%s)
if [ -z "${SKIP_TESTS:-}" ]; then
  # shellcheck disable=SC2086
  timeout "${TEST_TIMEOUT:-300}" $PY -m pytest -m gpu -p no:cacheprovider -rs ${TESTS:---ignore=tests/server} \
    2>&1 | tee "$OUT/pytest-gpu.log"
fi
touch "$OUT/pytest-gpu.log"
t1=$(date +%s)
timeout "${BENCH_TIMEOUT:-300}" $PY -m loraplex.bench.cli engine --device cuda --out "$OUT" "$@" 2>&1 \
  | tee "$OUT/bench.log"
t2=$(date +%s)
echo
echo "================ summary ================"
echo "pytest -m gpu ($((t1 - t0)) s): $(grep -E '(passed|failed|error|skipped)' "$OUT/pytest-gpu.log" | tail -1)"
echo "bench engine ($((t2 - t1)) s):"
grep -E '(floor|step|/ base|bandwidth)' "$OUT/bench.log"
