"""How wide T=0.7 top-p 0.9 nuclei are on real target logits, and what a cut costs by head search and by sort (session 74).

The target (float32) over 16 held-out sampled conversations (T=1 part 0007, every 200th, first 512 tokens); timings on
one thread, rows of the last conversation. `python benchmarks/results/s74/nucleus_sizes.py`."""
import torch, time
from anchorspec.data.corpus import read_part
from anchorspec.models.target import load_target
from anchorspec.decode.sampling import SamplingParams, probs_from_logits
import anchorspec.decode.sampling as S
torch.set_num_threads(1)
t = load_target("smollm2-135m-instruct", "float32", pack="off")
exs = read_part("corpus/smollm2-135m-instruct-t1/part-0007.npz")[::200][:16]
sizes = []
for e in exs:
    ids = torch.tensor([e.input_ids[:512]])
    with torch.no_grad():
        lg = t.model(ids).logits[0].float()
    m = torch.tensor(e.loss_mask[:512]).bool()
    probs = torch.softmax(lg[m] / 0.7, -1)
    sp = probs.sort(-1, descending=True).values
    n = ((sp.cumsum(-1) - sp) < 0.9).sum(-1)
    sizes += n.tolist()
sizes = torch.tensor(sizes).float()
print("positions", len(sizes), "nucleus size at T=0.7 top-p 0.9: median", sizes.median().item(), "p90", sizes.quantile(0.9).item(), "p99", sizes.quantile(0.99).item(), "max", sizes.max().item(), "share >128", (sizes > 128).float().mean().item(), "share >256", (sizes > 256).float().mean().item(), "share >1024", (sizes > 1024).float().mean().item())
row = lg[m][:1]
for fn in ("head", "sort"):
    p = SamplingParams(0.7, 0.9)
    if fn == "sort":
        import sys; sys.path.insert(0, "tests"); from test_sampling import sorted_nucleus; S.nucleus = sorted_nucleus
    for rows in (1, 5, 16):
        x = lg[m][:rows]
        probs_from_logits(x, p); t0 = time.perf_counter()
        for _ in range(50): probs_from_logits(x, p)
        print(fn, rows, "rows: %.3f ms" % ((time.perf_counter() - t0) / 50 * 1e3))
