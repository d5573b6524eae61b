"""Replay deterministic drafts (greedy chains, top-k trees) along the target's own T=1 answers: the chance a
fixed candidate set holds the next sampled token is exactly its acceptance under recursive rejection with q=1,
so walking the tree along sampled text estimates tau at T=1 without verify forwards (unbiased per step)."""
import sys, os
sys.path.insert(0, "/work/main/benchmarks")
import torch, numpy as np
from tqdm import tqdm
from bench_core import DEFAULT_DATA, load_prompts, model_parser, target_and_drafter
from anchorspec.api import Engine
from anchorspec.data.chat import prompt_ids
from anchorspec.decode.engine import GenerationConfig, generate_vanilla
from anchorspec.decode.sampling import SamplingParams
from anchorspec.decode.propose import EagleProposer
from anchorspec.decode.shape import GREEDY, accepted_length, captured_states
from anchorspec.decode.tree import TreeShape

p = model_parser("t1", dtype="bfloat16", dtypes=["float32", "bfloat16"])
p.add_argument("--limit", type=int, default=80)
p.add_argument("--temperature", type=float, default=1.0)
p.add_argument("--seeds", type=int, default=2)
p.add_argument("--shapes", nargs="+", default=["1,1,2", "1,2,3", "1,3,4", "2,1,3", "2,2,4", "2,2,5", "2,3,6", "3,2,6", "3,3,8", "2,4,8", "4,3,8", "4,4,16"])
args = p.parse_args()
target, drafter = target_and_drafter(args)
proposer = EagleProposer(drafter)
cache = f"/tmp/s70/replay-seqs-T{args.temperature}-{args.limit}x{args.seeds}.pt"
if os.path.exists(cache):
    data = torch.load(cache)
else:
    data = []
    stops = tuple(Engine(target).stop_token_ids())
    for i, q in enumerate(tqdm(load_prompts(DEFAULT_DATA, args.limit), desc="answers")):
        ids = prompt_ids(target.tokenizer, [{"role": "user", "content": q["text"]}])
        for s in range(args.seeds):
            cfg = GenerationConfig(max_new_tokens=128, stop_token_ids=stops, sampling=SamplingParams(temperature=args.temperature), seed=1000 * s + i)
            seq = torch.tensor(ids + generate_vanilla(target, torch.tensor(ids), cfg).token_ids)
            data.append((seq, len(ids), captured_states(target, seq)))
    torch.save(data, cache)
for text in args.shapes:
    shape = TreeShape.parse(text)
    E = S = R = 0
    for seq, plen, aux in data:
        proposer.reset()
        tokens = seq.tolist()
        pos, fed = plen, 0
        while pos < len(tokens) - 2:
            answer = tokens[pos + 1:]
            proposer.update(seq[:pos + 1], aux[fed:pos]); fed = pos
            tree = proposer.propose(shape.capped(len(answer) - 1), GREEDY, None)
            n = accepted_length(tree, answer)
            E += n + 1; S += 1; R += tree.size; pos += n + 1
    print(f"T={args.temperature} {text}: tau {E/S:.3f} rows/step {R/S:.2f} steps {S}", flush=True)
