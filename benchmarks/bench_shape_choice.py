"""How stable is the shape `generate` picks without a tuned profile? Cold: a fresh calibration per
engine (what a first run does). Remembered: the costs and acceptance kept from earlier runs
(`$ANCHORSPEC_HOME/costs`), after N generations on MT-bench first turns.

    python benchmarks/bench_shape_choice.py --drafter checkpoints/smollm2-135m-instruct-eagle3.1 \
        --dtype bfloat16 --threads 1 --cold 5 --warm-prompts 20 --out runs/shape-choice.json

Prints each choice with its expected speedup, and the verify costs per size each one saw.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_core import DEFAULT_DATA, drafter_parser, load_prompts, warn_if_busy, write_results  # noqa: E402

from anchorspec import load  # noqa: E402
from anchorspec.api import Engine  # noqa: E402


def costs_ms(engine: Engine) -> dict:
    m = engine.monitor
    return {"verify": {int(x): round(y * 1e3, 2) for x, y in sorted(m.verify.points.values())},
            "draft": {int(x): round(y * 1e3, 2) for x, y in sorted(m.draft.points.values())}}


def main() -> None:
    p = drafter_parser(__doc__.split("\n\n")[0])
    p.add_argument("--cold", type=int, default=5, help="fresh calibrations")
    p.add_argument("--warm-prompts", type=int, default=20, help="generations whose costs are then remembered")
    args = p.parse_args()
    warn_if_busy(args.threads)
    engine = load(args.target, args.drafter, args.dtype, threads=args.threads, remember=False)
    rows = []
    for i in range(args.cold):
        cold = Engine(engine.target, engine.drafter)
        t0 = time.perf_counter()
        shape = cold.shape
        rows.append({"kind": "cold", "shape": [shape.top_k, shape.depth, shape.total_tokens],
                     "source": cold.shape_source, "calibration_s": round(time.perf_counter() - t0, 2), **costs_ms(cold)})
        print(f"cold {i}: chain {shape.depth} ({cold.shape_source}), {rows[-1]['calibration_s']} s", flush=True)
    with tempfile.TemporaryDirectory() as home:
        file = Path(home) / "costs.json"
        warm = Engine(engine.target, engine.drafter, costs_file=file)
        prompts = load_prompts(DEFAULT_DATA, args.warm_prompts)
        for q in prompts:
            warm.generate(warm.encode(q["text"], chat=True), max_new_tokens=args.max_new_tokens)
        for i in range(args.cold):  # as many later processes would: each reads the file afresh
            again = Engine(engine.target, engine.drafter, costs_file=file)
            shape = again.shape
            rows.append({"kind": "remembered", "shape": [shape.top_k, shape.depth, shape.total_tokens],
                         "source": again.shape_source, **costs_ms(again),
                         "acceptance": [round(again.monitor.acceptance(d), 3) for d in range(1, 6)]})
            print(f"remembered {i}: chain {shape.depth} ({again.shape_source})", flush=True)
            again.generate(again.encode(prompts[i % len(prompts)]["text"], chat=True), max_new_tokens=args.max_new_tokens)
    write_results(args.out, args, {"dtype": args.dtype, "rows": rows})


if __name__ == "__main__":
    main()
