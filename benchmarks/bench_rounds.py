"""What a server round costs, speculative against plain, at each batch size, and what the break-even
model sees of it.

    python benchmarks/bench_rounds.py --drafter checkpoints/smollm2-135m-instruct-eagle3.1 \
        [--batches 1,4,16] [--rounds 12] [--dtype auto] [--threads 1] [--chain 3] [--out FILE.json]

For each batch size B: B MT-bench first turns (chat template) are prefilled into the server's shared
slot cache (`BatchDecoder`, exactly the rounds `anchorspec serve` runs), then rounds alternate in
blocks: all B rows speculating (the drafter's chain), then all B rows plain, then B rows of a plain
server (PlainDecoding: no drafter state kept). Each round's wall time is
split into drafting (the lockstep drafter passes), the batched target forward, and the rest
(per-sequence `draft()` set-up, verification, commits, bookkeeping). Printed per B, medians over the
rounds:
  - seconds per round of each kind, split three ways, and tokens per round (B x tau when speculating);
  - tau*: the break-even accepted length, as the server's drift monitor models it (drafting + forward
    only: decode/fallback.py) and as the whole round costs it;
  - tokens/s of each kind and their ratio, the speedup a server at B users would see in steady decoding;
  - what a drafter server's plain steps cost against the plain server's (the price of keeping the
    features the drafter will need when speculation resumes).
CPU model, flags, torch version, threads and dtype are printed with the numbers.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_core import DEFAULT_DATA, environment, load_prompts, model_parser, warn_if_busy  # noqa: E402

from anchorspec.api import load  # noqa: E402
from anchorspec.decode.engine import GenerationConfig, PlainDecoding, SpeculativeDecoding  # noqa: E402
from anchorspec.decode.propose import EagleProposer  # noqa: E402
from anchorspec.decode.round import BatchDecoder  # noqa: E402
from anchorspec.decode.tree import TreeShape  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = model_parser(__doc__.split("\n\n")[0])
    p.add_argument("--data", default=DEFAULT_DATA)
    p.add_argument("--batches", default="1,4,16", help="batch sizes, comma-separated")
    p.add_argument("--rounds", type=int, default=12, help="timed rounds of each kind per batch size")
    p.add_argument("--block", type=int, default=3, help="rounds of one kind before switching to the next")
    p.add_argument("--chain", type=int, default=3, help="draft chain length (the shape `serve` measured here)")
    p.add_argument("--out", default=None, help="also write the figures as JSON here")
    return p.parse_args(argv)


def run_rounds(decoder: BatchDecoder, decodings: list, speculate: bool | None, n: int) -> list[dict]:
    """`speculate` None: the decodings are PlainDecodings (the plain server's rows)."""
    rows = []
    for _ in range(n):
        t = time.perf_counter()
        result = decoder.round([(d, speculate) for d in decodings])
        wall = time.perf_counter() - t
        bad = [r for r in result.reports if isinstance(r, Exception)]
        if bad:
            raise bad[0]
        tokens = sum(len(r.tokens) for r in result.reports)
        rows.append({"wall_s": wall, "draft_s": result.draft_s, "forward_s": result.forward_s,
                     "rest_s": wall - result.draft_s - result.forward_s, "tokens": tokens,
                     "width": result.width, "rows": result.rows, "compiled": result.compiled})
    return rows


def measure_batch(engine, encoded: list[list[int]], b: int, args) -> dict:
    shape = TreeShape.chain(args.chain)
    cfg = GenerationConfig(max_new_tokens=4 * args.rounds * (args.chain + 1) + 64,
                           stop_token_ids=())  # no stop token: every row runs every round
    decoder = BatchDecoder(engine.target)
    # one set of rows per kind: the plain kinds then advance alike (one token a round), so their
    # rows attend over the same lengths; the speculative rows grow faster (a slight bias against them)
    drafting = [[SpeculativeDecoding(engine.target, EagleProposer(engine.drafter), encoded[i % len(encoded)], cfg,
                                     shape) for i in range(b)] for _ in range(2)]
    plains = [PlainDecoding(engine.target, encoded[i % len(encoded)], cfg) for i in range(b)]
    kinds = [(drafting[0], True), (drafting[1], False), (plains, None)]
    for rows, speculate in kinds:
        decoder.round([(d, speculate) for d in rows])  # prefills
        run_rounds(decoder, rows, speculate, 2)  # warm-up
    spec, plain, server = [], [], []
    while len(spec) < args.rounds:
        for (rows, speculate), out in zip(kinds, (spec, plain, server)):
            out += run_rounds(decoder, rows, speculate, args.block)
    for d in drafting[0] + drafting[1] + plains:
        decoder.release(d)
    med = lambda rows, key: statistics.median(r[key] for r in rows)  # noqa: E731
    out = {"batch": b}
    for name, rows in (("speculative", spec), ("plain", plain), ("plain_server", server)):
        out[name] = {k: med(rows, k) for k in ("wall_s", "draft_s", "forward_s", "rest_s", "tokens")}
        out[name]["tokens_per_s"] = sum(r["tokens"] for r in rows) / sum(r["wall_s"] for r in rows)
        out[name]["compiled_rounds"] = sum(r["compiled"] for r in rows)
    s, p = out["speculative"], out["plain"]
    out["tau"] = sum(r["tokens"] for r in spec) / (b * len(spec))
    out["break_even_modelled"] = (s["draft_s"] + s["forward_s"]) / p["forward_s"]  # what DriftMonitor prices
    out["break_even_whole_round"] = s["wall_s"] / p["wall_s"]
    out["speedup"] = s["tokens_per_s"] / p["tokens_per_s"]
    out["plain_steps_vs_plain_server"] = p["tokens_per_s"] / out["plain_server"]["tokens_per_s"]
    return out


def main(argv=None) -> None:
    args = parse_args(argv)
    warn_if_busy(args.threads)
    engine = load(args.target, args.drafter, args.dtype, threads=args.threads, fallback=False, remember=False)
    prompts = load_prompts(args.data, 80)
    encoded = [engine.encode(p["text"], chat=True) for p in prompts]
    env = environment(args)
    print(json.dumps(env))
    print(f"dtype {engine.target.dtype}, chain {args.chain}, {args.rounds} rounds of each kind per batch size")
    results = []
    for b in [int(x) for x in args.batches.split(",")]:
        r = measure_batch(engine, encoded, b, args)
        results.append(r)
        s, p = r["speculative"], r["plain"]
        print(f"B={b:3d}  spec round {1e3 * s['wall_s']:7.1f} ms (draft {1e3 * s['draft_s']:6.1f}, forward "
              f"{1e3 * s['forward_s']:6.1f}, rest {1e3 * s['rest_s']:6.1f}) | plain round {1e3 * p['wall_s']:6.1f} ms "
              f"(forward {1e3 * p['forward_s']:6.1f}, rest {1e3 * p['rest_s']:5.1f}) | tau {r['tau']:.2f}  "
              f"tau* modelled {r['break_even_modelled']:.2f}, whole round {r['break_even_whole_round']:.2f} | "
              f"{s['tokens_per_s']:.1f} vs {p['tokens_per_s']:.1f} tok/s = {r['speedup']:.2f}x | plain server's round "
              f"{1e3 * r['plain_server']['wall_s']:6.1f} ms: plain steps of a drafter server at "
              f"{r['plain_steps_vs_plain_server']:.2f}x its speed")
    if args.out:
        path = Path(args.out)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"environment": env, "dtype": str(engine.target.dtype), "chain": args.chain,
                                    "results": results}, indent=1) + "\n")
        print(f"wrote {path}")


if __name__ == "__main__":
    torch.manual_seed(0)
    main()
