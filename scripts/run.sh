#!/usr/bin/env bash
# Install everything, then run the main job: the OpenAI-compatible server on the bundled demo
# model with all its adapters (http://127.0.0.1:8000/v1). Extra arguments go to `loraplex serve`.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install.sh
exec .venv/bin/loraplex serve "$@"
