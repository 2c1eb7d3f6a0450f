"""matplotlib for the benches' PNG plots, headless, or None when it is not installed (the reports
then say so instead of failing)."""

from __future__ import annotations

from typing import Any


def pyplot() -> Any | None:  # noqa: ANN401 (matplotlib.pyplot, an optional dependency)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt
