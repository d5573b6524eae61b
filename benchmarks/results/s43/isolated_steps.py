"""Does a step of one shape cost more when it follows steps of another shape (as every step that
StreamMonitor.explore drafts does) than inside a run of its own shape? Steps of the release (round 18)
on MT-bench first turns, bf16, 2 threads: schedule A drafts chain 4 with the 4,4,16 tree every 8th step,
schedule B the tree with chain 4 every 8th step. Prints the median draft and verify seconds of each
shape, isolated against in a run; the same steps, the same process.

    python benchmarks/results/s43/isolated_steps.py --prompts 6 --out FILE.json"""
import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bench_core import DEFAULT_DATA, load_prompts  # noqa: E402

from anchorspec.api import load  # noqa: E402
from anchorspec.decode.engine import GenerationConfig, SpeculativeDecoding  # noqa: E402
from anchorspec.decode.tree import TreeShape  # noqa: E402

CHAIN, TREE = TreeShape.chain(4), TreeShape(4, 4, 16)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--prompts", type=int, default=6)
    p.add_argument("--every", type=int, default=8)
    p.add_argument("--new", type=int, default=192)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    engine = load("smollm2-135m-instruct", "checkpoints/smollm2-135m-instruct-eagle3.1", dtype="bfloat16",
                  threads=2, remember=False)
    rows = []
    prompts = load_prompts(DEFAULT_DATA, args.prompts * 5, every=5)[: args.prompts]
    for rep in range(2):  # the first pass warms every shape up
        for prompt in prompts:
            ids = engine.encode(prompt["text"], chat=True)
            for schedule, (base, other) in (("A", (CHAIN, TREE)), ("B", (TREE, CHAIN))):
                seq = SpeculativeDecoding(engine.target, engine.proposer, ids, GenerationConfig(max_new_tokens=args.new), base)
                seq.step()  # prefill
                i = 0
                while not seq.finished:
                    i += 1
                    shape = other if i % args.every == 0 else base
                    t = time.perf_counter()
                    r = seq.step(True, shape)
                    step_s = time.perf_counter() - t
                    if rep and r.kind == "speculative" and r.depth == shape.depth and i > 1:
                        rows.append({"schedule": schedule, "shape": "tree" if shape == TREE else "chain4",
                                     "isolated": shape == other, "step_s": step_s, "draft_s": r.draft_s,
                                     "verify_s": r.verify_s})
    summary = {}
    for shape in ("tree", "chain4"):
        for isolated in (False, True):
            sel = [r for r in rows if r["shape"] == shape and r["isolated"] == isolated]
            key = f"{shape} {'isolated' if isolated else 'in a run'}"
            summary[key] = {k: statistics.median(r[k] for r in sel) * 1e3 for k in ("step_s", "draft_s", "verify_s")}
            summary[key]["steps"] = len(sel)
            print(f"{key:18s} steps {len(sel):4d}  " + "  ".join(f"{k} {v:.1f} ms" for k, v in summary[key].items() if k != "steps"))
    Path(args.out).write_text(json.dumps({"threads": torch.get_num_threads(), "dtype": "bfloat16",
                                          "summary": summary, "steps": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
