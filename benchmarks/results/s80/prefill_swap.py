"""Session 80: two identical plain engines (A, B), each prefilling 10 MT-bench first turns both eagerly (limit 0) and
through the step graph (1024), order reversed every other prompt: whether the steps after a graph prefill are faster
(they are not: the per-step spread is between engines), and what the prefill saves. bf16, 2 threads, 128 tokens."""
import time, statistics as st, json
import anchorspec.decode.batch as bm
from anchorspec import load
def eng():
    e = load("smollm2-135m-instruct", None, dtype="auto", threads=2, compile=True, remember=False); e.warm_up(); return e
E = {"A": eng(), "B": eng()}
qs = [json.loads(l)["turns"][0] for l in open("../shared/data/mt_bench/question.jsonl")][:30:3]
res = {}
for i, q in enumerate(qs):
    ids = E["A"].encode(q, chat=True)
    order = [("A", 0), ("B", 1024), ("A", 1024), ("B", 0)]
    if i % 2: order = order[::-1]
    for name, lim in order:
        bm.GRAPH_PREFILL_TOKENS = lim
        t = time.perf_counter(); out = E[name].generate(ids, max_new_tokens=128, speculative=False); tot = time.perf_counter() - t
        n = len(out.token_ids)
        res.setdefault((name, lim), []).append(((tot - out.stats.prefill_s) / (n - 1) * 1e3, out.stats.prefill_s * 1e3, n / tot))
for k, v in sorted(res.items()):
    print(k, "step %.2f ms  prefill %.1f ms  tok/s %.1f" % (st.median(x[0] for x in v), st.median(x[1] for x in v), st.median(x[2] for x in v)))
