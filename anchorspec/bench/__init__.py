"""Benchmarks: workloads -> methods run side by side -> records -> summary, Markdown and plots."""

from .job import BenchSpec, run_bench

__all__ = ["BenchSpec", "run_bench"]
