#!/usr/bin/env bash
# Install everything with the test extra, lint, and run the test suite (CPU; GPU tests skip).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install.sh test
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/python -m pytest tests "$@"
