"""Policies for a context-lookup chain merged into the drafter's chain/tree, replayed along the target's greedy
answers to MT-bench first turns. Per walk: accepted tokens, steps, verify tokens (merged tree size), drafter levels."""
import sys, json, torch
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[2]))
from bench_core import DEFAULT_DATA, load_prompts
from anchorspec.api import DEFAULT_TREE, Engine, attach_drafter
from anchorspec.data.chat import prompt_ids
from anchorspec.decode.engine import GenerationConfig, generate_vanilla
from anchorspec.decode.propose import EagleProposer
from anchorspec.decode.shape import captured_states, accepted_length, GREEDY
from anchorspec.decode.tree import TreeShape
from anchorspec.models.drafter import load_drafter
from anchorspec.models.target import load_target, parse_dtype

def lookup(ctx, K, min_m=2, max_m=8):
    n = len(ctx)
    for m in range(min(max_m, n - 1), min_m - 1, -1):
        suf = ctx[n - m:]
        for e in range(n - 1, m - 1, -1):
            if ctx[e - m:e] == suf:
                prop = []
                for i in range(K):
                    idx = e + i
                    prop.append(ctx[idx] if idx < n else prop[idx - n])
                return prop, m
    return [], 0

def match(prop, answer):
    k = 0
    while k < len(prop) and k < len(answer) and prop[k] == answer[k]:
        k += 1
    return k

def paths(tree):
    """token paths (from the root's children) of every node, as tuples"""
    toks = tree.tokens.tolist(); par = tree.parents
    out = {0: ()}
    for i in range(1, len(toks)):
        out[i] = out[par[i]] + (toks[i],)
    return set(out.values())

POLICIES = {  # name -> (Kmax, min_m, adaptive)
    'none': (0, 2, False), 'K4': (4, 2, False), 'K8': (8, 2, False), 'K16': (16, 2, False),
    'K16 m>=3': (16, 3, False), 'K16 m>=4': (16, 4, False),
    'adapt16': (16, 2, True), 'adapt16 m>=3': (16, 3, True), 'adapt32': (32, 2, True),
}

N = int(sys.argv[1]); dtype = parse_dtype(sys.argv[2]); torch.set_num_threads(int(sys.argv[3]))
bases = sys.argv[4].split(',')
target = load_target('smollm2-135m-instruct', dtype)
drafter = load_drafter('checkpoints/smollm2-135m-instruct-eagle3.1', dtype).eval()
attach_drafter(target, drafter); proposer = EagleProposer(drafter)
gcfg = GenerationConfig(max_new_tokens=128, stop_token_ids=tuple(Engine(target).stop_token_ids()))
prompts = load_prompts(DEFAULT_DATA, N)
shapes = {'tree': DEFAULT_TREE, **{f'chain{c}': TreeShape(1, int(c), int(c) + 1) for c in '12345'}}
res = {}
for qi, q in enumerate(prompts):
    ids = prompt_ids(target.tokenizer, [{"role": "user", "content": q["text"]}])
    ans = generate_vanilla(target, torch.tensor(ids), gcfg).token_ids
    seq = torch.tensor(ids + ans); P = len(ids); aux = captured_states(target, seq)
    for base in bases:
        shape = shapes[base]
        for pname, (Kmax, min_m, adaptive) in POLICIES.items():
            proposer.reset(); pos, fed = P, 0
            acc = steps = vtok = levels = 0; last = 1
            while pos < seq.numel() - 2:
                answer = seq[pos + 1:].tolist()
                proposer.update(seq[:pos + 1], aux[fed:pos]); fed = pos
                tree = proposer.propose(shape.capped(len(answer) - 1), GREEDY, None)
                n = accepted_length(tree, answer); size = tree.size; levels += tree.depth
                if Kmax:
                    K = min(Kmax, max(2, 2 * last + 2)) if adaptive else Kmax
                    K = min(K, len(answer) - 1)
                    prop, m = lookup(seq[:pos + 1].tolist(), K)
                    if prop and m >= min_m:
                        have = paths(tree)
                        extra = sum(1 for j in range(1, len(prop) + 1) if tuple(prop[:j]) not in have)
                        size += extra
                        nl = match(prop, answer)
                        last = nl
                        n = max(n, nl)
                    else:
                        last = 1
                steps += 1; pos += n + 1; vtok += size
                acc += n + 1
            r = res.setdefault(f'{base} {pname}', [0, 0, 0, 0])
            r[0] += acc; r[1] += steps; r[2] += vtok; r[3] += levels
    if (qi + 1) % 20 == 0 or qi + 1 == len(prompts):
        print(qi + 1, flush=True)
        for k, (a, s, v, l) in res.items():
            print(f'  {k:24s} tau {a/s:.3f}  verify tokens/step {v/s:.2f}  drafter levels/step {l/s:.2f}', flush=True)
json.dump(res, open(sys.argv[5], 'w'))
