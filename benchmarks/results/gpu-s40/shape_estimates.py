"""Session 40's diagnostic of the default shape choice: one Engine (generate's defaults, bf16, 2 threads) answers
MT-bench first turns in order and prints, after each, the shape it drafted, its tau, and the monitor's
expected tau / relative step cost / speedup for chains 1-7 and the 4,4,16 tree, then the learned costs.

    python benchmarks/results/gpu-s40/shape_estimates.py DRAFTER_DIR N_PROMPTS EVERY
"""
import sys
import time
from pathlib import Path

import torch

BENCHMARKS = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(BENCHMARKS))

from anchorspec.api import load  # noqa: E402
from anchorspec.decode.fallback import TREE_CANDIDATES, shape_key  # noqa: E402
from anchorspec.decode.tree import TreeShape  # noqa: E402
from bench_core import load_prompts  # noqa: E402

MTBENCH = BENCHMARKS.parents[1] / "shared" / "data" / "mt_bench" / "question.jsonl"
CANDIDATES = [TreeShape.chain(d) for d in range(1, 8)] + list(TREE_CANDIDATES)


def estimates(monitor) -> str:
    """expected tau / relative step cost / expected speedup of every candidate shape."""
    return " ".join(f"{'c%d' % s.depth if s.is_chain else 'tree'}:{monitor.expected_shape_tau(s):.2f}/"
                    f"{monitor.relative_step_cost(s) or 0:.2f}/{monitor.speedup(s) or 0:.2f}" for s in CANDIDATES)


def main() -> None:
    drafter, limit, every = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    torch.set_num_threads(2)
    engine = load("smollm2-135m-instruct", drafter, "auto", threads=2)
    for i, row in enumerate(load_prompts(str(MTBENCH), limit, every=every)):
        drafted = engine.shape  # what generate is about to choose itself (the same costs, the same rule)
        t = time.perf_counter()
        stats = engine.generate(row["text"], chat=True, max_new_tokens=128).stats
        seconds = time.perf_counter() - t
        m = engine.monitor
        print(f"p{i} shape={shape_key(drafted)} tau={stats.tau:.2f} tok/s={stats.new_tokens / seconds:.1f} "
              f"depth={m.measured_depth()} | {estimates(m)}", flush=True)
    print("acc", [round(m.acceptance(d), 3) for d in range(1, 8)], "reached", m.reached, "trees", m.trees,
          "tree_draft", m.tree_draft)
    print("draft", m.draft.points, "verify", m.verify.points)


if __name__ == "__main__":
    main()
