#!/usr/bin/env python
"""What a speculative step costs inside llama.cpp: the target's verify forward of 1 + K tokens against
its one-token step, and the draft, per target weight type. Speculation pays only where tau exceeds
(verify + K drafts) / one step, so this says which llama.cpp setups an EAGLE-3 drafter can speed up.

For each target GGUF (the shipped Q4_1 file, its float32 copy, and with `--quantize` copies that
llama.cpp's own `llama-quantize` makes from the float32 one) and each prompt:
- `llama-completion` at T=0: one step = eval time / eval runs; prefill = prompt eval time;
- `llama-speculative-simple --spec-type draft-eagle3` with our draft GGUF, a chain of K: verify
  steps = predicted - accepted; a verify = (its prompt eval time - that prefill) / verify steps;
  drafting = its unaccounted time (total - sampling - prompt eval: llama.cpp times the target
  context only) / verify steps.
Medians over prompts. One process at a time, `--threads` for both models.

    python benchmarks/llamacpp_verify_cost.py --limit 4 --quantize Q4_0,Q8_0,F16 --out benchmarks/results/s60/llamacpp-verify-cost.json
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_core import DEFAULT_DATA, load_prompts, write_results  # noqa: E402
from peers import DEFAULT_DRAFTER, INSTALL_LLAMACPP, _number, llamacpp_binary, llamacpp_eagle3, llamacpp_plain  # noqa: E402


def parse_plain(log: str) -> dict:
    """One step, prefill and prompt length from llama-completion's timings."""
    runs = _number(r"\beval time =\s*[\d.]+ ms / +(\d+) runs", log, int)
    return {"step_ms": _number(r"\beval time =\s*([\d.]+) ms / +\d+ runs", log) / runs,
            "prefill_ms": _number(r"prompt eval time =\s*([\d.]+) ms", log),
            "prompt_tokens": _number(r"prompt eval time =\s*[\d.]+ ms / +(\d+) tokens", log, int)}


def parse_speculative(log: str, plain: dict) -> dict:
    """tau, verify and drafting costs from llama-speculative-simple's log, given the same prompt's plain run
    (its prefill is the first target batch of the speculative run too)."""
    predicted = _number(r"n_predict\s*=\s*(\d+)", log, int)
    steps = predicted - _number(r"n_accept\s*=\s*(\d+)", log, int)
    target_ms = _number(r"prompt eval time =\s*([\d.]+) ms", log)
    target_tokens = _number(r"prompt eval time =\s*[\d.]+ ms / +(\d+) tokens", log, int)
    total_ms = _number(r"total time =\s*([\d.]+) ms", log)
    sampling_ms = _number(r"sampling time =\s*([\d.]+) ms", log) or 0.0
    verify_ms = (target_ms - plain["prefill_ms"]) / steps
    return {"tau": predicted / steps, "verify_ms": verify_ms,
            "verify_tokens": (target_tokens - plain["prompt_tokens"]) / steps,
            "draft_ms": (total_ms - sampling_ms - target_ms) / steps,
            "tokens_per_s": _number(r"decoded\s+\d+ tokens in\s+[\d.]+ seconds, speed:\s*([\d.]+)", log)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", default=DEFAULT_DATA)
    p.add_argument("--limit", type=int, default=4, help="MT-bench first turns")
    p.add_argument("--chains", default="1,2,3,5", help="draft lengths K")
    p.add_argument("--quantize", default="", help="also targets that llama-quantize makes from the float32 copy, "
                   "e.g. Q4_0,Q8_0,F16 (needs the llama-quantize binary)")
    p.add_argument("--drafter", default=str(DEFAULT_DRAFTER), help="EAGLE-3 drafter directory")
    p.add_argument("--draft-type", default="q8_0", help="weight type of the draft GGUF")
    p.add_argument("--target", default="smollm2-135m-instruct")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", required=True)
    p.set_defaults(p_min=0.0, chain=None)  # what peers.llamacpp_eagle3 reads: full chains of each K
    args = p.parse_args(argv)
    from anchorspec.models.drafter import load_drafter
    from anchorspec.models.export_gguf import export_gguf, float32_alias_gguf
    from anchorspec.models.hub import alias_gguf, resolve_target
    from transformers import AutoTokenizer

    for binary in ("llama-completion", "llama-speculative-simple") + (("llama-quantize",) if args.quantize else ()):
        if llamacpp_binary(binary) is None:
            raise SystemExit(f"{binary} is not built; build it with: {INSTALL_LLAMACPP}")
    tokenizer = AutoTokenizer.from_pretrained(resolve_target(args.target))
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q["text"]}], tokenize=False,
                                             add_generation_prompt=True) for q in load_prompts(args.data, args.limit)]
    chains = [int(k) for k in args.chains.split(",")]
    report = {"draft_type": args.draft_type, "prompts": len(prompts), "targets": {}}
    with tempfile.TemporaryDirectory() as tmp:
        shipped, f32 = alias_gguf(args.target), float32_alias_gguf(args.target)
        targets = {"Q4_1 as shipped": shipped, "F32 copy": f32}
        for kind in [q.strip() for q in args.quantize.split(",") if q.strip()]:
            path = Path(tmp) / f"target-{kind}.gguf"
            subprocess.run([str(llamacpp_binary("llama-quantize")), str(f32), str(path), kind, str(args.threads)],
                           check=True, capture_output=True)
            targets[f"{kind} (llama-quantize of the F32 copy)"] = path
        draft = Path(tmp) / "draft.gguf"
        export_gguf(load_drafter(args.drafter), draft, shipped, outtype=args.draft_type, drafter_dir=args.drafter)
        print(f"| target | one step, ms | K | tau | verify, ms (x one step) | tokens a verify | drafting, ms a step "
              f"| break-even tau | tok/s (x plain) |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
        for label, path in targets.items():
            # the runs peers.py times, read for their costs instead (p-min 0: every step drafts K tokens)
            plains = [parse_plain(llamacpp_plain(path, text, args)["log"]) for text in prompts]
            step = statistics.median(x["step_ms"] for x in plains)
            row = {"step_ms": step, "plain_tokens_per_s": 1000 / step, "chains": {}}
            for k in chains:
                runs = [parse_speculative(llamacpp_eagle3(path, draft, text, args, chain=k)["log"], pl)
                        for text, pl in zip(prompts, plains)]
                med = {key: statistics.median(r[key] for r in runs) for key in runs[0]}
                med["break_even_tau"] = (med["verify_ms"] + med["draft_ms"]) / step
                row["chains"][k] = med
                print(f"| {label} | {step:.2f} | {k} | {med['tau']:.2f} | {med['verify_ms']:.2f} "
                      f"({med['verify_ms'] / step:.2f}x) | {med['verify_tokens']:.2f} | {med['draft_ms']:.2f} | "
                      f"{med['break_even_tau']:.2f} | {med['tokens_per_s']:.1f} ({med['tokens_per_s'] * step / 1000:.2f}x) |",
                      flush=True)
            report["targets"][label] = row
    write_results(args.out, args, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
