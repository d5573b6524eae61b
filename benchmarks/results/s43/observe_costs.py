"""Every step cost a stream's monitor learns (StreamMonitor.observe_step), logged: generate's defaults with
the release on 8 MT-bench first turns (bf16, 2 threads), then the median verify and draft time per shape,
steps of the stream's own shape against steps exploring drafted. Writes /tmp/observe_log.json."""
import statistics, sys, json
sys.path.insert(0, "benchmarks")
from bench_core import DEFAULT_DATA, load_prompts
from anchorspec.api import load
from anchorspec.decode.fallback import StreamMonitor, shape_key
log = []
orig = StreamMonitor.observe_step
def rec(self, kind, tokens, depth, accepted, step_s, draft_s, catch_up=False, top_ranked=None, top_depth=None, shape=None,
        lookup_accepted=0):
    log.append(dict(kind=kind, tokens=tokens, depth=depth, step_s=step_s, draft_s=draft_s, catch_up=catch_up,
                    shape=shape_key(shape) if shape is not None else None, current=shape_key(self.shape) if self.shape else None))
    return orig(self, kind, tokens, depth, accepted, step_s, draft_s, catch_up, top_ranked, top_depth, shape, lookup_accepted)
StreamMonitor.observe_step = rec
e = load("smollm2-135m-instruct", "checkpoints/smollm2-135m-instruct-eagle3.1", dtype="bfloat16", threads=2, remember=False)
for p in load_prompts(DEFAULT_DATA, 40, every=5)[:8]:
    e.generate(p["text"], max_new_tokens=128)
    print(e.shape, file=sys.stderr)
json.dump(log, open("/tmp/observe_log.json", "w"))
from collections import defaultdict
g = defaultdict(list)
for r in log:
    if r["kind"] == "speculative" and not r["catch_up"]:
        g[(r["shape"], r["shape"] != r["current"], r["tokens"])].append((r["step_s"] - r["draft_s"], r["draft_s"]))
for k in sorted(g, key=str):
    v = g[k]; print(k, len(v), "verify %.1f draft %.1f ms" % (statistics.median(a for a, b in v) * 1e3, statistics.median(b for a, b in v) * 1e3))
