"""Feasibility: the default drafter tree / chain 3 alone vs the same plus a context-lookup chain, replayed along the
target's greedy answers to MT-bench first turns (no verify forwards)."""
import sys, json, time, torch
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[2]))
from bench_core import DEFAULT_DATA, load_prompts
from anchorspec.api import DEFAULT_TREE, Engine, attach_drafter
from anchorspec.data.chat import prompt_ids
from anchorspec.decode.engine import GenerationConfig, generate_vanilla
from anchorspec.decode.propose import EagleProposer
from anchorspec.decode.shape import captured_states
from anchorspec.decode.tree import TreeShape
from anchorspec.decode.shape import accepted_length, GREEDY

from anchorspec.models.drafter import load_drafter
from anchorspec.models.target import load_target, parse_dtype

def lookup(ctx, K, min_m=2, max_m=8):
    n = len(ctx)
    for m in range(min(max_m, n - 1), min_m - 1, -1):
        suf = ctx[n - m:]
        for e in range(n - 1, m - 1, -1):  # occurrence ending at e (exclusive), before the suffix itself
            if ctx[e - m:e] == suf:
                prop = []
                for i in range(K):
                    idx = e + i
                    prop.append(ctx[idx] if idx < n else prop[idx - n])
                return prop
    return []

def match(prop, answer):
    k = 0
    while k < len(prop) and k < len(answer) and prop[k] == answer[k]:
        k += 1
    return k

N = int(sys.argv[1]); dtype = parse_dtype(sys.argv[2]); torch.set_num_threads(int(sys.argv[3]))
target = load_target('smollm2-135m-instruct', dtype)
drafter = load_drafter('checkpoints/smollm2-135m-instruct-eagle3.1', dtype).eval()
attach_drafter(target, drafter); proposer = EagleProposer(drafter)
gcfg = GenerationConfig(max_new_tokens=128, stop_token_ids=tuple(Engine(target).stop_token_ids()))
prompts = load_prompts(DEFAULT_DATA, N)
chain3 = TreeShape(1, 3, 4) if True else None
shapes = {'tree4,4,16': DEFAULT_TREE, 'chain3': chain3}
res = {f'{s}{suf}': [0, 0] for s in shapes for suf in ('', '+lookup8', '+lookup16')}
res['lookup8 only'] = [0, 0]; res['lookup16 only'] = [0, 0]
for qi, q in enumerate(prompts):
    ids = prompt_ids(target.tokenizer, [{"role": "user", "content": q["text"]}])
    ans = generate_vanilla(target, torch.tensor(ids), gcfg).token_ids
    seq = torch.tensor(ids + ans); P = len(ids); aux = captured_states(target, seq)
    for name, shape in shapes.items():
        for K in (0, 8, 16):
            proposer.reset(); pos, fed, steps = P, 0, 0
            while pos < seq.numel() - 2:
                answer = seq[pos + 1:].tolist()
                proposer.update(seq[:pos + 1], aux[fed:pos]); fed = pos
                tree = proposer.propose(shape.capped(len(answer) - 1), GREEDY, None)
                n = accepted_length(tree, answer)
                if K:
                    n = max(n, match(lookup(seq[:pos + 1].tolist(), min(K, len(answer) - 1)), answer))
                steps += 1; pos += n + 1
            key = name + ('' if not K else f'+lookup{K}')
            res[key][0] += pos - P; res[key][1] += steps
    for K in (8, 16):
        pos, steps = P, 0
        while pos < seq.numel() - 2:
            answer = seq[pos + 1:].tolist()
            n = match(lookup(seq[:pos + 1].tolist(), min(K, len(answer) - 1)), answer)
            steps += 1; pos += n + 1
        res[f'lookup{K} only'][0] += pos - P; res[f'lookup{K} only'][1] += steps
    if (qi + 1) % 10 == 0 or qi + 1 == len(prompts):
        print(qi + 1, {k: round(a / b, 3) for k, (a, b) in res.items()}, flush=True)
