#!/usr/bin/env bash
# Install everything, then run the main job: generate on the tiny model the repo builds.
# Extra arguments go to `loraplex generate` (e.g. --prompt "hi" --max-tokens 16).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install.sh
exec .venv/bin/loraplex generate "$@"
