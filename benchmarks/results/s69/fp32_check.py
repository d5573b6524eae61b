"""float32: generate's defaults (lookup on) against the plain loop, token for token, on MT-bench first turns."""
import sys, torch
sys.path.insert(0, str(__import__('pathlib').Path(__file__).resolve().parents[2]))
from bench_core import DEFAULT_DATA, load_prompts
from anchorspec.api import load
n = int(sys.argv[1]); torch.set_num_threads(int(sys.argv[2]))
spec = load("smollm2-135m-instruct", "checkpoints/smollm2-135m-instruct-eagle3.1", dtype="float32", remember=False)
plain = load("smollm2-135m-instruct", dtype="float32", remember=False)
same = 0; won = rows = 0; taus = []
for i, q in enumerate(load_prompts(DEFAULT_DATA, n, 8)):
    ids = spec.encode(q["text"], chat=True)
    a = spec.generate(ids, max_new_tokens=128, shape=None)
    b = plain.generate(ids, max_new_tokens=128, speculative=False)
    same += a.token_ids == b.token_ids; won += a.stats.lookup_tokens; rows += a.stats.lookup_rows; taus.append(a.stats.tau)
    print(i, a.token_ids == b.token_ids, round(a.stats.tau, 2), a.stats.lookup_tokens, a.stats.lookup_rows, flush=True)
print(f"float32, {torch.get_num_threads()} thread(s): {same}/{n} outputs equal the plain loop's; lookup won {won} tokens for {rows} rows; mean tau {sum(taus)/len(taus):.2f}")
