"""Session 77: `load_test.py --interleave` with one more server, `drafter-before`: the drafter server of the
commit before this session's change (a git worktree at BEFORE, default cddf121), so that the drafter server
whose plain rounds verify copied chains (ChainPlanner) is measured against the one whose plain rounds took one
token a row, in the same interleaved run. Everything else is load_test.py's. The change did not pay and was not
kept: it is `drafter-plain-rounds-copy.patch` beside this script. Run from the repository root:

    git worktree add /tmp/s77/before cddf121
    git apply benchmarks/results/s77/drafter-plain-rounds-copy.patch   # the measured state of the checkout
    python benchmarks/results/s77/load_before_after.py --modes plain,lookup,drafter,drafter-before --interleave 4 \
        --dtype auto --threads 1 --max-running 16 --concurrency 1,4,16 --requests 16 --max-tokens 128 \
        --warm-levels --out benchmarks/results/s77/load-before-after.json
"""
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import load_test  # noqa: E402  (benchmarks/load_test.py)

BEFORE = Path(os.environ.get("BEFORE", "/tmp/s77/before"))


class Server(load_test.Server):
    def __init__(self, args, mode, log_dir):
        if mode != "drafter-before":
            return super().__init__(args, mode, log_dir)
        root, load_test.ROOT = load_test.ROOT, BEFORE  # the old checkout's package, its own log folder
        try:
            (log_dir / "before").mkdir(exist_ok=True)
            super().__init__(args, "drafter", log_dir / "before")
        finally:
            load_test.ROOT = root


load_test.Server = Server
load_test.MODES = (*load_test.MODES, "drafter-before")
if __name__ == "__main__":
    sys.exit(load_test.main())
