"""Small models the repository can build itself (no downloads): a character tokenizer and a tiny
random Llama for smoke runs of the CLI, plus a trained demo model shipped in `assets/`.

The demo model (`DEMO_MODEL_DIR`) copies its input string; its four LoRA adapters
(`DEMO_ADAPTERS`: reverse, upper, sort, caesar) turn the same prompt into other string tasks, so
a mixed batch shows at a glance which adapter served which row. Prompts are `"<input>="`; see
`tasks.py` for the tasks and the held-out split, `train.py` to retrain, docs/demo.md for results.
"""

from pathlib import Path

from loraplex.demo.tasks import ADAPTER_TASKS

_ASSETS = Path(__file__).parent / "assets"
DEMO_MODEL_DIR: Path = _ASSETS / "model"
DEMO_ADAPTERS: dict[str, Path] = {task: _ASSETS / "adapters" / task for task in ADAPTER_TASKS}
