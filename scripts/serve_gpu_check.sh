#!/usr/bin/env bash
# The serving targets on a GPU machine (docs/bench.md, `loraplex bench serve`), one part per device
# call, each time-boxed under the device tool's 600 s:
#   targets  the issue workload (Llama-3-8B shape, 32 adapters r=16, Zipf 1, 20% base, prompts
#            128-1024, outputs 64-256, closed loop 64, 1,000 requests): seed 1, seed 2 and Poisson
#            arrivals at 0.9x the closed-loop rate, each with adapters and base-only (~6 min)
#   sweep    the same workload base-only at step budgets 192..512, admission batching off, one
#            engine (`--budget-sweep`), against the default budget (~4 min)
#   hf       with adapters against transformers + PEFT on the first 64 requests, one batch (random weights
#            written to $WORKDIR once, ~16 GB), transformers stopped after $HF_TIME_LIMIT s (240) of
#            generation: then the ratio is a lower bound from its measured step pace (~8 min)
#   http     256 streams over HTTP against a server on the same engine in its own process, and
#            in-process (~5 min)
#   long     the targets' workload at 3,000 requests, with adapters and base-only, every step's
#            record kept: the worst step and the GC passes of a longer run (~5 min)
# Results under $RESULTS (default bench-results/serve-gpu-check/PART); the report's summary lines
# are printed last. The GPU image lacks the server's packages: install carried wheels onto
# PYTHONPATH first (the device tool's notes say how).
#   usage: scripts/serve_gpu_check.sh targets|sweep|hf|http|long [extra bench serve args]
set -uo pipefail
cd "$(dirname "$0")/.."
part=${1:?usage: scripts/serve_gpu_check.sh targets|sweep|hf|http|long [bench serve args]}
shift
PY=${PYTHON:-python3}
OUT_DIR=${RESULTS:-bench-results/serve-gpu-check}/$part
mkdir -p "$OUT_DIR"
export PYTHONUNBUFFERED=1
WORKLOAD=(--device cuda --random-layers 32 --num-adapters 32 --ranks 16 --popularity zipf:1.0
  --base-share 0.2 --prompt-len uniform:128:1024 --output-len uniform:64:256 --num-requests 1000
  --seed 1 --quiet --out "$OUT_DIR")
case "$part" in
  targets) args=(--arrivals closed:64 --more-seeds 2 --poisson-factor 0.9) ;;
  sweep) args=(--arrivals closed:64 --budget-sweep 192,256,320,384,512) ;;
  hf) args=(--arrivals closed:64 --no-base-compare --hf-compare --hf-requests 64 --hf-time-limit "${HF_TIME_LIMIT:-240}"
    --workdir "${WORKDIR:-bench-results/serve-checkpoint}") ;;
  http) args=(--arrivals closed:256 --max-num-seqs 256 --no-base-compare --http-compare) ;;
  long) args=(--arrivals closed:64 --num-requests 3000 --step-records) ;;
  *) echo "unknown part: $part (targets, sweep, hf, http or long)" >&2; exit 2 ;;
esac
timeout -s INT "${SERVE_TIMEOUT:-570}" $PY -m loraplex.bench.cli serve "${WORKLOAD[@]}" "${args[@]}" "$@" \
  > "$OUT_DIR/serve.log" 2>&1
rc=$?
grep -v "Warning\|_warn_once" "$OUT_DIR/serve.log" | tail -4
# the runs' table, the ratios, startup and busy lines
[ -f "$OUT_DIR/serve.md" ] && grep -E '^\| [^|]*[a-z][^|]* \| [0-9.]+ \| [0-9.-]+ \| [0-9.]+ \|$|^output tokens|^base-only output|^base-only run by phase|: [0-9.]+$|^startup|^GPU busy|^kernel time|^Python GC|^mixed steps|^steps:' \
  "$OUT_DIR/serve.md"
exit $rc
