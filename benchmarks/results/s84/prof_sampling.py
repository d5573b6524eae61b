"""Where a tiny solo sampled generation spends its time (the statistical tests run 2,500 of them)."""
# Session 84: run from the repository root, alone on the machine: python benchmarks/results/s84/prof_sampling.py [tree]
import cProfile, pstats, sys, time
sys.path.insert(0, "tests")
import torch
import transformers
from anchorspec.api import attach_drafter
from anchorspec.decode.propose import EagleProposer
from anchorspec.models.drafter import init_drafter
from anchorspec.models.target import Target
from anchorspec.decode.tree import TreeShape
from helpers import tiny_config
import sampling_world as sw

torch.manual_seed(3)
model = transformers.AutoModelForCausalLM.from_config(tiny_config("llama", vocab_size=sw.V, layers=4))
target = Target(model.to(torch.float64).eval())
drafter = init_drafter(target.config, "eagle3.1", seed=5, init_std=0.3).to(torch.float64)
attach_drafter(target, drafter)
proposer = EagleProposer(drafter)
shape = TreeShape.chain(3) if sys.argv[1:2] != ["tree"] else TreeShape(3, 3, 8)
sw.run_many(target, proposer, shape, 20)
t = time.perf_counter(); sw.run_many(target, proposer, shape, 200); dt = time.perf_counter() - t
print(f"{torch.get_num_threads()} threads: {dt / 200 * 1e3:.2f} ms per run")
pr = cProfile.Profile(); pr.enable(); sw.run_many(target, proposer, shape, 200); pr.disable()
pstats.Stats(pr).sort_stats("cumulative").print_stats(45)
