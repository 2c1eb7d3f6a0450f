"""matplotlib for the benches' PNG plots, headless, or None when it is not installed (the reports
then say so instead of failing)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def pyplot() -> Any | None:  # noqa: ANN401 (matplotlib.pyplot, an optional dependency)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def save(plt: Any, fig: Any, path: Path) -> bool:  # noqa: ANN401
    """Lay out, write (110 dpi) and close a figure; True, for the reports' `plot` to return."""
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
