"""Small models the repository ships or builds itself (no downloads): the demo model with its task
adapters (trained by `python -m loraplex.demo.train`), a character tokenizer, and a tiny random
Llama for smoke runs of the CLI."""

from pathlib import Path

ASSETS_DIR = Path(__file__).parent / "assets"
DEMO_MODEL_DIR = ASSETS_DIR / "model"
DEMO_ADAPTER_NAMES = ("reverse", "upper", "sort", "caesar")
DEMO_ADAPTERS: dict[str, Path] = {name: ASSETS_DIR / "adapters" / name for name in DEMO_ADAPTER_NAMES}
