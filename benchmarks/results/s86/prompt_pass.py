"""Session 86: one drafter pass over a prompt of n tokens (EagleProposer.update with random features), eager (the rule
before session 86: a prompt pass ran SDPA causal, no graph) against the compiled drafter's AOT graph, min over 2 runs
of medians of 5 calls. `python benchmarks/results/s86/prompt_pass.py THREADS`"""
import time, statistics, torch, sys
import anchorspec.decode.drafting as drafting
from anchorspec.api import load
from anchorspec.decode.propose import EagleProposer
threads = int(sys.argv[1]) if len(sys.argv) > 1 else 1
torch.set_num_threads(threads)
engine = load("smollm2-135m-instruct", "checkpoints/smollm2-135m-instruct-eagle3.1", "auto", threads=threads,
              compile="auto")
d = engine.drafter
real = drafting._one_graph_forward
H = d.config.target_hidden_size if hasattr(d.config, 'target_hidden_size') else 576
naux = d.fc.weight.shape[1]
for n in (16, 64, 128, 256, 512):
    res = {}
    for name, rule in (("eager", lambda g: False), ("graph", real)) * 2:
        drafting._one_graph_forward = rule
        ts = []
        for r in range(6):
            prop = EagleProposer(d)
            tokens = torch.randint(0, 40000, (n + 1,))
            aux = torch.randn(n, naux, dtype=d.fc.weight.dtype)
            t = time.perf_counter(); prop.update(tokens, aux); ts.append(time.perf_counter() - t)
        res.setdefault(name, []).append(statistics.median(ts[1:]))
    print(f"prompt {n}: eager {min(res['eager'])*1e3:.1f} ms, graph {min(res['graph'])*1e3:.1f} ms "
          f"({threads} threads)", flush=True)
