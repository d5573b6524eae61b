"""Session 83: bench_default_shape.py with the stream monitors' pacing off (StreamMonitor.follow_pace = False: step
costs kept in seconds as measured, session 43's rule), to see whether the estimates then keep up with what the steps
cost (with pacing on, the default-shape run's estimated cost of a chain of 3 fell from 1.50 to 1.13-1.32 plain steps
over 24 prompts while its realised cost stayed near 1.6). Arguments as bench_default_shape.py's.

    python benchmarks/results/s83/default_shape_nopace.py --drafter checkpoints/smollm2-135m-instruct-eagle3.1 \
        --compile --threads 2 --limit 24 --every 3 --no-hf --out benchmarks/results/s83/default-shape-nopace.json
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from anchorspec.decode import fallback  # noqa: E402

_init = fallback.StreamMonitor.__init__


def _unpaced(self, *args, **kwargs):
    _init(self, *args, **kwargs)
    self.follow_pace = False


fallback.StreamMonitor.__init__ = _unpaced

import bench_default_shape  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(bench_default_shape.main())
