"""generate's measured default shape against fixed chains, fallback on in every engine, methods
alternating per prompt in one process (MT-bench first turns, chat template, T=0).

    python benchmarks/bench_chain_ab.py --drafter checkpoints/smollm2-135m-instruct-eagle3.1 \
        --dtype bfloat16 --threads 1 --limit 20 --chains 2,3 --out runs/chain-ab.json
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_core import DEFAULT_DATA, drafter_parser, load_prompts, warn_if_busy, write_results  # noqa: E402

from anchorspec import load  # noqa: E402
from anchorspec.api import Engine  # noqa: E402
from anchorspec.decode.tree import TreeShape  # noqa: E402


def main() -> None:
    p = drafter_parser(__doc__.split("\n\n")[0])
    p.add_argument("--limit", type=int, default=20)
    p.add_argument("--chains", default="2,3", help="fixed chain depths to compare with the default")
    args = p.parse_args()
    warn_if_busy(args.threads)
    base = load(args.target, args.drafter, args.dtype, threads=args.threads, remember=False)
    engines = {"plain": base, "default": Engine(base.target, base.drafter)}
    for depth in (int(d) for d in args.chains.split(",")):
        engines[f"chain{depth}"] = Engine(base.target, base.drafter, TreeShape.chain(depth))
    rows = {name: [] for name in engines}
    for q in load_prompts(DEFAULT_DATA, args.limit):
        ids = base.encode(q["text"], chat=True)
        for name, engine in engines.items():
            shape = engine.shape if name != "plain" else None
            s = engine.generate(ids, max_new_tokens=args.max_new_tokens, speculative=name != "plain").stats
            rows[name].append({"id": q["id"], "tokens_per_s": s.new_tokens / s.total_s, "tau": s.tau,
                               "shape_depth": shape.depth if shape else None, "switches": s.fallback_switches})
    summary = {}
    for name, r in rows.items():
        ratio = [a["tokens_per_s"] / b["tokens_per_s"] for a, b in zip(r, rows["plain"])]
        summary[name] = {"median_tok_s": statistics.median(x["tokens_per_s"] for x in r),
                         "median_vs_plain": statistics.median(ratio), "mean_vs_plain": statistics.fmean(ratio),
                         "depths": [x["shape_depth"] for x in r]}
        print(f"{name:8s} {summary[name]['median_tok_s']:5.1f} tok/s  vs plain median {summary[name]['median_vs_plain']:.3f}"
              f" mean {summary[name]['mean_vs_plain']:.3f}  depths {summary[name]['depths']}", flush=True)
    write_results(args.out, args, {"summary": summary, "rows": rows})


if __name__ == "__main__":
    main()
