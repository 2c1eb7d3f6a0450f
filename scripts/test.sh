#!/usr/bin/env bash
# Install everything with the test extra, lint, type-check, and run the test suite (CPU; GPU tests skip).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install.sh test
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/mypy --config-file pyproject.toml  # [tool.mypy]: the loraplex package, strict for parts of it
.venv/bin/python -m pytest tests "$@"
