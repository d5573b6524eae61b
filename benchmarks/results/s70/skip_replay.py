"""Replay: skip the drafter on steps after a lookup chain was accepted whole (draft the chain alone)."""
import sys
sys.path.insert(0, "/work/main/benchmarks")
import torch
from tqdm import tqdm
from bench_core import DEFAULT_DATA, load_prompts, model_parser, target_and_drafter
from anchorspec.api import Engine
from anchorspec.data.chat import prompt_ids
from anchorspec.decode.engine import GenerationConfig, generate_vanilla
from anchorspec.decode.lookup import ContextLookup, LookupSettings, common_prefix, merge_chain
from anchorspec.decode.propose import EagleProposer
from anchorspec.decode.shape import GREEDY, accepted_length, captured_states
from anchorspec.decode.tree import TreeShape, DraftTree

def walk(proposer, sequence, prompt_len, aux, shape, skip_after):
    proposer.reset()
    context = ContextLookup(LookupSettings())
    tokens = sequence.tolist()
    pos, fed, emitted, steps, rows, skipped, whole_prev = prompt_len, 0, 0, 0, 0, 0, False
    while pos < len(tokens) - 2:
        answer = tokens[pos + 1:]
        context.extend(tokens[len(context.tokens):pos + 1])
        chain = context.propose(len(answer) - 1)
        if skip_after is not None and whole_prev and chain and len(chain) >= skip_after:
            tree = DraftTree(torch.tensor([tokens[pos]] + chain), list(range(-1, len(chain))))
            skipped += 1
        else:
            proposer.update(sequence[:pos + 1], aux[fed:pos]); fed = pos
            tree = proposer.propose(shape.capped(len(answer) - 1), GREEDY, None)
            if chain:
                tree = merge_chain(tree, chain)
        n = accepted_length(tree, answer)
        c = common_prefix(chain, answer[:n + 1]) if chain else None
        context.observe(c)
        whole_prev = chain is not None and c is not None and c == len(chain)
        steps, rows, emitted, pos = steps + 1, rows + tree.size, emitted + n + 1, pos + n + 1
    return emitted, steps, rows, skipped

p = model_parser("skip", dtype="bfloat16", dtypes=["float32", "bfloat16"])
p.add_argument("--limit", type=int, default=80)
p.add_argument("--shape", default="1,3,4")
args = p.parse_args()
target, drafter = target_and_drafter(args)
proposer = EagleProposer(drafter)
cfg = GenerationConfig(max_new_tokens=128, stop_token_ids=tuple(Engine(target).stop_token_ids()))
shape = TreeShape.parse(args.shape)
variants = {"no skip": None, "skip>=1": 1, "skip>=4": 4, "skip>=8": 8}
tot = {k: [0, 0, 0, 0] for k in variants}
for q in tqdm(load_prompts(DEFAULT_DATA, args.limit)):
    ids = prompt_ids(target.tokenizer, [{"role": "user", "content": q["text"]}])
    seq = torch.tensor(ids + generate_vanilla(target, torch.tensor(ids), cfg).token_ids)
    aux = captured_states(target, seq)
    for k, v in variants.items():
        got = walk(proposer, seq, len(ids), aux, shape, v)
        for i in range(4): tot[k][i] += got[i]
for k, (e, s, r, sk) in tot.items():
    print(f"{args.shape} {k}: tau {e/s:.3f} steps {s} rows/step {r/s:.2f} drafter skipped {sk/s:.1%} of steps")
