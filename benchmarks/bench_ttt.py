"""One TTT training step, timed: forward and backward of `ttt_forward` on one micro-batch, with the
process allocator as glibc leaves it and as ANCHORSPEC_MALLOC=keep sets it (glibc kept from
unmapping large freed blocks: faster on repeated shapes, see anchorspec/allocator.py for why it is
off by default), each in its own process.

    python benchmarks/bench_ttt.py [--drafter checkpoints/smollm2-135m-instruct-eagle3.1] [--rows 4]
        [--tokens 512] [--ttt-steps 4] [--dtype bfloat16] [--threads 1] [--repeats 5] [--json FILE]

Inputs are random features of the drafter's shapes (the target is not loaded): the step's cost does
not depend on their values. Prints CPU model and flags, torch version, threads and dtype with the
median seconds per micro-batch and tokens per second.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def time_steps(args) -> dict:
    import torch

    from anchorspec.allocator import keep_freed_memory
    from anchorspec.models.drafter import load_drafter
    from anchorspec.train.ttt import ttt_forward

    if args.allocator == "keep":
        os.environ["ANCHORSPEC_MALLOC"] = "keep"
    applied = keep_freed_memory() if args.allocator == "keep" else False
    torch.set_num_threads(args.threads)
    d = load_drafter(args.drafter, torch.float32)
    c = d.config
    gen = torch.Generator().manual_seed(0)
    d.bind_target_embedding(torch.randn(c.vocab_size, c.hidden_size, generator=gen) * 0.02)
    B, T = args.rows, args.tokens
    dtype = getattr(torch, args.dtype)
    aux = torch.randn(B, T, c.num_aux * c.target_hidden_size, generator=gen).to(dtype)
    ids = torch.randint(0, c.vocab_size, (B, T), generator=gen)
    logits = torch.randn(B, T, c.draft_vocab_size, generator=gen).to(dtype)
    in_draft, loss_mask = torch.ones(B, T, dtype=torch.bool), torch.ones(B, T)

    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
            out = ttt_forward(d, aux, ids, logits, loss_mask, steps=args.ttt_steps, target_in_draft=in_draft)
        out.loss.backward()

    step()  # warm-up: first-touch allocations, oneDNN kernel selection
    times = []
    for _ in range(args.repeats):
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
    med = statistics.median(times)
    return {"allocator": args.allocator, "applied": applied, "s_per_batch": med, "tokens_per_s": B * T / med}


def cpu_line() -> str:
    flags = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                have = set(line.split(":", 1)[1].split())
                flags = " ".join(f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in have)
                break
    except OSError:
        pass
    return f"{platform.processor() or platform.machine()} [{flags}]"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--drafter", default=str(ROOT / "checkpoints" / "smollm2-135m-instruct-eagle3.1"))
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=512, help="tokens per row (rows x tokens = the micro-batch)")
    ap.add_argument("--ttt-steps", type=int, default=4)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", type=Path, help="also write the results here")
    ap.add_argument("--allocator", choices=["keep", "default"], help=argparse.SUPPRESS)  # one child's setting
    args = ap.parse_args(argv)
    if args.allocator:  # a child: time and print one JSON line
        print(json.dumps(time_steps(args)))
        return 0
    import torch

    print(f"CPU {cpu_line()}, torch {torch.__version__}, {args.threads} thread(s), {args.dtype}, "
          f"micro-batch {args.rows}x{args.tokens}, TTT {args.ttt_steps}")
    results = []
    for allocator in ("default", "keep"):  # each in a fresh process: the setting is process-wide
        cmd = [sys.executable, __file__, *(argv if argv is not None else sys.argv[1:]), "--allocator", allocator]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]
        r = json.loads(out)
        results.append(r)
        print(f"  allocator {allocator:8s}: {r['s_per_batch']:.2f} s per micro-batch, {r['tokens_per_s']:.0f} tok/s"
              + ("" if r["applied"] or allocator == "default" else " (setting not available here)"))
    print(f"  keep / default: {results[0]['s_per_batch'] / results[1]['s_per_batch']:.2f}x")
    if args.json:
        args.json.write_text(json.dumps({"cpu": cpu_line(), "torch": torch.__version__, "threads": args.threads,
                                         "dtype": args.dtype, "results": results}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
