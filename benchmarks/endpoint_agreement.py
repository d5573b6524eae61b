#!/usr/bin/env python
"""How far answers regenerated through another engine are from the PyTorch target's own greedy answers.

`regenerate --endpoint` lets any OpenAI-compatible server write a drafter corpus (llama.cpp's
llama-server on the GGUF as shipped, vLLM). Its kernels round differently (quantised weights and
activations in llama.cpp's Q4_1 path; fp32 vs bf16 accumulation), so its greedy answers part from the
target's somewhere. This script takes answer files of the same prompts, one per engine, and reports:

- exact answers: the share identical to the reference file's (the first `--answers`);
- agreed prefix: the mean share of each answer, in target tokens, before the first difference;
- on-policy tokens: teacher-forced, the share of an answer's tokens that are the PyTorch target's
  own greedy choice (`--dtype`, float32 by default) given the prompt and the answer so far. This is
  what a drafter trained on the file learns to imitate: a token that is not the target's argmax is one
  a T=0 verifier would reject. The reference's own figure is the control (1 for the target's own
  greedy answers scored in the dtype and layout that wrote them; below 1 where they differ, e.g.
  answers written in batches with prepacked weights and scored one by one with stock ones).

Answers are compared as text re-tokenised by the target's tokenizer (an endpoint returns text).

    P=prompts.jsonl   # {"id", "prompt"} rows
    anchorspec regenerate --target smollm2-135m-instruct --data $P --dtype float32 --out fp32.jsonl ...
    anchorspec regenerate --target smollm2-135m-instruct --data $P --dtype bfloat16 --out bf16.jsonl ...
    llama-server -m target.gguf --jinja -t 1 -np 1 --port 8091 &
    anchorspec regenerate --target smollm2-135m-instruct --data $P --endpoint http://127.0.0.1:8091/v1 \\
        --concurrency 1 --out q4_1.jsonl ...
    python benchmarks/endpoint_agreement.py --answers pytorch-fp32=fp32.jsonl --answers pytorch-bf16=bf16.jsonl \\
        --answers llamacpp-q4_1=q4_1.jsonl --out benchmarks/results/endpoint/agreement.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

from anchorspec.data.chat import render_with_loss_mask
from anchorspec.data.readers import jsonl_rows
from anchorspec.decode.lookup import common_prefix
from anchorspec.models.dtype import argmax_last
from anchorspec.models.target import load_target


def read_answers(path: str) -> dict[str, dict]:
    """id -> record (`messages`: the prompt turns and the answer; `finish`) of a regenerate output."""
    return {rec["id"]: rec for _, rec in jsonl_rows(path)}


def answer_ids(tokenizer, messages: list[dict]) -> list[int]:
    return tokenizer(messages[-1]["content"], add_special_tokens=False)["input_ids"]


agreed_prefix = common_prefix  # tokens before the first difference


@torch.no_grad()
def on_policy_share(target, messages: list[dict], cut_off: bool) -> tuple[int, int]:
    """(answer tokens the target would itself choose greedily, answer tokens), teacher-forced. The
    template closes every reply with its end-of-turn token; a reply cut off at the token limit never
    chose it, so `cut_off` leaves that last token unscored."""
    ids, mask = render_with_loss_mask(target.tokenizer, messages)
    x = torch.tensor([ids])
    logits = target.model(input_ids=x).logits[0, :-1]
    choice = argmax_last(logits.float())
    scored = torch.tensor(mask[1:], dtype=torch.bool)
    if cut_off and scored.any():
        scored[int(scored.nonzero()[-1])] = False
    return int((choice[scored] == x[0, 1:][scored]).sum()), int(scored.sum())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--answers", action="append", required=True, metavar="NAME=FILE",
                   help="a regenerate output; the first is the reference (give at least two)")
    p.add_argument("--target", default="smollm2-135m-instruct")
    p.add_argument("--dtype", default="float32", help="the target that scores on-policy tokens")
    p.add_argument("--pack", default="auto", choices=["auto", "on", "off"],
                   help="weight layout of the scoring target (auto: as `regenerate` loads it)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    if len(args.answers) < 2:
        p.error("give at least two --answers NAME=FILE (the first is the reference)")
    torch.set_num_threads(args.threads)
    files = {}
    for spec in args.answers:
        name, _, path = spec.partition("=")
        files[name] = read_answers(path)
    ids = sorted(set.intersection(*(set(f) for f in files.values())))
    if not ids:
        raise SystemExit("no prompt id is answered in every file")
    target = load_target(args.target, args.dtype, pack=args.pack)
    tok = target.tokenizer
    ref_name = next(iter(files))
    ref = {i: answer_ids(tok, files[ref_name][i]["messages"]) for i in ids}
    rows = {}
    for name, answers in files.items():
        exact, prefix_share, on, scored, lengths = 0, [], 0, 0, []
        for i in ids:
            mine = answer_ids(tok, answers[i]["messages"])
            exact += mine == ref[i]
            prefix_share.append(agreed_prefix(mine, ref[i]) / max(len(mine), len(ref[i]), 1))
            a, n = on_policy_share(target, answers[i]["messages"], answers[i].get("finish") == "length")
            on, scored = on + a, scored + n
            lengths.append(len(mine))
        rows[name] = {"exact": exact, "prompts": len(ids), "exact_share": exact / len(ids),
                      "mean_agreed_prefix_share": statistics.fmean(prefix_share),
                      "on_policy_share": on / max(scored, 1), "answer_tokens": sum(lengths)}
    print(f"{len(ids)} prompts answered by every engine; reference {ref_name}; on-policy scored by the PyTorch "
          f"target in {args.dtype}\n")
    print("| answers | identical to the reference | mean agreed prefix | on-policy tokens | answer tokens |")
    print("|---|---|---|---|---|")
    for name, r in rows.items():
        print(f"| {name} | {r['exact']}/{r['prompts']} | {r['mean_agreed_prefix_share']:.1%} | "
              f"{r['on_policy_share']:.2%} | {r['answer_tokens']} |")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"reference": ref_name, "dtype": args.dtype, "prompts": ids,
                                          "rows": rows, "files": dict(a.partition("=")[::2] for a in args.answers)},
                                         indent=1) + "\n")
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
