"""One TTT training step, timed: forward and backward of `ttt_forward` on micro-batches, under each
process allocator (anchorspec/allocator.py): glibc as it is, glibc told to keep freed memory
(ANCHORSPEC_MALLOC=keep), and tcmalloc and jemalloc through LD_PRELOAD where installed, and with the
eager or the torch.compile'd loss kernels (`--loss eager,compiled`; `train --compile-loss`), each in its
own process. `--mixed` cycles through eight micro-batch shapes of about 2,048 tokens, as a real run's
length-sorted batches do (the case where an allocator's heap can fragment); peak RSS is printed too.

    python benchmarks/bench_ttt.py [--drafter checkpoints/smollm2-135m-instruct-eagle3.1] [--rows 4]
        [--tokens 512] [--mixed] [--ttt-steps 4] [--dtype bfloat16] [--threads 1] [--repeats 5] [--json FILE]
        [--allocators glibc,keep,tcmalloc,jemalloc] [--loss eager]

Inputs are random features of the drafter's shapes (the target is not loaded): the step's cost does
not depend on their values. Prints CPU model and flags, torch version, threads and dtype with the
median seconds per micro-batch and tokens per second.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# rows x tokens of about 2,048, as `epoch_batches` cuts length-sorted pools
MIXED_SHAPES = [(4, 512), (2, 1000), (8, 250), (3, 680), (5, 400), (6, 330), (2, 900), (4, 470)]


ALLOCATORS = ("glibc", "keep", "tcmalloc", "jemalloc")


def time_steps(args) -> dict:
    import torch

    from anchorspec.allocator import active_allocator, keep_freed_memory
    from anchorspec.models.drafter import load_drafter
    from anchorspec.train.ttt import compile_loss, ttt_forward

    compile_loss(args.loss_kernels == "compiled")
    applied = keep_freed_memory() if args.allocator == "keep" else active_allocator() == args.allocator
    torch.set_num_threads(args.threads)
    d = load_drafter(args.drafter, torch.float32)
    c = d.config
    gen = torch.Generator().manual_seed(0)
    d.bind_target_embedding(torch.randn(c.vocab_size, c.hidden_size, generator=gen) * 0.02)
    dtype = getattr(torch, args.dtype)
    shapes = MIXED_SHAPES if args.mixed else [(args.rows, args.tokens)]

    def step(B, T):
        aux = torch.randn(B, T, c.num_aux * c.target_hidden_size, generator=gen).to(dtype)
        ids = torch.randint(0, c.vocab_size, (B, T), generator=gen)
        logits = torch.randn(B, T, c.draft_vocab_size, generator=gen).to(dtype)
        in_draft, loss_mask = torch.ones(B, T, dtype=torch.bool), torch.ones(B, T)
        t = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
            out = ttt_forward(d, aux, ids, logits, loss_mask, steps=args.ttt_steps, target_in_draft=in_draft)
        out.loss.backward()
        d.zero_grad(set_to_none=True)
        return time.perf_counter() - t

    for B, T in shapes:
        step(B, T)  # warm-up: first-touch allocations, oneDNN kernel selection
    per_token = [step(B, T) / (B * T) for _ in range(args.repeats) for B, T in shapes]
    med = statistics.median(per_token)
    tokens = statistics.mean(B * T for B, T in shapes)
    return {"allocator": args.allocator, "loss": args.loss_kernels, "applied": applied, "s_per_batch": med * tokens,
            "tokens_per_s": 1 / med,
            "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--drafter", default=str(ROOT / "checkpoints" / "smollm2-135m-instruct-eagle3.1"))
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=512, help="tokens per row (rows x tokens = the micro-batch)")
    ap.add_argument("--mixed", action="store_true", help="eight micro-batch shapes in turn instead of one")
    ap.add_argument("--ttt-steps", type=int, default=4)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", type=Path, help="also write the results here")
    ap.add_argument("--allocators", default=",".join(ALLOCATORS), help="comma-separated, from " + ", ".join(ALLOCATORS))
    ap.add_argument("--loss", default="eager", help="comma-separated loss kernels to time: eager, compiled")
    ap.add_argument("--allocator", choices=ALLOCATORS, help=argparse.SUPPRESS)  # one child's settings
    ap.add_argument("--loss-kernels", choices=["eager", "compiled"], help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.allocator:  # a child: time and print one JSON line
        print(json.dumps(time_steps(args)))
        return 0
    import torch

    from anchorspec.models.dtype import cpu_line

    shape = "mixed shapes" if args.mixed else f"micro-batch {args.rows}x{args.tokens}"
    print(f"CPU {cpu_line()}, torch {torch.__version__}, {args.threads} thread(s), {args.dtype}, {shape}, "
          f"TTT {args.ttt_steps}")
    from anchorspec.allocator import find_tcmalloc

    preloads = {"tcmalloc": find_tcmalloc(), "jemalloc": next(iter(sorted(glob.glob("/usr/lib/*/libjemalloc.so.2"))), None)}
    results = []
    allocators, losses = args.allocators.split(","), args.loss.split(",")
    for name in allocators + losses:
        if name not in ALLOCATORS + ("eager", "compiled"):
            ap.error(f"unknown allocator or loss kernels {name!r}")
    # each arm in a fresh process: the allocator and the loss kernels are process-wide
    for allocator, loss in [(a, k) for a in allocators for k in losses]:
        env = {**os.environ, "ANCHORSPEC_MALLOC": "keep" if allocator == "keep" else "glibc"}
        if allocator in preloads:
            if preloads[allocator] is None:
                print(f"  allocator {allocator:8s}, loss {loss:8s}: not installed, skipped")
                continue
            env["LD_PRELOAD"] = preloads[allocator]
        cmd = [sys.executable, __file__, *(argv if argv is not None else sys.argv[1:]), "--allocator", allocator,
               "--loss-kernels", loss]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True, env=env).stdout.strip().splitlines()[-1]
        r = json.loads(out)
        results.append(r)
        print(f"  allocator {allocator:8s}, loss {loss:8s}: {r['s_per_batch']:.2f} s per micro-batch, "
              f"{r['tokens_per_s']:.0f} tok/s, peak RSS {r['peak_rss_gb']:.2f} GB, "
              f"{r['tokens_per_s'] / results[0]['tokens_per_s']:.2f}x the first arm"
              + ("" if r["applied"] else " (setting did not take effect)"))
    if args.json:
        args.json.write_text(json.dumps({"cpu": cpu_line(), "torch": torch.__version__, "threads": args.threads,
                                         "dtype": args.dtype, "results": results}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
