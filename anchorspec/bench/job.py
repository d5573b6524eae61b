"""`anchorspec bench`: load the target and drafters once, run the methods on the workloads, and write
records.jsonl, summary.json, results.md and one PNG per temperature into the output folder."""

from __future__ import annotations

import json
import os
import platform
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..api import Engine
from ..decode.lookup import LookupSettings
from ..decode.shape import load_profile_shape
from ..decode.tree import TreeShape
from ..errors import AnchorspecError
from ..models.drafter import load_drafter
from ..models.hub import resolve_target
from ..models.packed import is_packed
from ..models.target import load_target, parse_dtype, stock_twin
from .methods import PROMPT_LOOKUP_TOKENS, HFGenerate, Loop
from .plots import plot_summary
from .report import markdown, summarize
from .runner import run_benchmark
from .workloads import expand_workloads, load_workload

BASELINES = ("hf", "hf_lookup", "vanilla", "lookup")  # what --baselines may name
DEFAULT_BASELINES = ("hf", "hf_lookup", "vanilla")


@dataclass
class BenchSpec:
    target: str
    # (name, directory[@SHAPE]); SHAPE: TOP_K,DEPTH,TOTAL, "auto" (the `anchorspec tune` profile) or
    # "adaptive" (the default shape's depth adapted during each generation)
    drafters: list[tuple[str, str]] = field(default_factory=list)
    baselines: tuple[str, ...] = DEFAULT_BASELINES  # "hf" always runs (the baseline)
    workloads: str = "standard"
    temperatures: tuple[float, ...] = (0.0,)
    limit: int = 5
    max_new_tokens: int = 128
    dtype: str = "bfloat16"
    shape: TreeShape | None = None  # None: the chain the measured costs favour, as `generate` chooses
    data_dir: str | None = None
    out: str = "bench-out"
    resume: bool = False
    progress: bool = True
    fallback: bool = True  # drafters step plain where the measured break-even says drafting does not pay

    def check(self) -> None:
        unknown = [b for b in self.baselines if b not in BASELINES]
        if unknown:
            raise AnchorspecError(f"unknown baseline(s) {unknown}; choose from {', '.join(BASELINES)}")
        names = [n for n, _ in self.drafters]
        if len(set(names)) < len(names) or set(names) & set(BASELINES):
            raise AnchorspecError(f"drafter names must be distinct and not one of {BASELINES}: {names}")
        for name, entry in self.drafters:
            path, _ = split_shape(entry)
            if not Path(path).is_dir():
                raise AnchorspecError(f"drafter {name}: directory {path} does not exist")
        if any(t < 0 for t in self.temperatures) or not self.temperatures:
            raise AnchorspecError(f"temperatures must be >= 0, got {list(self.temperatures)}")
        if self.max_new_tokens < 1 or self.limit < 1:
            raise AnchorspecError("--max-new-tokens and --limit must be >= 1")


def split_shape(entry: str) -> tuple[str, str | None]:
    """'DIR@4,4,16' -> ('DIR', '4,4,16'); 'DIR' -> ('DIR', None)."""
    path, sep, shape = entry.rpartition("@")
    return (path, shape) if sep and path else (entry, None)


def describe_shape(shape: TreeShape | None) -> str:
    return "measured" if shape is None else f"{shape.top_k},{shape.depth},{shape.total_tokens}"


def resolve_shape(text: str | None, default: TreeShape | None, target: str, path: str, dtype) -> TreeShape | None:
    """A drafter entry's shape: its @SHAPE, else `default` (None: measured when the engine first drafts)."""
    if text is None or text == "adaptive":
        return default
    if text == "auto":
        tuned = load_profile_shape(resolve_target(target), path, dtype)
        if tuned is None:
            raise AnchorspecError(f"{path}@auto: no tuned shape for this target, dtype and thread count; "
                                  "run `anchorspec tune` first")
        return tuned[0]
    try:
        return TreeShape.parse(text)
    except AnchorspecError as exc:
        raise AnchorspecError(f"drafter {path}: shape {text!r} is not auto, adaptive or TOP_K,DEPTH,TOTAL ({exc})") \
            from None


def environment(spec: BenchSpec) -> dict:
    return {"target": spec.target, "dtype": spec.dtype, "threads": torch.get_num_threads(),
            "device": "cpu", "cpu_count": os.cpu_count(), "machine": platform.machine(),
            "cpu_capability": torch.backends.cpu.get_cpu_capability(), "torch": torch.__version__,
            "transformers": __import__("transformers").__version__, "max_new_tokens": spec.max_new_tokens,
            "shape": describe_shape(spec.shape),
            "loadavg_at_start": os.getloadavg()}


def run_bench(spec: BenchSpec) -> dict:
    spec.check()
    workloads = expand_workloads(spec.workloads)
    dtype = parse_dtype(spec.dtype)
    drafters = []
    for name, entry in spec.drafters:
        path, shape_text = split_shape(entry)
        shape = resolve_shape(shape_text, spec.shape, spec.target, path, dtype)
        drafters.append((name, load_drafter(path, dtype), shape, shape_text == "adaptive"))
    target = load_target(spec.target, dtype)
    engine = Engine(target)  # encoding and stop tokens
    stop = engine.stop_token_ids()
    context = getattr(target.config, "max_position_embeddings", None)
    prompts = [p for w in workloads for p in load_workload(w, spec.limit, target.tokenizer, spec.data_dir, context,
                                                           spec.max_new_tokens)]
    stock = stock_twin(target, spec.target, dtype)
    methods = [HFGenerate(stock, stop)]
    if "hf_lookup" in spec.baselines:
        methods.append(HFGenerate(stock, stop, prompt_lookup=PROMPT_LOOKUP_TOKENS))
    if "vanilla" in spec.baselines:
        methods.append(Loop("vanilla", target, stop))
    if "lookup" in spec.baselines:
        methods.append(Loop("lookup", target, stop, lookup=LookupSettings()))
    methods += [Loop(name, target, stop, drafter, shape, adaptive, fallback=spec.fallback)
                for name, drafter, shape, adaptive in drafters]
    settings = {"target": spec.target, "dtype": spec.dtype, "packed": is_packed(target.model),
                "workloads": workloads, "limit": spec.limit,
                "drafters": [[name, entry, describe_shape(s), adaptive]
                             for (name, entry), (_, _, s, adaptive) in zip(spec.drafters, drafters)]}
    records = run_benchmark(methods, prompts, target.tokenizer, temperatures=spec.temperatures,
                            max_new_tokens=spec.max_new_tokens, out_dir=spec.out, settings=settings,
                            resume=spec.resume, progress=spec.progress)
    env = environment(spec)
    loops = {m.name: m for m in methods if isinstance(m, Loop) and m.engine is not None}
    env["drafter_shapes"] = {name: describe_shape(loops[name].shape) + (" adaptive" if adaptive else "")
                             + (f" ({loops[name].engine.shape_source})" if s is None else "")
                             for name, _, s, adaptive in drafters}
    summary = summarize(records)
    summary["environment"] = env
    out = Path(spec.out)
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    (out / "results.md").write_text(markdown(summary, env))
    summary["plots"] = [str(p) for p in plot_summary(summary, out)]
    return summary
