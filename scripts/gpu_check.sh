#!/usr/bin/env bash
# One device call for the LoRA kernels: `pytest -m gpu`, then `bench kernels`; logs and results
# under $OUT (bench-results/gpu-check when run by hand). Prints a short table last.
#   usage: [SKIP_TESTS=1] scripts/gpu_check.sh [extra `bench kernels` args, e.g. --quick --no-sweep]
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench-results/gpu-check}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv | tee "$OUT/env.txt"
$PY -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)' | tee -a "$OUT/env.txt"

t0=$(date +%s)
if [ -z "${SKIP_TESTS:-}" ]; then
# tests/server needs openai + uvicorn, which the device image lacks; it has no GPU tests.
# (time limits: a kernel that hangs must not eat the device call)
timeout "${TEST_TIMEOUT:-330}" $PY -m pytest -m gpu -p no:cacheprovider --ignore=tests/server -rs 2>&1 | tee "$OUT/pytest-gpu.log"
fi
touch "$OUT/pytest-gpu.log"
t1=$(date +%s)
timeout "${BENCH_TIMEOUT:-300}" $PY -m loraplex.bench.cli kernels --out "$OUT" "$@" 2>&1 | tee "$OUT/bench.log"
t2=$(date +%s)

echo
echo "================ summary ================"
echo "pytest -m gpu ($((t1 - t0)) s): $(grep -E '(passed|failed|error|skipped)' "$OUT/pytest-gpu.log" | tail -1)"
echo "bench kernels ($((t2 - t1)) s):"
grep -E '^(PASS|FAIL)|copy bandwidth' "$OUT/bench.log"
if [ -f "$OUT/kernels.json" ]; then
  $PY - "$OUT/kernels.json" <<'PYEOF'
import json, sys
r = json.load(open(sys.argv[1]))
keys = ("decode M=64 D=32 r=16", "decode M=64 D=32 r=mixed", "prefill M=4096 D=8 r=16")
for res in r["results"]:
    if res["label"] in keys:
        for g, m in res["layers"].items():
            print(f"  {res['label']:26s} {g:8s} eager {m['eager_us']:8.1f} graph {m['graph_us']:8.1f} us "
                  f"frac {m['graph_copy_frac']:.2f} base {m['base_graph_us']:7.1f}")
for t in r["tiling"]:
    print(f"  tiling {t['case']:26s} {t['tiling']:20s} eager {t['eager_us']:8.1f} graph {t['graph_us']:8.1f}")
PYEOF
fi
