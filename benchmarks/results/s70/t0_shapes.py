import sys
sys.path.insert(0, "/work/main/benchmarks")
import torch
from bench_core import model_parser, target_and_drafter
from lookup_replay import walk
from anchorspec.decode.lookup import LookupSettings
from anchorspec.decode.propose import EagleProposer
from anchorspec.decode.tree import TreeShape
p = model_parser("t0", dtype="bfloat16", dtypes=["float32", "bfloat16"])
p.add_argument("--shapes", nargs="+", default=["1,2,3", "1,3,4", "1,4,5", "2,1,3", "2,2,4", "2,2,5", "2,3,6", "3,2,6", "2,3,7", "3,3,8", "2,4,8", "4,4,16"])
args = p.parse_args()
target, drafter = target_and_drafter(args)
proposer = EagleProposer(drafter)
data = torch.load("/tmp/s70/replay-seqs-80.pt")
for text in args.shapes:
    shape = TreeShape.parse(text)
    for lk in (None, LookupSettings()):
        E = S = R = 0
        for seq, plen, aux in data:
            e, s, r = walk(proposer, seq, plen, aux, shape, lk)
            E += e; S += s; R += r
        print(f"T=0 {text} lookup {'on' if lk else 'off'}: tau {E/S:.3f} rows/step {R/S:.2f}", flush=True)
