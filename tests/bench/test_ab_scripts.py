"""The serving A/B scripts of `benchmarks/` on the CPU demo model (`--smoke`): they run the real
`bench serve` and print what a GPU A/B reads from them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _run(script: str, *args: str, out: Path) -> list[dict]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "AB_VERSION": "smoke"}
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), *args, "--smoke", "--out", str(out)],
        check=True, capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    return [
        json.loads(line[len("RESULT ") :]) for line in done.stdout.splitlines() if line.startswith("RESULT ")
    ]


def test_serve_base_run_prints_its_result(tmp_path: Path) -> None:
    (result,) = _run("serve_base_run.py", "--requests", "24", out=tmp_path)
    assert result["version"] == "smoke"
    assert result["output_tokens_per_s"] > 0
    assert result["mixed_median_ms"] > 0 and result["decode_median_ms"] > 0
    assert (tmp_path / "serve.json").is_file() and (tmp_path / "serve.md").is_file()


def test_attention_tiling_ab_runs_each_spec(tmp_path: Path) -> None:
    results = _run("attention_tiling_ab.py", "", "prefill_num_stages=4", "--requests", "16", out=tmp_path)
    assert [r["spec"] for r in results] == [
        "(shipped)",
        "prefill_num_stages=4",
        "prefill_num_stages=4",
        "(shipped)",
    ]
    assert all(r["output_tokens_per_s"] > 0 for r in results)
