#!/usr/bin/env bash
# Create .venv and install loraplex into it. `scripts/install.sh test` adds the test extra
# (pinned reference versions of transformers + PEFT, pytest, ruff).
set -euo pipefail
cd "$(dirname "$0")/.."
extra="${1:-}"
PY="${PYTHON:-python3}"

if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
VPY=.venv/bin/python
"$VPY" -m pip install -q --upgrade pip >/dev/null

# Install the pinned CPU build of torch first: an unpinned requirement can pull a multi-GB CUDA
# build. Skip when a new enough torch is already there.
if ! "$VPY" -c 'import sys, torch; v = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]); sys.exit(v < (2, 11))' 2>/dev/null; then
  echo "installing torch ..."
  "$VPY" -m pip install -q torch==2.13.0 || "$VPY" -m pip install -q "torch>=2.11"
fi

# Skip the (editable, so code changes need none) reinstall when pyproject.toml has not changed.
stamp=".venv/.loraplex-installed${extra:+-$extra}"
want=$(sha256sum pyproject.toml | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
echo "installing loraplex${extra:+ [$extra]} ..."
if [ -n "$extra" ]; then
  "$VPY" -m pip install -q -e ".[$extra]"
else
  "$VPY" -m pip install -q -e .
fi
echo "$want" > "$stamp"
