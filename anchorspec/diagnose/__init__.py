"""Diagnostics: attention drift along a drafted chain (EAGLE-3 vs EAGLE-3.1)."""

from .drift import measure_drift
from .plots import plot_drift

__all__ = ["measure_drift", "plot_drift"]
