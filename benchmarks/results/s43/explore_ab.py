"""generate's defaults with the release under other shape-choice rules, rotated per prompt in one
process. Arms (--arms, comma-separated):
  new      session 43: costs are medians of the last COST_WINDOW steps; candidates priced on the
           calibration alone, or not drafted for EXPLORE_STALE steps, are explored whatever their estimate
  ema      as new, but costs are moving averages (0.2), as before session 43
  floor    as new, but only candidates expected at >= 0.8x of the current shape are explored
  old      sessions 41-42: moving averages and the floor alone
Same drafter weights, each arm its own engine (costs, acceptance, shape).

    python benchmarks/results/s43/explore_ab.py --arms new,ema,old --every 2 --offset 1 --limit 40 --out FILE.json
(any other bench_drafters.py flag passes through; --drafter, --shape, --dtype and --threads are set here)"""
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # benchmarks/
import bench_drafters  # noqa: E402

RELEASE = "checkpoints/smollm2-135m-instruct-eagle3.1"
_init = bench_drafters.Method.__init__


def method_init(self, name, engine, kind, *args, **kwargs):
    _init(self, name, engine, kind, *args, **kwargs)
    m = engine.monitor
    if name in ("floor", "old"):  # the floor alone decides which candidates are explored
        m.priced_on_calibration = lambda shape: False
        m.explore_stale = math.inf
    if name in ("ema", "old"):  # moving averages of the costs
        m.verify.window = m.draft.window = m.cost_window = None


bench_drafters.Method.__init__ = method_init
if __name__ == "__main__":
    argv = sys.argv[1:]
    arms = ["new", "old"]
    if "--arms" in argv:
        i = argv.index("--arms")
        arms, argv = argv[i + 1].split(","), argv[:i] + argv[i + 2:]
    drafters = [x for arm in arms for x in ("--drafter", f"{arm}={RELEASE}")]
    sys.exit(bench_drafters.main(argv + drafters + ["--shape", "default", "--dtype", "bfloat16", "--threads", "2"]))
