"""Session 80: prefill (plus one plain step) of the first N tokens of a long essay, eager against the step graph
(run on a patched decode/batch.py; this form sets GRAPH_PREFILL_TOKENS instead, to the same effect).
bf16, 2 threads; the median of 5 after one warm-up."""
import os, sys, time, json, torch
import anchorspec.decode.batch as bm
from anchorspec import load
from anchorspec.decode.engine import GenerationConfig
e = load("smollm2-135m-instruct", None, dtype="auto", threads=2, compile=True, remember=False)
e.warm_up()
text = open("../shared/data/long_context/paul_graham_essays/" + sorted(os.listdir("../shared/data/long_context/paul_graham_essays"))[0]).read()
base = e.tokenizer(text)["input_ids"]
res = {}
for n in [int(x) for x in sys.argv[1].split(",")]:
    ids = base[:n]
    for mode in ("eager", "graph"):
        bm.GRAPH_PREFILL_TOKENS = 0 if mode == "eager" else 100000
        ts = []
        for r in range(6):
            t = time.perf_counter(); out = e.generate(ids, max_new_tokens=2, speculative=False); ts.append(time.perf_counter() - t)
        res[(n, mode)] = (sorted(ts[1:])[2], out.token_ids)
    print(n, "eager %.1f ms  graph %.1f ms  same=%s" % (res[(n,'eager')][0]*1e3, res[(n,'graph')][0]*1e3, res[(n,'eager')][1]==res[(n,'graph')][1]), flush=True)
