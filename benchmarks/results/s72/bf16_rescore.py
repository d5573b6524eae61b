"""How often do one-token steps and a many-token forward pick different greedy tokens in bf16,
with the argmax of bf16 logits vs of fp32 logits re-scored from the same bf16 hidden state?"""
import json, sys, torch
from anchorspec import load
from anchorspec.data.readers import read_prompts
torch.set_num_threads(2)
eng = load("smollm2-135m-instruct", dtype="bfloat16", threads=2, compile=False, pack="off")
m = eng.target.model
W = m.get_input_embeddings().weight.detach().float()  # tied head
store = []
m.model.norm.register_forward_hook(lambda mod, i, o: store.append(o.detach()))
prompts = read_prompts("anchorspec/data/demo_prompts.jsonl")[:5] + [json.loads(l)["turns"][0] for l in open("../shared/data/mt_bench/question.jsonl")][:10]
n = flips_bf16 = flips_fp32 = ties_bf16 = 0
gaps = []
for p in prompts:
    ids = eng.encode(p, chat=True)
    toks = eng.generate(p, chat=True, max_new_tokens=64, speculative=False).token_ids
    seq = torch.tensor([ids + toks])
    with torch.inference_mode():
        store.clear(); out = m(seq); h_full = store[-1][0, len(ids) - 1:-1]; l_full = out.logits[0, len(ids) - 1:-1]
        store.clear(); o = m(seq[:, :len(ids)], use_cache=True); pkv = o.past_key_values
        h_inc = [store[-1][0, -1]]; l_inc = [o.logits[0, -1]]
        for t in range(len(toks) - 1):
            store.clear(); o = m(seq[:, len(ids) + t:len(ids) + t + 1], past_key_values=pkv, use_cache=True)
            pkv = o.past_key_values; h_inc.append(store[-1][0, -1]); l_inc.append(o.logits[0, -1])
    h_inc, l_inc = torch.stack(h_inc), torch.stack(l_inc)
    a_bf = l_full.float().argmax(-1) != l_inc.float().argmax(-1)
    r_full, r_inc = h_full.float() @ W.T, h_inc.float() @ W.T
    a_fp = r_full.argmax(-1) != r_inc.argmax(-1)
    top = l_inc.float().topk(2, -1).values
    ties_bf16 += int((top[:, 0] == top[:, 1]).sum())
    rt = r_inc.topk(2, -1).values; gaps += (rt[:, 0] - rt[:, 1]).tolist()
    n += len(toks); flips_bf16 += int(a_bf.sum()); flips_fp32 += int(a_fp.sum())
    print(len(toks), int(a_bf.sum()), int(a_fp.sum()), float((r_full - r_inc).abs().max()), flush=True)
g = torch.tensor(gaps)
print(f"positions {n}: argmax differs between 1-token steps and one full forward: bf16 logits {flips_bf16}, fp32 re-scored {flips_fp32}; exact bf16 top-2 ties {ties_bf16}; fp32 gap < 0.01: {int((g < 0.01).sum())}, < 0.03: {int((g < 0.03).sum())}")
