"""Session 40's diagnostic of the default shape choice: one Engine (generate's defaults, bf16, 2 threads) answers
MT-bench first turns in order and prints, after each, the shape it drafted, its tau, and the monitor's
expected tau / relative step cost / speedup for chains 1-7 and the 4,4,16 tree, then the learned costs.

    python benchmarks/results/gpu-s40/shape_estimates.py DRAFTER_DIR N_PROMPTS EVERY
"""
import sys, time, json, statistics
sys.path.insert(0, str(__import__('pathlib').Path(__file__).resolve().parents[2]))
import torch
from anchorspec.api import load
from anchorspec.decode.tree import TreeShape
from anchorspec.decode.fallback import TREE_CANDIDATES
from bench_core import load_prompts
torch.set_num_threads(2)
prompts = [r['text'] for r in load_prompts(str(__import__('pathlib').Path(__file__).resolve().parents[4] / 'shared' / 'data' / 'mt_bench' / 'question.jsonl'), int(sys.argv[2]), every=int(sys.argv[3]))]
eng = load('smollm2-135m-instruct', sys.argv[1], 'auto', threads=2)
m = None
for i, pr in enumerate(prompts):
    t = time.perf_counter()
    res = eng.generate(pr, chat=True, max_new_tokens=128)
    dt = time.perf_counter() - t
    m = eng.monitor
    st = res.stats if hasattr(res, 'stats') else res
    cands = [TreeShape.chain(d) for d in range(1, 8)] + list(TREE_CANDIDATES)
    est = " ".join(f"{'c%d' % s.depth if s.is_chain else 'tree'}:{m.expected_shape_tau(s):.2f}/{(m.relative_step_cost(s) or 0):.2f}/{(m.speedup(s) or 0):.2f}" for s in cands)
    print(f"p{i} shape={eng._shape.top_k},{eng._shape.depth},{eng._shape.total_tokens} tau={st.tau:.2f} tok/s={st.new_tokens/dt if hasattr(st,'new_tokens') else 0:.1f} depth={m.measured_depth()} | {est}", flush=True)
print("acc", [round(m.acceptance(d), 3) for d in range(1, 8)], "reached", m.reached, "trees", m.trees, "tree_draft", m.tree_draft)
print("draft", m.draft.points, "verify", m.verify.points)
