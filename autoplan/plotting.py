"""matplotlib's pyplot for the figures autoplan draws (plans, timelines, the topology), loaded
when a figure is drawn: matplotlib is an optional dependency (``pip install
'autoplan[plot]'``), and importing autoplan must not need it."""

from __future__ import annotations

from typing import Any


def pyplot(error: type[Exception]) -> Any:
    """``matplotlib.pyplot`` on the Agg backend (files, no display); where matplotlib is
    missing, ``error`` (the caller's layer's) saying how to install it."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise error("drawing needs matplotlib: pip install 'autoplan[plot]'") from e
    return plt
