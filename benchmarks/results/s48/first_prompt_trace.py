"""Why a fresh engine's first prompt can run below plain (session 48): each step of `generate`'s defaults on
one MT-bench prompt, from a fresh monitor (calibrated here, nothing remembered), with the monitor's break-even
(tau*) and the costs it was priced on. Prints the switches and the plain/speculative step counts per trial.

    python benchmarks/results/s48/first_prompt_trace.py [TRIALS] [PROMPT_INDEX]"""
import json
import sys
import time
from pathlib import Path

from anchorspec.api import load
from anchorspec.decode.fallback import StreamMonitor

trials = int(sys.argv[1]) if len(sys.argv) > 1 else 3
index = int(sys.argv[2]) if len(sys.argv) > 2 else 0
rows = [json.loads(line) for line in (Path(__file__).resolve().parents[4] / "shared/data/mt_bench/question.jsonl").open()]
text = rows[index]["turns"][0]
plain = load("smollm2-135m-instruct", threads=2, compile=True, remember=False)
ids = plain.encode(text, chat=True)
for trial in range(trials):
    eng = load("smollm2-135m-instruct", "checkpoints/smollm2-135m-instruct-eagle3.1", threads=2, compile=True,
               remember=False)
    m: StreamMonitor = eng.monitor
    log = []
    orig_observe, orig_record = m.observe_step, m.record

    def observe(kind, tokens, depth, accepted, step_s, draft_s, **kw):
        log.append([kind, tokens, accepted, round(step_s * 1e3, 1), kw.get("shape")])
        return orig_observe(kind, tokens, depth, accepted, step_s, draft_s, **kw)

    def record(state, kind, accepted=0, tokens=1):
        out = orig_record(state, kind, accepted, tokens)
        if out:
            log.append([f"SWITCH {out}", round(m.threshold_at() or 0, 2), state.rolling_tau(), state.upper_tau(1)])
        return out

    m.observe_step, m.record = observe, record
    shape = eng.shape
    print(f"trial {trial}: shape {shape} ({eng.shape_source}); calibrated plain {m.verify(1)*1e3:.1f} ms, "
          f"verify(4) {m.verify(4)*1e3:.1f}, verify(5) {m.verify(5)*1e3:.1f}, tau* {m.relative_step_cost(shape):.2f}", flush=True)
    t0 = time.perf_counter(); p = plain.generate(ids, max_new_tokens=128); tp = time.perf_counter() - t0
    t0 = time.perf_counter(); res = eng.generate(ids, max_new_tokens=128); ts = time.perf_counter() - t0
    kinds = [r[0] for r in log]
    print(f"  plain {len(p.token_ids)/tp:.1f} tok/s, default {len(res.token_ids)/ts:.1f} tok/s; tau {res.stats.tau:.2f}; "
          f"steps: {kinds.count('speculative')} speculative, {kinds.count('plain')} plain; "
          f"switches {res.stats.fallback_switches}; explored {res.stats.explored_steps}")
    for r in log:
        if str(r[0]).startswith("SWITCH"):
            print("   ", r)
    print(f"  after: plain {m.verify(1)*1e3:.1f} ms, verify(4) {m.verify(4)*1e3:.1f}, tau* {m.threshold_at():.2f}, "
          f"acceptance {[round(m.acceptance(d), 2) for d in range(1, 5)]}", flush=True)
