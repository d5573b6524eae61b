import torch, sys
from anchorspec import load
from anchorspec.data.readers import read_prompts
eng = load("smollm2-135m-instruct", drafter="checkpoints/smollm2-135m-instruct-eagle3.1", dtype="bfloat16", threads=2, compile=(sys.argv[1] == "on"))
prompts = read_prompts("anchorspec/data/demo_prompts.jsonl")[:5]
m = eng.target.model
tot = ties = near = 0; first = []
for p in prompts:
    ids = eng.encode(p, chat=True)
    plain = eng.generate(p, chat=True, max_new_tokens=64, speculative=False)
    spec = eng.generate(p, chat=True, max_new_tokens=64)
    full = torch.tensor([ids + plain.token_ids])
    with torch.inference_mode():
        lg = m(full).logits[0, len(ids) - 1:-1]
    print("logits dtype", lg.dtype, file=sys.stderr) if tot == 0 else None
    top = lg.float().topk(2, dim=-1).values
    gap = top[:, 0] - top[:, 1]
    tot += gap.numel(); ties += int((gap == 0).sum()); near += int((gap < 0.07).sum())
    d = next((i for i, (a, b) in enumerate(zip(plain.token_ids, spec.token_ids)) if a != b), None)
    first.append((d, None if d is None else round(float(gap[d]), 4), None if d is None else round(float(top[d, 0]), 3)))
print(f"positions {tot}, exact bf16 top-2 ties {ties}, gap < 0.07: {near}; first divergence (pos, gap there, top logit): {first}")
