"""Seeded equality (session 72): the merged verify_sampling against session 71s verify_chain_sampling (chains)
and verify_tree_sampling (trees), same seeds. Run: python verify_merge_seeded_eq.py chain sampled-tree topk"""
import subprocess, sys, types, torch
from anchorspec.decode.tree import DraftTree
from anchorspec.decode.sampling import sample
from anchorspec.decode.verify import verify_sampling  # verify_tree_sampling until session 72
# session 71's verify.py, read from git (commit f2c2cfb), loaded as a sibling module of today's
_src = subprocess.run(["git", "show", "f2c2cfb:anchorspec/decode/verify.py"], capture_output=True, text=True, check=True).stdout
old = sys.modules["anchorspec.decode.verify_s71"] = types.ModuleType("anchorspec.decode.verify_s71")
old.__package__ = "anchorspec.decode"
exec(compile(_src, "verify_s71.py", "exec"), old.__dict__)

def rp(g, n, zf, dtype):
    x = torch.rand(n, generator=g, dtype=torch.float64).masked_fill(torch.rand(n, generator=g) < zf, 0.0)
    x[int(torch.randint(n, (1,), generator=g))] += 0.5
    return (x / x.sum()).to(dtype)

def run(kind, dtype, trials, seed):
    g = torch.Generator().manual_seed(seed); diff = 0
    for t in range(trials):
        v = 12
        if kind == "chain":
            k = int(torch.randint(1, 6, (1,), generator=g)); parents = list(range(-1, k))
        else:
            parents = [-1, 0, 0, 0, 1, 1, 2, 4]
        n = len(parents)
        rows = int(torch.randint(1, n + 1, (1,), generator=g)) if t % 4 == 0 else n  # staged: fewer rows
        p = torch.stack([rp(g, v, 0.4, dtype) for _ in range(rows)])
        if t % 5 == 0:  # q within noise of p
            q = (torch.cat([p, p[:1].expand(n - rows, v)]) * (1 + 1e-6 * torch.rand(n, v, generator=g, dtype=torch.float64)).to(dtype))
            q = q / q.sum(-1, keepdim=True)
        else:
            q = torch.stack([rp(g, v, 0.4, dtype) for _ in range(n)])
        tokens = [0]
        for node in range(1, n):
            sib = [tokens[c] for c in range(1, node) if parents[c] == parents[node]]
            w = q[node].double().clone() if kind != "topk" else torch.ones(v, dtype=torch.float64)
            w[sib] = 0
            if w.sum() == 0:
                w = torch.ones(v, dtype=torch.float64); w[sib] = 0
            x = sample(w / w.sum(), g)
            tokens.append(x)
        dp = None if kind == "topk" else q
        tree = DraftTree(torch.tensor(tokens), parents, draft_probs=dp)
        s = int(torch.randint(2**31, (1,), generator=g))
        a = verify_sampling(tree, p, torch.Generator().manual_seed(s))
        ref = old.verify_chain_sampling if kind == "chain" else old.verify_tree_sampling
        b = ref(tree, p, torch.Generator().manual_seed(s))
        diff += (a.path, a.next_token, a.held) != (b.path, b.next_token, b.held)
    return diff

for kind in sys.argv[1:]:
    for dtype in (torch.float32, torch.float64):
        print(kind, dtype, "differing verdicts:", run(kind, dtype, 20000, 7), "of 20000", flush=True)
