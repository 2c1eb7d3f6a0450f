#!/usr/bin/env bash
# One device call that checks the whole GPU engine: `pytest -m gpu` (everything but tests/server,
# whose dependencies the GPU image lacks), `bench engine` (issue 5's case, 3 alternating pairs),
# then `bench kernels --quick --no-sweep` (issue 4's targets). Logs and results under $RESULTS
# (default bench-results/engine-gpu-check); when $OUT is set (a remote device call that returns
# only a few files), they are also packed into $OUT/engine-gpu-check.tgz, and the short summary,
# printed last, is copied to $OUT/summary.txt. Each part is time-boxed so a
# hung kernel cannot eat the call (about 6-7 minutes on an H200 in all).
# Bench engine args such as --steps 30 follow. NCU=1 adds an Nsight Compute pass over the
# decode target layer (ncu-short.txt); TIMELINE=1 a profiler timeline of the decode layers'
# launches (timeline.txt).
#   usage: [SKIP_TESTS=1] [SKIP_ENGINE=1] [SKIP_KERNELS=1] [TESTS="tests/engine ..."] \
#          [NCU=1] [TIMELINE=1] scripts/engine_gpu_check.sh [bench engine args]
set -uo pipefail
cd "$(dirname "$0")/.."
PACK_TO=${OUT:-}
OUT=${RESULTS:-bench-results/engine-gpu-check}
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
if [ -z "${SKIP_ENGINE:-}" ]; then
  timeout "${BENCH_TIMEOUT:-200}" $PY -m loraplex.bench.cli engine --device cuda --out "$OUT/engine" "$@" 2>&1 \
    | tee "$OUT/bench-engine.log"
fi
touch "$OUT/bench-engine.log"
t2=$(date +%s)
if [ -z "${SKIP_KERNELS:-}" ]; then
  timeout "${KERNELS_TIMEOUT:-120}" $PY -m loraplex.bench.cli kernels --quick --no-sweep --out "$OUT/kernels" \
    2>&1 | tee "$OUT/bench-kernels.log"
fi
touch "$OUT/bench-kernels.log"
if [ -n "${TIMELINE:-}" ]; then
  # when each launch of the decode layers starts and ends inside a graph replay (profiler trace),
  # a table per case
  PYTHONPATH=. timeout "${TIMELINE_TIMEOUT:-120}" $PY scripts/lora_timeline.py \
    --cases "${TIMELINE_CASES:-target,m1}" --out "$OUT/timeline.json" > "$OUT/timeline.txt" 2>&1
fi
if [ -n "${NCU:-}" ]; then
  # Nsight Compute on the decode target layer's launches, each kernel alone (clocks left alone,
  # as the device notes ask); a short per-kernel table
  PYTHONPATH=. timeout "${NCU_TIMEOUT:-120}" ncu --clock-control none --kernel-name regex:lora_ \
    --launch-skip 16 --launch-count 8 --section SpeedOfLight --section Occupancy --section LaunchStats \
    $PY scripts/ncu_lora_decode.py > "$OUT/ncu.txt" 2>&1
  grep -E "lora_|Duration|DRAM Throughput|Achieved Occupancy|Registers Per|Grid Size" "$OUT/ncu.txt" \
    > "$OUT/ncu-short.txt"
fi
t3=$(date +%s)
{
  echo
  echo "================ summary ================"
  echo "pytest -m gpu ($((t1 - t0)) s): $(grep -E '(passed|failed|error|skipped)' "$OUT/pytest-gpu.log" | tail -1)"
  echo "bench engine ($((t2 - t1)) s):"
  grep -E '(floor|step|/ base|bandwidth)' "$OUT/bench-engine.log"
  echo "bench kernels ($((t3 - t2)) s):"
  grep -E '^(PASS|FAIL)|copy bandwidth|graph replay of|^  (tiling|gemm\+lora|layers) ' "$OUT/bench-kernels.log"
  if [ -s "$OUT/timeline.txt" ]; then echo "timeline:"; cat "$OUT/timeline.txt"; fi
  if [ -s "$OUT/ncu-short.txt" ]; then echo "ncu:"; cat "$OUT/ncu-short.txt"; fi
} | tee "$OUT/summary.txt"
if [ -n "$PACK_TO" ] && [ "$PACK_TO" != "$OUT" ]; then
  tar czf "$PACK_TO/engine-gpu-check.tgz" -C "$OUT" . && cp "$OUT/summary.txt" "$PACK_TO/summary.txt"
fi
