"""Session 87: the target's step graphs against its eager steps: one forward of chains of 1-17 tokens on 4 MT-bench
rows after 20 plain rounds (bf16, 1 thread, compile on as `serve` loads it; nothing committed), the largest logit
difference and how often the argmax agrees. bf16 rounding gives ~0.5-1.6 and >= 94 %; a wrong graph is plain to see
(one holding both attention forms as torch.cond branches gave 33-50 and 0-5 % at 2+ tokens).

    python benchmarks/results/s87/graph_logits.py
"""
import json
from pathlib import Path

import torch

from anchorspec.api import load
from anchorspec.decode.batch import batch_forward
from anchorspec.decode.engine import GenerationConfig, PlainDecoding
from anchorspec.decode.round import BatchDecoder
from anchorspec.decode.tree import DraftTree

torch.set_num_threads(1)
engine = load("smollm2-135m-instruct", None, "auto", threads=1, compile=True)
target = engine.target
graph = target.load_graph()
print(f"graph: {type(graph).__name__}")
turns = [json.loads(line)["turns"][0] for line in Path("../shared/data/mt_bench/question.jsonl").read_text().splitlines()]
decs = [PlainDecoding(target, engine.encode_chat([{"role": "user", "content": t}]), GenerationConfig(max_new_tokens=40))
        for t in turns[:4]]
decoder = BatchDecoder(target)
for _ in range(20):
    decoder.round([(d, None) for d in decs])
slots = [d.cache for d in decs]
for width in (1, 2, 4, 16, 17):
    trees = [DraftTree.chain(torch.arange(width) + 1000) for _ in slots]
    target._aot = graph
    through_graph = torch.cat(batch_forward(target, slots, trees).logits).float()
    target._aot = None  # eager steps
    eager = torch.cat(batch_forward(target, slots, trees).logits).float()
    target._aot = graph
    agree = (through_graph.argmax(-1) == eager.argmax(-1)).float().mean().item()
    print(f"width {width:2d}: largest logit difference {(through_graph - eager).abs().max().item():.3f}, "
          f"argmax agrees on {agree:.0%} of rows")
