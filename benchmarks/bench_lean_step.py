#!/usr/bin/env python
"""Where the plain loop's speed comes from: Hugging Face `generate` against the project's plain loop
with each change to the target added in turn, one process, the methods alternating.

    python benchmarks/bench_lean_step.py --threads 2 --dtype bfloat16 [--new-tokens 128] [--rounds 3]
        [--target smollm2-135m-instruct] [--json FILE]

Variants (each a fresh load of the stock weights):
  hf      HF `generate`, greedy, stock weights and attention (the baseline);
  packed  the plain loop, linear weights prepacked for oneDNN (models/packed.py; the default until session 36);
  fused   plus q/k/v and gate/up as one packed product each (fuse_siblings);
  lean    plus grouped-query attention in the fastest SDPA form per call (models/attention.py): what
          load_target gives a CPU target where packing was measured faster;
  compiled-unfused  `--compile` before session 45: stock weights, grouped attention, steps through
          torch.compile (inductor, frozen weights: it prepacks each linear layer itself);
  compiled-dynamo  session 45's `--compile`: the same with q/k/v and gate/up fused first;
  compiled  `--compile` on a CPU since session 46 (load(compile=True)): the same graph compiled ahead of
          time (AOTInductor), one graph for every step shape, kept on disk for later processes.
`--variants` picks a subset (the torch.compile ones spend about a minute compiling at load, every
process; the AOT one the first time on a machine, then a few seconds).
Three chat prompts, `--new-tokens` each (HF with min_new_tokens, so every method writes as many);
tokens/s medians over prompts x rounds, and how many outputs equal HF's. CPU, torch, threads and dtype
are printed with the numbers.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from anchorspec.decode.engine import GenerationConfig, generate_vanilla  # noqa: E402
from anchorspec.models.attention import use_grouped_attention  # noqa: E402
from anchorspec.models.hub import resolve_target  # noqa: E402
from anchorspec.models.packed import pack_linears  # noqa: E402
from anchorspec.models.target import Target  # noqa: E402
from bench_core import environment, median, timed, warn_if_busy  # noqa: E402

PROMPTS = ["Write a short story about a robot learning to paint.",
           "Explain how photosynthesis works to a ten-year-old.",
           "Give three tips for writing clean Python code."]
VARIANTS = ("hf", "packed", "fused", "lean", "compiled-unfused", "compiled-dynamo", "compiled")


def load_variant(path: str, dtype: torch.dtype, variant: str):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa").eval()
    if variant in ("packed", "fused", "lean"):
        pack_linears(model, fuse=variant != "packed")
    if variant in ("lean", "compiled-unfused", "compiled-dynamo", "compiled"):
        use_grouped_attention(model)
    return model


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", help="also write the results here")
    ap.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated subset (hf always runs)")
    args = ap.parse_args()
    variants = ["hf"] + [v for v in args.variants.split(",") if v != "hf"]
    unknown = set(variants) - set(VARIANTS)
    if unknown:
        ap.error(f"unknown variants {sorted(unknown)} (have: {', '.join(VARIANTS)})")
    torch.set_num_threads(args.threads)
    warn_if_busy(args.threads)
    from transformers import AutoTokenizer

    path = resolve_target(args.target)
    tokenizer = AutoTokenizer.from_pretrained(path)
    dtype = getattr(torch, args.dtype)
    models = {v: load_variant(path, dtype, v) for v in variants}
    targets = {v: Target(m, tokenizer) for v, m in models.items() if v != "hf"}
    for v, target in targets.items():
        if v.startswith("compiled"):
            target.compile(fuse=v != "compiled-unfused", aot=v == "compiled")
            for n in (1, 2):  # trace the plain step's graph now, not while timing
                generate_vanilla(target, torch.tensor([1, 2, 3]), GenerationConfig(max_new_tokens=n))
    prompts = []
    for text in PROMPTS:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                            return_tensors="pt")
        prompts.append((ids["input_ids"] if hasattr(ids, "keys") else ids)[0])

    def run(variant: str, ids: torch.Tensor) -> list[int]:
        if variant == "hf":
            with torch.inference_mode():
                out = models[variant].generate(ids[None], max_new_tokens=args.new_tokens,
                                               min_new_tokens=args.new_tokens, do_sample=False)
            return out[0, len(ids):].tolist()
        return generate_vanilla(targets[variant], ids, GenerationConfig(max_new_tokens=args.new_tokens)).token_ids

    def agree(ours: list[int], hf: list[int]) -> bool:
        """Token for token, up to where ours stopped (HF's min_new_tokens hides its end of turn)."""
        n = len(ours) - (ours[-1:] == [tokenizer.eos_token_id] and len(ours) < args.new_tokens)
        return ours[:n] == hf[:n]

    same = dict.fromkeys(variants, 0)
    for ids in prompts:  # also the warm-up
        outs = {v: run(v, ids) for v in variants}
        for v in variants:
            same[v] += agree(outs[v], outs["hf"])
    tok_s = {v: [] for v in variants}
    for _ in range(args.rounds):
        for ids in prompts:
            for v in variants:
                out, seconds = timed(run, v, ids)
                tok_s[v].append(len(out) / seconds)
    medians = {v: median(x) for v, x in tok_s.items()}
    env = environment(args)
    print(f"{env['cpu']} ({env['cpu_capability']}), torch {env['torch']}, {args.threads} thread(s), {args.dtype}, "
          f"{args.new_tokens} new tokens, {len(prompts)} prompts x {args.rounds} rounds")
    print("| variant | tok/s (median) | over HF `generate` | outputs equal to HF's |\n|---|---|---|---|")
    for v in variants:
        print(f"| {v} | {medians[v]:.1f} | {medians[v] / medians['hf']:.2f}x | {same[v]}/{len(prompts)} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"environment": env, "tok_s": tok_s, "median": medians,
                                               "same_as_hf": same}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
