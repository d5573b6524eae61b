"""The methods a benchmark compares. Each turns prompt ids into new tokens and is timed the same way.

  hf            Hugging Face `generate` (greedy at T=0, multinomial at T>0): the baseline
  hf_lookup     Hugging Face prompt-lookup decoding (`prompt_lookup_num_tokens`)
  vanilla       the project's own plain loop (generate_vanilla)
  lookup        the project's loop with no drafter, drafting the chain copied from the text itself
                (prompt lookup: generate_prompt_lookup, decode/lookup.py)
  <drafter>     the project's speculative loop with an EAGLE drafter, through `generate`'s own
                Engine: the chain the measured costs favour unless a shape is given (fixed, or
                adapted during the generation: decode/adaptive.py), falling back to plain steps
                while speculation does not pay (decode/fallback.py; its calibration runs in the
                untimed warm-up)

All share one target model. Every method stops at the same stop tokens and counts a stop token it
emits as a new token, so tokens/s compare like with like.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from ..api import Engine, attach_drafter
from ..decode.engine import GenerationConfig, generate_prompt_lookup, generate_vanilla
from ..decode.lookup import LookupSettings
from ..decode.sampling import SamplingParams
from ..decode.tree import TreeShape
from ..metrics import GenerationStats
from ..models.drafter import Eagle3Drafter
from ..models.target import Target
from .memory import PeakMemory

PROMPT_LOOKUP_TOKENS = 10  # HF's documented example value


@dataclass
class Run:
    tokens: list[int]
    seconds: float
    stats: GenerationStats | None  # speculative runs only
    peak_mib: float | None  # peak memory during the call (see memory.PeakMemory)


class Method:
    name: str
    kind: str  # "baseline", "hf", "loop" or "drafter"

    def _generate(self, ids: list[int], max_new: int, temperature: float, seed: int):
        raise NotImplementedError

    def run(self, ids: list[int], max_new: int, temperature: float, seed: int) -> Run:
        peak = PeakMemory()
        with peak:
            t0 = time.perf_counter()
            tokens, stats = self._generate(ids, max_new, temperature, seed)
            dt = time.perf_counter() - t0
        return Run(tokens, dt, stats, peak.mib)


class HFGenerate(Method):
    def __init__(self, target: Target, stop_ids: tuple[int, ...], prompt_lookup: int = 0):
        self.target, self.stop_ids, self.prompt_lookup = target, list(stop_ids), prompt_lookup
        self.name = "hf_lookup" if prompt_lookup else "hf"
        self.kind = "hf" if prompt_lookup else "baseline"

    @torch.inference_mode()
    def _generate(self, ids, max_new, temperature, seed):
        x = torch.tensor([ids])
        kwargs = {"do_sample": False}
        if temperature > 0:  # plain multinomial sampling: no top-k/top-p truncation (HF's default top_k is 50)
            torch.manual_seed(seed)
            kwargs = {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0}
        if self.prompt_lookup:
            kwargs["prompt_lookup_num_tokens"] = self.prompt_lookup
        out = self.target.model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new,
                                         eos_token_id=self.stop_ids, pad_token_id=self.stop_ids[0], **kwargs)
        return out[0, len(ids):].tolist(), None  # batch 1: everything after the prompt is new


class Loop(Method):
    """The project's loops: plain (drafter None), prompt lookup (drafter None, `lookup` given), or
    speculative through the same `Engine` that `anchorspec generate` uses: `shape` None drafts with
    the chain the measured costs favour (as `generate` does without a tuned profile), else the given
    shape."""

    def __init__(self, name: str, target: Target, stop_ids: tuple[int, ...], drafter: Eagle3Drafter | None = None,
                 shape: TreeShape | None = None, adaptive: bool = False, fallback: bool = True,
                 lookup: LookupSettings | None = None):
        self.name, self.target, self.stop_ids = name, target, tuple(stop_ids)
        self.drafter, self.adaptive, self.lookup = drafter, adaptive, lookup
        # the engine's monitor learns across the run's prompts; fallback off: the drafter's own tau at
        # every step (comparing drafters)
        self.engine = Engine(target, drafter, shape=shape, fallback=fallback) if drafter is not None else None
        self.kind = "drafter" if drafter is not None else "loop"

    @property
    def shape(self) -> TreeShape | None:
        """The shape this drafter drafts with now (a measured one is chosen on first use)."""
        return self.engine.shape if self.engine is not None else None

    def _generate(self, ids, max_new, temperature, seed):
        if self.engine is None:
            cfg = GenerationConfig(max_new_tokens=max_new, sampling=SamplingParams(temperature), seed=seed,
                                   stop_token_ids=self.stop_ids)
            if self.lookup is not None:
                res = generate_prompt_lookup(self.target, ids, cfg, self.lookup)
                return res.token_ids, res.stats
            return generate_vanilla(self.target, ids, cfg).token_ids, None
        attach_drafter(self.target, self.drafter)  # drafters may differ in aux layers: set them per call
        # the drafter alone: its tau is what the workloads compare (generate's lookup chain would add the same
        # copied tokens to every drafter; benchmarks/bench_default_shape.py measures the defaults with it)
        res = self.engine.generate(ids, max_new_tokens=max_new, temperature=temperature, seed=seed,
                                   adaptive=self.adaptive, lookup=None)
        return res.token_ids, res.stats
