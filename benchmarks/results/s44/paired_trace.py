"""Every step's timing under a fixed drafting pattern, for judging cost estimators offline: the stream
drafts CURRENT, and every EXPLORE_EVERY-th step OTHER (as exploring would), on MT-bench first turns with
the release (generate's defaults otherwise: bf16, 2 threads). Two patterns per run: the tree explored
from chain 4, and chain 4 explored from the tree. Writes a JSON list of steps.

    python benchmarks/results/s44/paired_trace.py --limit 40 --out FILE.json"""
import argparse, json, sys, time
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # benchmarks/
from bench_core import DEFAULT_DATA, load_prompts  # noqa: E402
from anchorspec.api import load  # noqa: E402
from anchorspec.decode.fallback import StreamMonitor, shape_key  # noqa: E402
from anchorspec.decode.tree import TreeShape  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--limit", type=int, default=40)
ap.add_argument("--every", type=int, default=2)
ap.add_argument("--offset", type=int, default=0)
ap.add_argument("--out", required=True)
args = ap.parse_args()

TREE, CHAIN = TreeShape(4, 4, 16), TreeShape.chain(4)
log, where = [], {}
observe = StreamMonitor.observe_step


def logged(self, kind, tokens, depth, accepted, step_s, draft_s, catch_up=False, top_ranked=None, top_depth=None,
           shape=None, lookup_accepted=0):
    log.append(dict(t=time.perf_counter(), kind=kind, tokens=tokens, depth=depth, step_s=step_s, draft_s=draft_s,
                    catch_up=catch_up, shape=shape_key(shape) if shape is not None else None, **where))
    return observe(self, kind, tokens, depth, accepted, step_s, draft_s, catch_up, top_ranked, top_depth, shape, lookup_accepted)


StreamMonitor.observe_step = logged
engines = {}
for name, current, other in (("chain-explores-tree", CHAIN, TREE), ("tree-explores-chain", TREE, CHAIN)):
    e = load("smollm2-135m-instruct", "checkpoints/smollm2-135m-instruct-eagle3.1", dtype="bfloat16", threads=2,
             remember=False)
    m = e.monitor
    m.choose_shape = lambda *a, _fixed=current, **k: (_fixed, 2.0)
    m._least_recent_plausible = lambda *a, _other=other, **k: _other
    m.fixed_threshold = 0.5  # never switches to plain steps: every step is a sample
    engines[name] = e
prompts = load_prompts(DEFAULT_DATA, args.limit, every=args.every, offset=args.offset)
for i, p in enumerate(prompts):
    for name, e in engines.items():  # rotated per prompt: both patterns see the same host drift
        where.update(pattern=name, prompt=i)
        e.generate(p["text"], chat=True, max_new_tokens=128)
    print(f"prompt {i + 1}/{len(prompts)}: {len(log)} steps", file=sys.stderr, flush=True)
json.dump(log, open(args.out, "w"))
