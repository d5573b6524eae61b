"""The target's AOT step graph with inductor's C++ GEMM template (max_autotune, backends CPP) against the
default graph (oneDNN's prepacked kernels): ms per forward of N new tokens after 256 of context, and the
plain loop's tokens/s. Session 79.

    python benchmarks/results/s79/gemm_probe_aot.py MODE [--threads 2] [--dtype bfloat16]
MODE: onednn (the default graph) | cpp (C++ template, a graph file of its own)."""
import argparse, json, platform, sys, time
from pathlib import Path

import torch
import torch._inductor.config as ic

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from anchorspec.decode.engine import GenerationConfig, generate_vanilla  # noqa: E402
from anchorspec.decode.shape import verify_cost  # noqa: E402
from anchorspec.models.target import load_target  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("mode", choices=["onednn", "cpp", "cpp_aten"])
ap.add_argument("--threads", type=int, default=2)
ap.add_argument("--dtype", default="bfloat16")
ap.add_argument("--sizes", default="2,4,8,16,32")
ap.add_argument("--hint-tokens", type=int, default=3, help="new tokens per row of the traced example (2 rows): "
                "the template's blocking follows the example's rows x tokens")
args = ap.parse_args()
import os
os.environ["ANCHORSPEC_NARROW_GRAPH"] = "off"  # one graph, its GEMMs as MODE says
torch.set_num_threads(args.threads)
t = load_target("smollm2-135m-instruct", getattr(torch, args.dtype), pack="off")
if args.mode != "onednn":
    ic.max_autotune = True
    ic.max_autotune_gemm_backends = "CPP" if args.mode == "cpp" else "CPP,ATEN"
    orig = t._graph_key
    def key(fuse=True):
        path, text = orig(fuse)
        tag = args.mode + ("" if args.hint_tokens == 3 else f"-hint{args.hint_tokens}")
        return path.with_name(path.stem + f"-{tag}.pt2"), text + tag
    t._graph_key = key
    example = t._aot_example
    def hinted(rows, tokens, past, kept, slots, capacity):
        if (rows, tokens) == (2, 3):  # the trace's example: more tokens, room for them
            tokens, capacity = args.hint_tokens, past + args.hint_tokens + 4
        return example(rows=rows, tokens=tokens, past=past, kept=kept, slots=slots, capacity=capacity)
    t._aot_example = hinted
t.compile()
t0 = time.perf_counter()
with torch.inference_mode():
    verify, plain = verify_cost(t, 256, [int(s) for s in args.sizes.split(",")], repeats=2)
first = time.perf_counter() - t0
with torch.inference_mode():
    verify, plain = verify_cost(t, 256, [int(s) for s in args.sizes.split(",")], repeats=15)
ids = list(range(100, 160))
cfg = GenerationConfig(max_new_tokens=64)
generate_vanilla(t, ids, cfg)
rates = []
for _ in range(3):
    s = time.perf_counter(); n = len(generate_vanilla(t, ids, cfg).token_ids); rates.append(n / (time.perf_counter() - s))
out = {"mode": args.mode, "hint_tokens": args.hint_tokens, "dtype": args.dtype, "threads": args.threads, "cpu": platform.processor() or "x86_64",
       "first_call_s": round(first, 1), "plain_ms": round(plain * 1e3, 2),
       "verify_ms": {n: round(v * 1e3, 2) for n, v in verify.items()},
       "plain_loop_tok_s": sorted(round(r, 1) for r in rates)}
print(json.dumps(out))
