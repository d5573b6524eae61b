"""One decoding step, timed: the project's plain step and tree verification against Hugging Face, and
the memory floor they both sit above.

    python benchmarks/bench_step.py --threads 1 --dtypes float32,bfloat16 [--target smollm2-135m-instruct]
        [--context 256] [--sizes 1,4,8,16,32] [--repeats 15] [--new-tokens 64] [--drafter DIR] [--json FILE]

Per dtype it prints:
  - the memory floor of a decode step: weight bytes / bandwidth, the bandwidth measured here by
    copying a large tensor (bytes read + bytes written, per second), at the same thread count;
  - ms per forward over N new tokens after `--context` tokens: the project's path (batch_forward on
    a one-slot KV cache, as a solo generation runs it; N > 1 with the tree mask and aux capture that
    verification uses) and the plain HF model call (causal, DynamicCache), median of `--repeats`;
  - end to end, greedy, `--new-tokens` from a chat prompt (padded to `--prompt-tokens`): HF
    `generate`, the project's plain loop, and with `--drafter` the speculative loop: now (measured
    shape, fallback on), without the fallback, and with the fixed 4,4,16 tree and no fallback;
    tokens/s, same run, alternating. HF runs the stock weights; the project's target prepacks them
    where the probe measured that faster (`--pack`). `--compile` adds the plain loop on a compiled
    target (Target.compile), timed after the others, its first call (tracing, compiling) reported apart.
CPU model, flags, torch version, threads and dtype are printed with the numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from anchorspec.api import DEFAULT_TREE, Engine, load  # noqa: E402
from anchorspec.decode.engine import GenerationConfig, generate_speculative, generate_vanilla  # noqa: E402
from anchorspec.decode.shape import verify_cost  # noqa: E402
from anchorspec.models.packed import is_packed  # noqa: E402
from anchorspec.models.target import load_target, stock_twin  # noqa: E402

PROMPT = "Explain in a few sentences why the sky is blue."
FILLER = "The quick brown fox jumps over the lazy dog while the sun sets behind the quiet hills. "


def cpu_description() -> dict:
    flags, model = set(), platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and not model:
                model = line.split(":", 1)[1].strip()
            elif line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    wanted = sorted(f for f in flags if f.startswith(("avx512", "amx")) or f in ("avx2", "fma", "f16c"))
    return {"cpu": model, "flags": wanted, "torch": torch.__version__, "threads": torch.get_num_threads(),
            "capability": torch.backends.cpu.get_cpu_capability()}


def bandwidth_gbs(mib: int = 512, repeats: int = 5) -> float:
    """Bytes read + written per second by a large tensor copy (median), in GB/s."""
    src = torch.ones(mib * 2**20 // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    return 2 * src.numel() * 4 / statistics.median(times) / 1e9


def weight_bytes(model) -> int:
    """Bytes a decode step must read: every parameter once (tied embeddings count once; pass the stock,
    unpacked model)."""
    seen, total = set(), 0
    for p in model.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel() * p.element_size()
    return total


def _median_ms(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


@torch.inference_mode()
def step_costs(engine: Engine, stock, context: int, sizes: list[int], repeats: int) -> dict:
    """ms per forward of N new tokens after `context`: the project's path (decode/shape.verify_cost,
    what the drift monitor calibrates with) and the plain HF call on the stock model."""
    target = engine.target
    ids = torch.arange(context) % target.vocab_size
    verify, plain = verify_cost(target, context, [n for n in sizes if n > 1], repeats)
    ours = {n: (plain if n == 1 else verify[n]) * 1e3 for n in sizes}
    hf = {}
    cache = stock.new_cache()
    stock.model(input_ids=ids[None], use_cache=True, past_key_values=cache)
    for n in sizes:
        tokens = torch.arange(n) % target.vocab_size

        def plain_hf(tokens=tokens):
            stock.model(input_ids=tokens[None], past_key_values=cache, use_cache=True)
            cache.crop(-tokens.numel())  # drop the rows just appended

        hf[n] = _median_ms(plain_hf, repeats)
    return {"project_ms": ours, "hf_model_ms": hf}


def prompt_ids(engine: Engine, prompt_tokens: int) -> list[int]:
    """The chat prompt every end-to-end method decodes, padded with filler to about `prompt_tokens`."""
    text = PROMPT
    while prompt_tokens and len(engine.encode(text, chat=True)) < prompt_tokens:
        text = FILLER + text  # a long context: what DynamicCache's per-step concatenation pays for
    return engine.encode(text, chat=True)


def end_to_end(engine: Engine, stock, ids: list[int], new_tokens: int, rounds: int, drafter: bool) -> dict:
    """tokens/s of HF generate, the plain loop and, with a drafter, the speculative loop with the
    fixed DEFAULT_TREE and no fallback, and now (the measured shape and the fallback); alternating,
    `rounds` generations each."""
    stop = engine.stop_token_ids()
    cfg = GenerationConfig(max_new_tokens=new_tokens)  # no stop tokens: every method makes new_tokens
    x = torch.tensor([ids])

    def hf():
        out = stock.model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=new_tokens,
                                           min_new_tokens=new_tokens, do_sample=False, pad_token_id=stop[0])
        return out.shape[1] - x.shape[1]

    methods = {"hf_generate": hf, "project_plain": lambda: len(generate_vanilla(engine.target, ids, cfg).token_ids)}
    if drafter:
        shape = engine.shape

        methods["project_spec"] = lambda: len(
            generate_speculative(engine.target, engine.proposer, ids, cfg, shape, engine.monitor).token_ids)
        methods["project_spec_no_fallback"] = lambda: len(
            generate_speculative(engine.target, engine.proposer, ids, cfg, shape).token_ids)
        methods["project_spec_fixed_tree"] = lambda: len(
            generate_speculative(engine.target, engine.proposer, ids, cfg, DEFAULT_TREE).token_ids)
    for fn in methods.values():  # warm-up
        fn()
    spent = {name: [0, 0.0] for name in methods}
    for _ in range(rounds):
        for name, fn in methods.items():
            t0 = time.perf_counter()
            n = fn()
            spent[name][1] += time.perf_counter() - t0
            spent[name][0] += n
    out = {name: tokens / seconds for name, (tokens, seconds) in spent.items()}
    out["prompt_tokens"] = len(ids)
    if drafter:
        out["shape"] = f"{shape.top_k},{shape.depth},{shape.total_tokens} ({engine.shape_source})"
    return out


def compiled_loop(target, ids: list[int], new_tokens: int, rounds: int) -> dict:
    """tokens/s of the plain loop on a compiled target (Target.compile), and the first call's seconds
    (tracing and compiling the step) kept apart from the timed rounds."""
    cfg = GenerationConfig(max_new_tokens=new_tokens)
    t0 = time.perf_counter()
    generate_vanilla(target, ids, cfg)
    first = time.perf_counter() - t0
    tokens, seconds = 0, 0.0
    for _ in range(rounds):
        t0 = time.perf_counter()
        tokens += len(generate_vanilla(target, ids, cfg).token_ids)
        seconds += time.perf_counter() - t0
    return {"project_plain_compiled": tokens / seconds, "compile_first_call_s": first}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--drafter", help="also time the speculative loop with this drafter")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--context", type=int, default=256, help="tokens already in the cache")
    ap.add_argument("--sizes", default="1,4,8,16,32", help="new tokens per timed forward")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3, help="end-to-end generations per method")
    ap.add_argument("--prompt-tokens", type=int, default=0, help="pad the end-to-end prompt to about this many tokens")
    ap.add_argument("--pack", default=None, choices=["auto", "on", "off"],
                    help="prepack the project's target weights for oneDNN (default: $ANCHORSPEC_PACK or auto); "
                         "the HF baseline always runs the stock weights")
    ap.add_argument("--compile", action="store_true", help="also time the project's loop with the target compiled")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    sizes = [int(s) for s in args.sizes.split(",")]
    report = {"machine": cpu_description(), "bandwidth_gbs": bandwidth_gbs(), "context": args.context, "runs": {}}
    m = report["machine"]
    print(f"CPU {m['cpu']} ({m['capability']}; {' '.join(m['flags'])}), torch {m['torch']}, {m['threads']} thread(s)")
    print(f"memory bandwidth (copy, read + write): {report['bandwidth_gbs']:.1f} GB/s")
    for dtype in args.dtypes.split(","):
        engine = load(args.target, args.drafter, dtype=dtype, threads=args.threads, pack=args.pack)
        stock = stock_twin(engine.target, args.target, engine.target.dtype)
        packed = is_packed(engine.target.model)
        size = weight_bytes(stock.model)
        floor_ms = size / (report["bandwidth_gbs"] * 1e9) * 1e3
        costs = step_costs(engine, stock, args.context, sizes, args.repeats)
        ids = prompt_ids(engine, args.prompt_tokens)
        e2e = end_to_end(engine, stock, ids, args.new_tokens, args.rounds, args.drafter is not None)
        if args.compile:
            compiled = load_target(args.target, dtype, pack="off")
            compiled.compile()
            e2e.update(compiled_loop(compiled, ids, args.new_tokens, args.rounds))
        report["runs"][dtype] = {"weight_mb": size / 1e6, "floor_ms": floor_ms, "packed": packed, **costs,
                                 "end_to_end_tok_s": e2e}
        print(f"\n{dtype}{' (weights prepacked)' if packed else ''}: weights {size / 1e6:.0f} MB -> memory floor "
              f"{floor_ms:.1f} ms/token ({1e3 / floor_ms:.0f} tok/s)")
        print("| new tokens | project ms | HF model ms | project / plain step |")
        print("|---|---|---|---|")
        for n in sizes:
            ratio = costs["project_ms"][n] / costs["project_ms"][sizes[0]]
            print(f"| {n} | {costs['project_ms'][n]:.1f} | {costs['hf_model_ms'][n]:.1f} | {ratio:.2f} |")
        print(f"end to end, {e2e['prompt_tokens']}-token prompt, {args.new_tokens} new tokens, greedy: "
              + ", ".join(f"{k} {v:.1f} tok/s" if isinstance(v, float) and not k.endswith("_s") else
                          f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}" for k, v in e2e.items())
              + f"; project plain / HF generate = {e2e['project_plain'] / e2e['hf_generate']:.2f}x")
        del engine, stock
    if args.json:  # atomic: a reader never sees half a file
        tmp = Path(args.json).with_suffix(".tmp")
        tmp.write_text(json.dumps(report, indent=1) + "\n")
        os.replace(tmp, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
