"""Where test_bench.py's module fixture (one run_bench over 4 workloads x 2 temperatures x 2 prompts x 6 methods) spends its time."""
# Session 84: run from the repository root, alone on the machine: python benchmarks/results/s84/prof_bench.py
import cProfile, pstats, sys, time, pathlib, tempfile
sys.path.insert(0, "tests")
import torch
torch.set_num_threads(1)
import test_bench as tb
root = pathlib.Path(tempfile.mkdtemp())
class F:
    def mktemp(self, name):
        p = root / name; p.mkdir(); return p
dirs = tb.dirs._fixture_function(F())
pr = cProfile.Profile(); t = time.perf_counter(); pr.enable()
tb.run_bench(tb.spec(dirs, root / "out"))
pr.disable(); print(f"run_bench {time.perf_counter() - t:.1f} s")
pstats.Stats(pr).sort_stats("cumulative").print_stats(40)
