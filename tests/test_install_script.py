"""scripts/install.sh: one line when there is nothing to do, numbered steps with pip's progress and
times when there is, a non-zero exit with a message when something fails. Nothing is installed:
the runs use a copy of the script beside a stand-in .venv whose python answers with scripted pip
output."""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "install.sh"
UP_TO_DATE = "loraplex is installed and up to date (.venv)"

# Stands in for .venv/bin/python: `python -` (the torch version check) prints $FAKE_TORCH or fails;
# `python -m pip install ...` prints pip-like lines, or fails when its arguments contain
# $FAKE_PIP_FAIL. Every call is logged to calls.log.
FAKE_PYTHON = r"""#!/bin/sh
echo "$*" >> "$(dirname "$0")/../../calls.log"
if [ "$1" = "-" ]; then
  cat >/dev/null
  [ -n "$FAKE_TORCH" ] || exit 1
  echo "$FAKE_TORCH"
  exit 0
fi
if [ "$1 $2 $3" != "-m pip install" ]; then exit 1; fi
case "$*" in
  *--help*) echo "  --progress-bar <progress_bar>  [auto, on, off, raw] (default: auto)"; exit 0 ;;
esac
if [ -n "$FAKE_PIP_FAIL" ]; then
  case "$*" in
    *"$FAKE_PIP_FAIL"*) echo "ERROR: No matching distribution found for $FAKE_PIP_FAIL"; exit 1 ;;
  esac
fi
echo "Collecting thing"
echo "  Downloading thing-1.0-py3-none-any.whl.metadata (4.1 kB)"
echo "Requirement already satisfied: numpy in ./site-packages"
echo "  Downloading thing-1.0-py3-none-any.whl (191.8 MB)"
echo "Progress 0 of 191800000"
echo "Progress 47950000 of 191800000"
echo "Progress 95900000 of 191800000"
echo "Progress 191800000 of 191800000"
echo "Installing collected packages: thing"
echo "Successfully installed thing-1.0"
"""


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """A checkout's scripts/install.sh and pyproject.toml beside a stand-in .venv."""
    (tmp_path / "scripts").mkdir()
    shutil.copy2(SCRIPT, tmp_path / "scripts" / "install.sh")
    shutil.copy2(REPO / "pyproject.toml", tmp_path / "pyproject.toml")
    python = tmp_path / ".venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(FAKE_PYTHON)
    python.chmod(0o755)
    return tmp_path


def _run(root: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    full = {k: v for k, v in os.environ.items() if not k.startswith(("FAKE_", "PIP_"))}
    # Should anything reach a real pip, it finds no package anywhere (never a real install).
    full.update(PIP_CONFIG_FILE=os.devnull, PIP_NO_INDEX="1", **env)
    return subprocess.run(
        ["bash", str(root / "scripts" / "install.sh"), *args],
        capture_output=True,
        text=True,
        env=full,
        timeout=60,
    )


def _calls(root: Path) -> list[str]:
    log = root / "calls.log"
    return log.read_text().splitlines() if log.exists() else []


def test_nothing_to_do_prints_one_line(tree: Path) -> None:
    stamp = tree / ".venv" / ".loraplex-installed-test"
    stamp.write_text(_sha(tree / "pyproject.toml") + "\n")
    run = _run(tree, "test", FAKE_TORCH="2.13.0+cpu")
    assert (run.returncode, run.stdout, run.stderr) == (
        0,
        "loraplex [test] is installed and up to date (.venv)\n",
        "",
    )
    # An install with the test extra covers the plain one (scripts/run.sh after scripts/test.sh).
    run = _run(tree, FAKE_TORCH="2.13.0+cpu")
    assert (run.returncode, run.stdout, run.stderr) == (0, UP_TO_DATE + "\n", "")
    assert not any("pip" in c for c in _calls(tree))


def test_steps_show_what_how_big_progress_and_time(tree: Path) -> None:
    run = _run(tree)
    assert run.returncode == 0, run.stdout + run.stderr
    out = run.stdout
    lines = out.splitlines()
    steps = [line for line in lines if line.startswith("[")]
    assert steps == [
        "[1/3] upgrading pip in .venv (~2 MB download) ...",
        "[2/3] installing torch 2.13.0 (~200 MB download as the CPU build) ...",
        "[3/3] installing loraplex and its dependencies "
        "(transformers, fastapi, uvicorn, ...; ~50 MB download) ...",
    ]
    assert len(re.findall(r"^      done in \d+ s$", out, re.M)) == 3
    assert re.search(r"^loraplex is installed in \.venv \(\d+ s\)$", out, re.M)
    # pip's own progress, with the noise left out.
    assert "        Downloading thing-1.0-py3-none-any.whl (191.8 MB)" in lines
    assert ".metadata" not in out
    assert "         0% 20% 50% 100%" in lines
    assert "      Successfully installed thing-1.0" in lines
    assert "Requirement already satisfied" not in out and "Progress" not in out
    assert "Requirement already satisfied" in (tree / ".venv" / "install.log").read_text()
    installs = [c for c in _calls(tree) if c.startswith("-m pip install") and "--help" not in c]
    assert installs == [
        "-m pip install --progress-bar off --upgrade pip",
        "-m pip install --progress-bar raw torch==2.13.0",
        "-m pip install --progress-bar raw -e .",
    ]
    assert (tree / ".venv" / ".loraplex-installed").read_text().strip() == _sha(tree / "pyproject.toml")

    # Installed now: one line, no pip.
    calls = len(_calls(tree))
    run = _run(tree, FAKE_TORCH="2.13.0")
    assert (run.returncode, run.stdout) == (0, UP_TO_DATE + "\n")
    assert not any("pip" in c for c in _calls(tree)[calls:])


def test_only_the_missing_steps_run(tree: Path) -> None:
    (tree / ".venv" / ".loraplex-installed").write_text(_sha(tree / "pyproject.toml") + "\n")
    run = _run(tree, "test", FAKE_TORCH="2.13.0+cpu")
    assert run.returncode == 0, run.stdout + run.stderr
    steps = [line for line in run.stdout.splitlines() if line.startswith("[")]
    assert steps[1:] == [
        "[2/3] torch 2.13.0+cpu is installed",
        "[3/3] installing loraplex [test] and its dependencies "
        "(transformers, fastapi, peft, triton, ...; ~250 MB download) ...",
    ]
    assert (tree / ".venv" / ".loraplex-installed-test").exists()


def test_a_failing_pip_fails_the_install_loudly(tree: Path) -> None:
    run = _run(tree, FAKE_PIP_FAIL="torch")
    assert run.returncode != 0
    assert "      ERROR: No matching distribution found for torch" in run.stdout.splitlines()
    assert "error: pip failed (exit status 1) while installing torch" in run.stderr
    assert ".venv/install.log" in run.stderr
    tried = [c for c in _calls(tree) if "torch" in c]
    assert tried == [
        "-m pip install --progress-bar raw torch==2.13.0",
        "-m pip install --progress-bar raw torch>=2.11",
    ]
    assert "[3/3]" not in run.stdout
    assert not list((tree / ".venv").glob(".loraplex-installed*"))


def test_a_missing_interpreter_is_named(tree: Path) -> None:
    shutil.rmtree(tree / ".venv")
    run = _run(tree, PYTHON=str(tree / "no-such-python"))
    assert run.returncode != 0
    assert f"error: no Python interpreter '{tree / 'no-such-python'}'" in run.stderr
    assert "PYTHON" in run.stderr
    assert not (tree / ".venv").exists()


def _installed_here() -> bool:
    """This checkout's .venv holds torch and an install stamp of the current pyproject.toml."""
    venv = REPO / ".venv"
    want = _sha(REPO / "pyproject.toml")
    stamps = [p for p in venv.glob(".loraplex-installed*") if p.read_text().strip() == want]
    return bool(stamps) and any(venv.glob("lib/python*/site-packages/torch-*.dist-info"))


@pytest.mark.skipif(
    not _installed_here(), reason="this checkout's .venv is not installed at its pyproject.toml"
)
@pytest.mark.skipif(sys.platform == "win32", reason="bash script")
def test_this_installed_checkout_is_up_to_date() -> None:
    run = _run(REPO)
    assert (run.returncode, run.stdout, run.stderr) == (0, UP_TO_DATE + "\n", "")
