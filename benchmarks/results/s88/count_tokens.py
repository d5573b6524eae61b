"""Session 88: count_loss_tokens over the whole training corpus as a training run's start does (the examples as
read_corpus gives them), the per-conversation bincount of before (kept here as `old`) against the chunked one now;
both must give the same counts."""
import sys, time
import torch
from anchorspec.data.corpus import read_corpus
from anchorspec.train.vocab import count_loss_tokens

def old(batches, V):
    counts = torch.zeros(V, dtype=torch.long)
    for ids, mask in batches:
        ids, mask = torch.as_tensor(ids).long(), torch.as_tensor(mask)
        counts += torch.bincount(ids[mask == 1], minlength=V)
    return counts

torch.set_num_threads(1)
examples = [e for f in sys.argv[1:] for e in read_corpus(f)]
print(f"{len(examples)} conversations, {sum(len(e.input_ids) for e in examples)} tokens", flush=True)
V = 49152
for name, fn in (("per conversation", old), ("chunked", count_loss_tokens)):
    t = time.perf_counter(); c = fn(((e.input_ids, e.loss_mask) for e in examples), V)
    print(f"{name}: {time.perf_counter() - t:.1f} s, {int(c.sum())} counted", flush=True)
    ref = c if name == "per conversation" else ref
assert torch.equal(ref, c)
print("equal counts")
