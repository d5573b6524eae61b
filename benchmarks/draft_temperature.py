"""Sampled speculation's acceptance against the temperature the drafter drafts at, and against how many
candidates a node drafts (no timing).

At T > 0 a chain step accepts a drafted token with probability sum_x min(p(x), q(x)) (spec §7), where p is
the target's distribution at T and q the drafter's. anchorspec drafts from softmax(drafter logits / T).
A drafter trained by cross-entropy against p can be flatter or sharper than p, and then drafting at
T * s for some s != 1 raises that overlap (any q keeps the output lossless: rejection sampling uses the q it
drew from). This measures the overlap along held-out answers, teacher-forced as in training (the TTT
unroll, `train/ttt.py`): for each depth k and factor s, the mean over scored positions of
sum_x min(p(x), q_s(x)), and the chain's expected tau 1 + a_1 + a_1 a_2 + ... from those means.

`--contexts greedy,sampled` measures along two texts of the same prompts: each conversation cut to its first
answer, which is kept as stored (the corpus is greedy) or replaced by one the target samples at T. Real sampled
decoding runs along sampled text, which the drafter never trained on.

    python benchmarks/draft_temperature.py --drafter checkpoints/smollm2-135m-instruct-eagle3.1 \
        --data corpus/smollm2-135m-instruct --parts 30,31 --limit 24

`--candidates K` also scores nodes that draft up to K candidates (at the first factor): EAGLE's deterministic
top K tokens, each accepted with probability p(x) given the earlier ones failed (spec §7; the engine's sampled
tree until session 71, `verify_sampling` without draft probabilities), against K candidates drawn from q without replacement and verified by recursive
rejection sampling (each accepted with min(1, p_i(x) / q_i(x)); after a rejection p_{i+1} = norm(max(p_i - q_i,
0)) and q_{i+1} = q_i without x, renormalised: lossless, Jeon et al. 2024, "Recursive Speculative Decoding").
The chance that a node with k candidates accepts one is exact for top-k and averaged over `--samples` draws of
the candidates (the accept coins in closed form) for the sampled ones; k = 1 sampled is the chain's overlap.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from anchorspec.api import attach_drafter
from anchorspec.data.corpus import CorpusExample, read_part
from anchorspec.decode.sampling import sample_without_replacement
from anchorspec.models.drafter import load_drafter
from anchorspec.models.target import load_target
from anchorspec.train.ttt import ttt_forward


def examples_of_parts(folder: Path, parts: list[int], limit: int, max_len: int) -> list[CorpusExample]:
    """`limit` conversations spread over the given parts (not their first ones), cut to `max_len`."""
    out = []
    for part in parts:
        out += [CorpusExample(e.input_ids[:max_len], e.loss_mask[:max_len])
                for e in read_part(folder / f"part-{part:04d}.npz")]
    step = max(len(out) // limit, 1)
    return out[::step][:limit]


def first_answer(ex: CorpusExample) -> CorpusExample:
    """The conversation up to the end of its first assistant answer."""
    mask = ex.loss_mask
    start = mask.index(1)
    end = start
    while end < len(mask) and mask[end]:
        end += 1
    return CorpusExample(ex.input_ids[:end], mask[:end])


@torch.no_grad()
def resampled(target, ex: CorpusExample, temperature: float, seed: int) -> CorpusExample:
    """`ex`'s prompt with an answer the target samples at `temperature` (pure sampling: no top-k, no top-p),
    at most as long as the stored answer's budget."""
    start = ex.loss_mask.index(1)
    prompt = torch.tensor([ex.input_ids[:start]])
    torch.manual_seed(seed)
    out = target.model.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=True,
                                temperature=temperature, top_k=0, top_p=1.0,
                                max_new_tokens=len(ex.input_ids) - start, pad_token_id=0)
    answer = out[0, start:].tolist()
    return CorpusExample(ex.input_ids[:start] + answer, [0] * start + [1] * len(answer))


def topk_acceptance(p: torch.Tensor, q: torch.Tensor, k: int) -> torch.Tensor:
    """[R, k]: the chance that a node drafting q's top 1..k tokens accepts one, each tried with probability p(x)
    of what is left of p (the engine's sampled tree): the target's mass on those tokens. p, q: [R, V] over the
    draft vocabulary (p may sum to less than 1: the target's mass outside it)."""
    return p.gather(-1, q.topk(k, dim=-1).indices).cumsum(-1)


def sampled_candidates_acceptance(p: torch.Tensor, q: torch.Tensor, k: int, samples: int,
                                  generator: torch.Generator | None = None) -> torch.Tensor:
    """[R, k]: the chance that a node drafting 1..k candidates drawn from q without replacement accepts one under
    recursive rejection sampling; averaged over `samples` draws of the candidates, exact over the accept coins.
    p, q: [R, V] over the draft vocabulary; p's missing mass is the target's outside it (q has none there)."""
    R, V = p.shape
    p, q = p.float(), q.float()  # an estimate: float32 halves the [R, samples, V] work
    P = torch.cat([p, (1 - p.sum(-1, keepdim=True)).clamp(min=0)], -1).unsqueeze(1).expand(R, samples, V + 1).clone()
    Q = torch.cat([q, q.new_zeros(R, 1)], -1).unsqueeze(1).expand(R, samples, V + 1).clone()
    order = sample_without_replacement(q.unsqueeze(1).expand(R, samples, V), k, generator)  # the engine's draw
    missed = torch.ones(R, samples, dtype=torch.float64)
    out = []
    for i in range(k):
        x = order[..., i:i + 1]
        px, qx = P.gather(-1, x).squeeze(-1), Q.gather(-1, x).squeeze(-1)
        missed = missed * (1 - torch.where(qx > 0, (px / qx).clamp(max=1), torch.ones_like(qx))).double()
        out.append(1 - missed.mean(-1))
        P = (P - Q).clamp(min=0)
        P = P / P.sum(-1, keepdim=True).clamp(min=1e-30)
        Q = Q.scatter(-1, x, 0)
        Q = Q / Q.sum(-1, keepdim=True).clamp(min=1e-30)
    return torch.stack(out, -1)


CONFIDENCE_BINS = (0.0, 0.2, 0.4, 0.6, 0.8, 0.95, 1.0 + 1e-9)  # the target's top probability at T


@torch.no_grad()
def overlaps(target, drafter, ex: CorpusExample, steps: int, temperature: float, factors: list[float],
             candidates: int = 1, samples: int = 32, generator: torch.Generator | None = None):
    """Per depth k and factor s: (sum of overlaps, positions scored) along one conversation; and at depth 1 with
    the first factor, per bin of the target's top probability (CONFIDENCE_BINS): (sum of overlaps, positions, sum
    of the target's mass inside the draft vocabulary), and by the handed token, argmax or not: (sum, positions);
    and [2, steps, candidates]: the summed chance that a node with 1..candidates candidates accepts one (top-k,
    then sampled without replacement; at the first factor)."""
    ids = torch.tensor([ex.input_ids])
    loss = torch.tensor([ex.loss_mask])
    out = target.features(ids)
    logits = out.logits.float()
    res = ttt_forward(drafter, out.aux, ids, logits, loss, steps=steps, return_logits=True)
    d2t = drafter.draft_to_target
    T = ids.shape[1]
    sums = torch.zeros(steps, len(factors), dtype=torch.float64)
    counts = torch.zeros(steps, dtype=torch.long)
    bins = torch.zeros(len(CONFIDENCE_BINS) - 1, 3, dtype=torch.float64)  # overlap, positions, p in the draft vocab
    # depth 1 split by whether the token the drafter is handed (t + 1) was the target's argmax at t: the
    # drafter sees the target's features up to t only, so a sampled, unexpected token is news to it
    by_input = torch.zeros(2, 2, dtype=torch.float64)  # [argmax, not] x (overlap, positions)
    multi = torch.zeros(2, steps, candidates, dtype=torch.float64)
    for k in range(steps):
        n = T - k - 2
        if n <= 0:
            continue
        rows = torch.nonzero(loss[0, k + 2: k + 2 + n] > 0).flatten()  # assistant tokens predicted
        if rows.numel() == 0:
            continue
        target_p = torch.softmax(logits[0, k + 1 + rows] / temperature, dim=-1)  # [R, V]
        p = target_p[:, d2t].double()  # [R, Vd]
        lg = res.logits[k, 0, rows].double()
        for j, s in enumerate(factors):
            q = torch.softmax(lg / (temperature * s), dim=-1)
            overlap = torch.minimum(p, q).sum(-1)
            sums[k, j] += overlap.sum()
            if k == 0 and j == 0:
                top = target_p.amax(-1).double()
                which = torch.bucketize(top, torch.tensor(CONFIDENCE_BINS, dtype=torch.float64), right=True) - 1
                bins[:, 0].index_add_(0, which, overlap)
                bins[:, 1].index_add_(0, which, torch.ones_like(overlap))
                bins[:, 2].index_add_(0, which, p.sum(-1))  # the most any q can overlap
                expected = (logits[0, rows].argmax(-1) == ids[0, 1 + rows]).long()
                by_input[:, 0].index_add_(0, 1 - expected, overlap)
                by_input[:, 1].index_add_(0, 1 - expected, torch.ones_like(overlap))
            if j == 0 and candidates > 1:
                multi[0, k] += topk_acceptance(p, q, candidates).sum(0)
                for chunk in range(0, len(rows), 16):  # [16, samples, V] at a time
                    multi[1, k] += sampled_candidates_acceptance(
                        p[chunk:chunk + 16], q[chunk:chunk + 16], candidates, samples, generator).sum(0)
        counts[k] += rows.numel()
    return sums, counts, bins, by_input, multi


def multi_report(accept: torch.Tensor) -> dict:
    """accept [2, depths, K]: per kind (top-k, sampled) and k, the per-depth chance a node with k candidates accepts
    one, with the expected tau and verify rows of two trees of that width: k candidates at every accepted node
    (expanded whole: k + k^2 + ... rows beside the root), and k at the first level only with chains below."""
    depths, K = accept.shape[1], accept.shape[2]
    out = {}
    for kind, a in zip(("top-k", "sampled"), accept):
        for k in range(1, K + 1):
            every = float(1 + torch.cumprod(a[:, k - 1], 0).sum())
            first = float(1 + a[0, k - 1] * (1 + torch.cumprod(a[1:, 0], 0).sum()))
            out[f"{kind} {k}"] = {"acceptance": a[:, k - 1].tolist(),
                                  "tau_every_level": every, "rows_every_level": sum(k ** d for d in range(1, depths + 1)),
                                  "tau_first_level": first, "rows_first_level": k * depths}
    return out


def print_multi(report: dict, factor: float) -> None:
    print(f"  candidates a node (s={factor}): per-depth acceptance; expected tau (verify rows beside the root) of "
          "k at every level / k at the first level, chains below")
    for name, r in report.items():
        print(f"    {name:<10s} " + "  ".join(f"{x:.3f}" for x in r["acceptance"])
              + f"   {r['tau_every_level']:.3f} ({r['rows_every_level']}) / {r['tau_first_level']:.3f} "
              f"({r['rows_first_level']})")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--drafter", action="append", required=True, help="NAME=DIR, or DIR (repeatable)")
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--data", default="corpus/smollm2-135m-instruct")
    ap.add_argument("--parts", default="30,31", help="corpus parts to read (comma-separated numbers)")
    ap.add_argument("--limit", type=int, default=24, help="conversations")
    ap.add_argument("--max-len", type=int, default=512)
    ap.add_argument("--steps", type=int, default=4, help="chain depth scored")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--factors", default="0.5,0.7,0.85,1.0,1.2,1.5")
    ap.add_argument("--contexts", default="stored",
                    help="stored (whole conversations as in the corpus), or a comma list of greedy and sampled "
                         "(first answers: as stored, or sampled by the target at --temperature)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the sampled answers (and of --candidates' draws)")
    ap.add_argument("--candidates", type=int, default=1,
                    help="also score nodes drafting up to this many candidates (top-k, and sampled without "
                         "replacement under recursive rejection sampling)")
    ap.add_argument("--samples", type=int, default=32, help="draws of the sampled candidates a position")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", help="JSON file for the figures")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    factors = [float(x) for x in args.factors.split(",")]
    exs = examples_of_parts(Path(args.data), [int(x) for x in args.parts.split(",")], args.limit, args.max_len)
    target = load_target(args.target, args.dtype, pack="off")
    contexts = {}  # the same texts for every drafter
    for kind in args.contexts.split(","):
        if kind == "stored":
            contexts[kind] = exs
        elif kind in ("greedy", "sampled"):
            contexts[kind] = [first_answer(ex) for ex in exs]
            if kind == "sampled":
                contexts[kind] = [resampled(target, ex, args.temperature, args.seed + i)
                                  for i, ex in enumerate(contexts[kind])]
        else:
            ap.error(f"--contexts: unknown kind {kind!r} (stored, greedy, sampled)")
    report = {"config": vars(args), "drafters": {}}
    for spec in args.drafter:
        name, _, path = spec.rpartition("=")
        name = name or Path(path).name
        drafter = load_drafter(path, getattr(torch, args.dtype)).eval()
        attach_drafter(target, drafter)  # this drafter's aux layers
        for kind, texts in contexts.items():
            sums = torch.zeros(args.steps, len(factors), dtype=torch.float64)
            counts = torch.zeros(args.steps, dtype=torch.long)
            by_confidence = torch.zeros(len(CONFIDENCE_BINS) - 1, 3, dtype=torch.float64)
            by_input = torch.zeros(2, 2, dtype=torch.float64)
            multi = torch.zeros(2, args.steps, args.candidates, dtype=torch.float64)
            generator = torch.Generator().manual_seed(args.seed)  # the same candidate draws for every drafter
            for ex in texts:
                s, c, b, i, m = overlaps(target, drafter, ex, args.steps, args.temperature, factors,
                                         args.candidates, args.samples, generator)
                sums += s
                counts += c
                by_confidence += b
                by_input += i
                multi += m
            alpha = sums / counts.clamp(min=1).unsqueeze(1)
            taus = [float(1 + sum(torch.cumprod(alpha[:, j], 0))) for j in range(len(factors))]
            key = name if args.contexts == "stored" else f"{name}/{kind}"
            report["drafters"][key] = {"positions": counts.tolist(), "factors": factors,
                                       "acceptance": alpha.tolist(), "expected_tau": taus,
                                       "depth1_by_target_confidence": {
                                           "bins": list(CONFIDENCE_BINS), "positions": by_confidence[:, 1].tolist(),
                                           "acceptance": (by_confidence[:, 0] / by_confidence[:, 1].clamp(min=1)).tolist(),
                                           "target_mass_in_draft_vocab":
                                               (by_confidence[:, 2] / by_confidence[:, 1].clamp(min=1)).tolist()},
                                       "depth1_by_input_token": {
                                           "kinds": ["the target's argmax", "another token"],
                                           "positions": by_input[:, 1].tolist(),
                                           "acceptance": (by_input[:, 0] / by_input[:, 1].clamp(min=1)).tolist()}}
            if args.candidates > 1:
                report["drafters"][key]["candidates"] = multi_report(multi / counts.clamp(min=1).view(1, -1, 1))
            print(f"{key}: {len(texts)} conversations ({kind} text), T={args.temperature}, chain of {args.steps}, "
                  f"positions {counts.tolist()}")
            print("  s     " + "  ".join(f"a{k + 1:<5d}" for k in range(args.steps)) + "  expected tau")
            for j, s in enumerate(factors):
                print(f"  {s:<5.2f} " + "  ".join(f"{float(alpha[k, j]):.3f}" for k in range(args.steps))
                      + f"   {taus[j]:.3f}")
            print(f"  depth 1 at s={factors[0]} by the target's top probability: " + ", ".join(
                f"[{lo:.2f},{min(hi, 1.0):.2f}) {float(b[0] / max(b[1], 1)):.3f} (mass in the draft vocabulary "
                f"{float(b[2] / max(b[1], 1)):.3f}, {int(b[1])} positions)"
                for lo, hi, b in zip(CONFIDENCE_BINS, CONFIDENCE_BINS[1:], by_confidence)))
            print("  depth 1 by the token handed to the drafter: " + ", ".join(
                f"{kind} {float(b[0] / max(b[1], 1)):.3f} ({int(b[1])} positions)"
                for kind, b in zip(("the target's argmax", "another token"), by_input)))
            if args.candidates > 1:
                print_multi(report["drafters"][key]["candidates"], factors[0])
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
