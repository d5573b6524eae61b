"""Where a default speculative step's time goes (cProfile, cumulative), bf16 compiled, 2 threads."""
import cProfile, pstats, json, sys, time, torch
from anchorspec import load
eng = load("smollm2-135m-instruct", drafter="checkpoints/smollm2-135m-instruct-eagle3.1", threads=2, compile=True)
qs = [json.loads(l)["turns"][0] for l in open("../shared/data/mt_bench/question.jsonl")][10:18]
eng.generate(qs[0], chat=True, max_new_tokens=32)
t = time.perf_counter(); n = 0
pr = cProfile.Profile(); pr.enable()
for q in qs:
    r = eng.generate(q, chat=True, max_new_tokens=128)
    n += len(r.token_ids) if hasattr(r, "token_ids") else 0
pr.disable()
print("wall", time.perf_counter() - t, "tokens", n, file=sys.stderr)
st = pstats.Stats(pr); st.sort_stats("tottime").print_stats(25)
st.sort_stats("cumulative").print_stats(40)
st.sort_stats("cumulative").print_callees("drafting.py:156")
st.print_callees("drafter.py:507")
st.print_callees("drafting.py:98")
st.print_callees("engine.py:288")
