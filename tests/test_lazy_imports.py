"""The engine, `LLM` and the command line load without the server-side packages (the GPU machine's
image lacks SQLAlchemy, fsspec and s3fs): those are imported only where the control plane runs."""

from __future__ import annotations

import subprocess
import sys

CODE = """
import sys
for name in ("sqlalchemy", "fsspec", "s3fs"):
    sys.modules[name] = None  # importing it now raises ImportError
import loraplex.cli, loraplex.llm, loraplex.engine.engine, loraplex.adapters.registry
from loraplex.llm import LLM
from loraplex.demo import DEMO_ADAPTERS, DEMO_MODEL_DIR
llm = LLM(str(DEMO_MODEL_DIR))
llm.register_adapter("reverse", str(DEMO_ADAPTERS["reverse"]))
print(llm.generate(["abc="], adapters="reverse")[0].text)
"""


def test_engine_llm_and_cli_need_no_server_packages() -> None:
    out = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "cba"
