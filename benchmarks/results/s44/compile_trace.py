"""Which step compiles a graph mid-generation under `--compile`: generate's defaults with the release, warmed
up as peers.py warms (a 16-token and a full-length generation), then MT-bench first turns; every step that
grew dynamo's graph count is printed with the shape it drafted, its kind and its verify width.

    python benchmarks/results/s44/compile_trace.py --limit 10"""
import argparse, sys
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # benchmarks/
from bench_core import DEFAULT_DATA, load_prompts  # noqa: E402
from anchorspec import load  # noqa: E402
from anchorspec.decode.fallback import StreamMonitor, shape_key  # noqa: E402
from anchorspec.models.compiled import graphs_compiled  # noqa: E402
import anchorspec.decode.engine as engine_module  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--limit", type=int, default=10)
args = ap.parse_args()
where, seen = {"phase": "warm-up", "prompt": -1}, [graphs_compiled()]
step = engine_module.SpeculativeDecoding.step


def traced(self, speculate=True, shape=None):
    report = step(self, speculate, shape)
    now = graphs_compiled()
    if now != seen[0]:
        drafted = shape or self.shape
        print(f"{where['phase']} prompt {where['prompt']}: +{now - seen[0]} graph(s) at a {report.kind} step "
              f"(drafted {shape_key(drafted) if drafted else None}{' explored' if shape else ''}, "
              f"{report.drafted + 1} tokens verified, depth {report.depth})", flush=True)
        seen[0] = now
    return report


engine_module.SpeculativeDecoding.step = traced
e = load("smollm2-135m-instruct", "checkpoints/smollm2-135m-instruct-eagle3.1", dtype="auto", threads=2, compile=True,
         remember=False)
prompts = load_prompts(DEFAULT_DATA, args.limit)
encoded = [e.encode(p["text"], chat=True) for p in prompts]
for kwargs in ({"speculative": False}, {}):
    e.generate(encoded[0], max_new_tokens=16, **kwargs)
    e.generate(encoded[-1], max_new_tokens=128, **kwargs)
where["phase"] = "timed"
for i, ids in enumerate(encoded):
    where["prompt"] = i
    e.generate(ids, max_new_tokens=128)
print(f"done: {graphs_compiled()} graphs in all")
