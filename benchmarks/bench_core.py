#!/usr/bin/env python
"""Core CPU benchmark for anchorspec, batch 1, SmolLM2-135M-Instruct by default.

(a) Plain decoding: the project's vanilla loop (Engine.generate(..., speculative=False)) against
    Hugging Face `model.generate(do_sample=False)`, on MT-bench first turns, per dtype. The two
    methods alternate per prompt so machine noise hits both alike; only generation is timed.
(b) Building blocks of speculative decoding: one target verification forward on N tree tokens
    after a ~256-token KV context, and one EAGLE-3.1 drafter step (1 token / one 8-token tree
    level) with full and reduced draft vocabularies.

Prints tables and writes everything as JSON (--out). No assertions on speed: figures only.

    ANCHORSPEC_HOME=/tmp/ashome python benchmarks/bench_core.py --out bench_core.json
    ANCHORSPEC_HOME=/tmp/ashome python benchmarks/bench_core.py --limit 3 --max-new-tokens 32 --out /tmp/b.json
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

import anchorspec
from anchorspec import load
from anchorspec.api import Engine, attach_drafter
from anchorspec.bench.runner import frozen_heap
from anchorspec.decode.tree import DraftTree, tree_attention_mask, tree_position_ids
from anchorspec.models.drafter import KVCache, additive_mask, init_drafter, load_drafter
from anchorspec.models.attention import uses_grouped_attention
from anchorspec.models.dtype import cpu_description
from anchorspec.models.packed import is_packed
from anchorspec.models.target import load_target, parse_dtype, stock_twin

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_DATA = os.path.normpath(REPO_ROOT / ".." / "shared" / "data" / "mt_bench" / "question.jsonl")
VERIFY_SIZES = (1, 8, 16, 32, 64)


# --- command line ---------------------------------------------------------------------------------

def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--data", default=DEFAULT_DATA,
                   help="MT-bench question.jsonl (field `turns`; the first turn is used)")
    p.add_argument("--out", required=True, help="where to write the JSON results")
    p.add_argument("--target", default="smollm2-135m-instruct", help="target alias or model directory")
    p.add_argument("--limit", type=int, default=80, help="number of prompts (80 = all MT-bench first turns)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="generation budget per prompt")
    p.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated target/drafter dtypes")
    p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    p.add_argument("--context", type=int, default=256, help="KV context length for part (b)")
    p.add_argument("--repeats", type=int, default=20, help="timed repeats per cell in part (b)")
    p.add_argument("--skip-generate", action="store_true", help="only run part (b)")
    p.add_argument("--skip-forward", action="store_true", help="only run part (a)")
    return p.parse_args(argv)


def model_parser(description: str, dtype: str = "auto", dtypes=None, many_drafters: bool = False) -> argparse.ArgumentParser:
    """The arguments every one-target benchmark takes (one drafter, or `many_drafters` as NAME=DIR); a script
    adds its own."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--target", default="smollm2-135m-instruct")
    if many_drafters:
        p.add_argument("--drafter", action="append", required=True, metavar="NAME=DIR",
                       help="drafter checkpoint directory (repeatable; NAME= optional)")
    else:
        p.add_argument("--drafter", required=True, help="drafter checkpoint directory")
    p.add_argument("--dtype", default=dtype, choices=dtypes)
    p.add_argument("--threads", type=int, default=1)
    return p


def primed_parser(description: str) -> argparse.ArgumentParser:
    """The arguments of a comparison of `generate` set-ups on MT-bench first turns whose engines are first primed
    (session 74's scripts): `primed_prompts` reads the two prompt sets."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--drafter", default="checkpoints/smollm2-135m-instruct-eagle3.1")
    p.add_argument("--data", default="../shared/data/mt_bench/question.jsonl")
    p.add_argument("--limit", type=int, default=24, help="timed prompts (every 3rd from the first)")
    p.add_argument("--prime", type=int, default=12, help="priming prompts, untimed (every 3rd from the second)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--out", required=True)
    return p


def primed_prompts(args) -> tuple[list[str], list[str]]:
    """primed_parser's --threads set (with a warning on a busy machine), then its timed and priming prompts:
    disjoint, both spread over MT-bench's categories."""
    torch.set_num_threads(args.threads)
    warn_if_busy(args.threads)
    return ([q["text"] for q in load_prompts(args.data, args.limit, 3, 0)],
            [q["text"] for q in load_prompts(args.data, args.prime, 3, 1)])


def primed_environment(args, dtype) -> dict:
    """What a primed comparison records beside its figures: the CPU and its vector flags, torch, threads, dtype."""
    cpu = cpu_description()
    return {"cpu": cpu["model"], "flags": [f for f in cpu["flags"] if "avx512" in f or "amx" in f or f == "avx2"],
            "torch": torch.__version__, "threads": args.threads, "dtype": str(dtype), "drafter": args.drafter,
            "args": vars(args)}


def paired_median(rows: list[dict], method: str, baseline: str) -> float:
    """The median over rows (prompts) of `method`'s tokens/s over `baseline`'s in the same row."""
    return statistics.median(r[method]["tok_s"] / r[baseline]["tok_s"] for r in rows)


def method_summary(rows: list[dict], method: str, baseline: str = "plain") -> dict:
    """A method's figures over rows of {method: {"tok_s", "steps", "accepted", "shape" (optional)}}: its median
    tokens/s; the median, least and most of its ratio to `baseline` per row; tau (accepted drafts per verification
    + 1; None for a method that never verified, such as the plain loop); the shapes it drafted."""
    name = baseline.replace("-", "_")
    ratios = [r[method]["tok_s"] / r[baseline]["tok_s"] for r in rows]
    steps = sum(r[method]["steps"] for r in rows)
    return {"median_tok_s": statistics.median(r[method]["tok_s"] for r in rows),
            f"median_vs_{name}": statistics.median(ratios), f"min_vs_{name}": min(ratios),
            f"max_vs_{name}": max(ratios),
            "tau": (sum(r[method]["accepted"] for r in rows) + steps) / steps if steps else None,
            "shapes": sorted({r[method].get("shape") for r in rows} - {None})}


def named_drafters(specs: list[str]) -> list[tuple[str, str]]:
    """(name, directory) for each `--drafter NAME=DIR` of model_parser(many_drafters=True); a bare DIR is
    named after its folder."""
    return [tuple(spec.split("=", 1)) if "=" in spec else (Path(spec).name, spec) for spec in specs]


def target_and_drafter(args):
    """model_parser's --threads set, then its --target and --drafter loaded in --dtype, the drafter in eval mode and
    attached to the target: how a replay benchmark starts."""
    torch.set_num_threads(args.threads)
    dtype = parse_dtype(args.dtype)
    target = load_target(args.target, dtype)
    drafter = load_drafter(args.drafter, dtype).eval()
    attach_drafter(target, drafter)
    return target, drafter


def drafter_parser(description: str) -> argparse.ArgumentParser:
    """model_parser's arguments plus what every one-drafter `generate` benchmark takes."""
    p = model_parser(description)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--out", required=True, help="where to write the JSON results")
    return p


def write_results(path: str, args, body: dict) -> None:
    """`body` with the run's environment, as JSON at `path` (folders made as needed)."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"environment": environment(args), **body}, indent=1) + "\n")
    print(f"wrote {out}")


def greedy_answers(target, data: str, limit: int, answer_tokens: int):
    """Per prompt of `data` (chat template): (prompt + the target's greedy answer, the prompt's length, the target's
    captured states over both): what the replays walk their drafts along (lookup_replay, datastore_replay)."""
    from anchorspec.data.chat import prompt_ids
    from anchorspec.decode.engine import GenerationConfig, generate_vanilla
    from anchorspec.decode.shape import captured_states

    cfg = GenerationConfig(max_new_tokens=answer_tokens, stop_token_ids=tuple(Engine(target).stop_token_ids()))
    for q in tqdm(load_prompts(data, limit), desc="prompts"):
        ids = prompt_ids(target.tokenizer, [{"role": "user", "content": q["text"]}])
        sequence = torch.tensor(ids + generate_vanilla(target, torch.tensor(ids), cfg).token_ids)
        yield sequence, len(ids), captured_states(target, sequence)


def load_prompts(path: str, limit: int, every: int = 1, offset: int = 0) -> list[dict]:
    """First turns, every `every`-th of the file from the `offset`-th (MT-bench lists its 8 categories in
    blocks of 10, so its first 10 are all "writing"; `every=5` takes 2 of each; `every=2, offset=1` the
    half that `every=2` leaves out), at most `limit` of them."""
    rows = []
    with open(path) as f:
        for line in f:
            if line.strip():
                q = json.loads(line)
                rows.append({"id": q.get("question_id", len(rows)), "text": q["turns"][0], "category": q.get("category")})
    return rows[offset::every][:limit]


def prompts_by_category(path: str, per_category: int, keep: str = "all") -> dict[str, list[dict]]:
    """First turns grouped by MT-bench category (in file order), at most `per_category` each; `keep`: "all" or
    a comma-separated list of categories (an unknown one is an error naming the ones there are)."""
    groups: dict[str, list[dict]] = {}
    for q in load_prompts(path, sys.maxsize):
        groups.setdefault(q["category"], []).append(q)
    wanted = list(groups) if keep == "all" else keep.split(",")
    unknown = [c for c in wanted if c not in groups]
    if unknown:
        raise SystemExit(f"no MT-bench category {unknown}; have {sorted(groups)}")
    return {c: groups[c][:per_category] for c in wanted}


# --- small helpers ----------------------------------------------------------------------------------

def median(xs) -> float:
    return statistics.median(xs) if xs else float("nan")


def in_turns(methods: list, i: int) -> list:
    """The methods in the order prompt `i` runs them: rotated by one more each prompt, so that the host's
    speed drifting over a run hits every method alike."""
    return methods[i % len(methods):] + methods[:i % len(methods)]


def rotated_rows(jobs: list[tuple[str, list[int]]], methods: list[str], run, finish=None) -> list[dict]:
    """One row per (workload, prompt ids) job: every method's `run(method, ids)` in in_turns order, then
    `finish(row)` if given; each row printed as JSON once done (session 75's scripts)."""
    rows = []
    for i, (workload, ids) in enumerate(jobs):
        row = {"prompt": i, "workload": workload, "prompt_tokens": len(ids)}
        for m in in_turns(methods, i):
            row[m] = run(m, ids)
        if finish is not None:
            finish(row)
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def identical_to(methods: list[str], baseline: str):
    """A rotated_rows `finish`: each method's output in the row marked identical or not to `baseline`'s, the tokens
    then dropped."""
    def finish(row: dict) -> None:
        for m in methods:
            row[m]["identical"] = row[m].pop("tokens") == row[baseline]["tokens"] if m != baseline else True
        row[baseline].pop("tokens")
    return finish


def primed_run(methods: list[str], run, jobs: list[tuple[str, list[int]]], prime) -> None:
    """Before timing: every method's first call on a short prompt (allocations, kernel choice), `prime()` (the drafter
    engines on their untimed prompts), then every method once over a whole prompt (its shapes compiled)."""
    for m in methods:
        run(m, jobs[0][1][:32])
    prime()
    for m in methods:
        run(m, jobs[-1][1])
    print("primed", flush=True)


def workload_summary(rows: list[dict], methods: list[str], workloads: list[str], reference: str) -> dict:
    """method_summary per workload ("all" first) and method, against the plain loop and against `reference` (another
    method), with the outputs identical to the plain loop's (identical_to); each line printed."""
    summary = {}
    for w in ["all"] + workloads:
        rs = [r for r in rows if w in ("all", r["workload"])]
        for m in methods:
            x = summary[f"{w} | {m}"] = {**method_summary(rs, m), **method_summary(rs, m, reference),
                                         "identical": sum(r[m]["identical"] for r in rs), "prompts": len(rs)}
            print(f"{w:9s} {m:8s} {x['median_tok_s']:6.1f} tok/s  {x['median_vs_plain']:.3f}x plain  "
                  f"{x[f'median_vs_{reference}']:.3f}x {reference} (min {x[f'min_vs_{reference}']:.2f})  tau "
                  f"{'-' if x['tau'] is None else round(x['tau'], 2)}  identical {x['identical']}/{len(rs)}")
    return summary


def timed(fn, *args, **kwargs):
    t0 = time.perf_counter()
    out = fn(*args, **kwargs)
    return out, time.perf_counter() - t0


def time_repeats(fn, repeats: int, warmup: int = 2, after=None, bar: tqdm | None = None) -> float:
    """Median seconds of `fn()` over `repeats` runs; `after()` (untimed) restores state between runs."""
    samples = []
    for i in range(warmup + repeats):
        _, dt = timed(fn)
        if after is not None:
            after()
        if i >= warmup:
            samples.append(dt)
            if bar is not None:
                bar.update(1)
    return median(samples)


# --- (a) vanilla loop vs HF generate ----------------------------------------------------------------

def ours_generate(engine: Engine, ids: list[int], max_new: int) -> list[int]:
    return engine.generate(ids, max_new_tokens=max_new, speculative=False).token_ids


def hf_generate(engine: Engine, ids: list[int], max_new: int) -> list[int]:
    """HF greedy with the engine's stop tokens, so both methods stop at the same place. The engine's target
    must be the stock model (`stock_twin`): HF's loop over the project's packed weights and attention is not
    what users of transformers run, and timing it flattered the baseline 1.5x (session 38)."""
    if is_packed(engine.target.model) or uses_grouped_attention(engine.target.model):
        raise ValueError("hf_generate times Hugging Face as users get it: pass an Engine over stock_twin(target, ...)")
    x = torch.tensor([ids])
    stop = list(engine.stop_token_ids())
    out = engine.target.model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new,
                                       do_sample=False, eos_token_id=stop, pad_token_id=stop[0])
    # batch 1: no padding after eos, so everything past the prompt is new tokens (eos included,
    # like the project's loop, which also returns the stop token as its last token)
    return out[0, len(ids):].tolist()


METHODS = {"ours": ours_generate, "hf": hf_generate}


def bench_generation(engine: Engine, stock: Engine, prompts: list[dict], encoded: list[list[int]], max_new: int,
                     dtype: str) -> dict:
    """The project's plain loop on `engine` against HF `generate` on `stock` (the target as transformers loads it)."""
    engines = {"ours": engine, "hf": stock}
    for name, fn in METHODS.items():  # warm-up: first-call allocations, oneDNN kernel selection
        fn(engines[name], encoded[0], max_new)

    per_prompt = []
    bar = tqdm(list(zip(prompts, encoded)), desc=f"(a) generate {dtype}", unit="prompt", dynamic_ncols=True)
    with frozen_heap():  # each gc.collect() below walks only what the runs made
        for i, (prompt, ids) in enumerate(bar):
            # alternate which method goes first, so neither always runs on a warmer cache/CPU clock
            order = ("ours", "hf") if i % 2 == 0 else ("hf", "ours")
            row = {"id": prompt["id"], "prompt_tokens": len(ids)}
            for name in order:
                gc.collect()  # a collection inside a timed region would hit one method only
                tokens, dt = timed(METHODS[name], engines[name], ids, max_new)
                row[name] = {"new_tokens": len(tokens), "seconds": dt, "tokens_per_s": len(tokens) / dt,
                             "token_ids": tokens}
            row["ratio"] = row["ours"]["tokens_per_s"] / row["hf"]["tokens_per_s"]
            row["identical"] = row["ours"]["token_ids"] == row["hf"]["token_ids"]
            per_prompt.append(row)
            bar.set_postfix(ratio=f"{median([r['ratio'] for r in per_prompt]):.3f}",
                            mismatches=sum(not r["identical"] for r in per_prompt))
    return summarize_generation(per_prompt)


def summarize_generation(rows: list[dict]) -> dict:
    summary = {
        name: {
            "median_tokens_per_s": median([r[name]["tokens_per_s"] for r in rows]),
            "total_new_tokens": sum(r[name]["new_tokens"] for r in rows),
            "total_seconds": sum(r[name]["seconds"] for r in rows),
        }
        for name in METHODS
    }
    return {
        **summary,
        "median_ratio_ours_over_hf": median([r["ratio"] for r in rows]),
        "mismatches": sum(not r["identical"] for r in rows),
        "mismatched_ids": [r["id"] for r in rows if not r["identical"]],
        "prompts": len(rows),
        "per_prompt": [{k: ({kk: vv for kk, vv in v.items() if kk != "token_ids"} if isinstance(v, dict) else v)
                        for k, v in r.items()} for r in rows],
    }


# --- (b) cost of one verification forward and one drafter step -------------------------------------

def context_ids(encoded: list[list[int]], n: int) -> torch.Tensor:
    """n real tokens (prompts concatenated, cycled if too few) rather than random ids."""
    flat = [t for ids in encoded for t in ids]
    while len(flat) < n:
        flat = flat + flat
    return torch.tensor(flat[:n], dtype=torch.long)


def simple_tree(n: int) -> DraftTree:
    """A 4-ary tree of n nodes (node i's parent is (i-1)//4): tree-shaped mask, depth ~log4(n)."""
    return DraftTree(torch.arange(100, 100 + n), [-1] + [(i - 1) // 4 for i in range(1, n)])


@torch.inference_mode()  # as in the engine: cache surgery on inference tensors
def bench_verify(engine: Engine, ctx: torch.Tensor, repeats: int, dtype: str) -> dict:
    target = engine.target
    past = ctx.numel()
    cache = target.new_cache()
    target.forward(ctx, torch.arange(past), cache, last_only=True)
    rollback = lambda: cache.crop(past - cache.get_seq_length())  # noqa: E731 - drop every row after the context

    cells = {}
    bar = tqdm(total=repeats * (len(VERIFY_SIZES) + 1), desc=f"(b) verify {dtype}", unit="fwd",
               dynamic_ncols=True, leave=False)
    # the vanilla decode step: one token, no mask, no aux capture (what generate_vanilla runs)
    one = torch.tensor([int(ctx[-1])])
    cells["vanilla_1"] = time_repeats(lambda: target.forward(one, torch.tensor([past]), cache),
                                      repeats, after=rollback, bar=bar)
    for n in VERIFY_SIZES:
        # exactly what generate_speculative runs per step: tree mask, tree positions, aux capture
        tree = simple_tree(n)
        mask = tree_attention_mask(tree, past, target.dtype)
        pos = tree_position_ids(tree, past)
        cells[f"tree_{n}"] = time_repeats(
            lambda: target.forward(tree.tokens, pos, cache, attention_mask=mask, capture_aux=True),
            repeats, after=rollback, bar=bar)
    bar.close()
    return cells


def filled_drafter_cache(engine: Engine, drafter, ctx: torch.Tensor) -> KVCache:
    """Drafter KV holding len(ctx)-1 real-feature positions (feature t pairs with token t+1)."""
    out = engine.target.forward(ctx, torch.arange(ctx.numel()), engine.target.new_cache(),
                                capture_aux=True, last_only=True)
    cache = KVCache()
    n = ctx.numel() - 1
    feats = drafter.project_features(out.aux[:n]).unsqueeze(0)
    drafter.step(ctx[1:].view(1, -1), feats, torch.arange(n).view(1, -1), cache)
    return cache


@torch.inference_mode()
def bench_drafter(engine: Engine, ctx: torch.Tensor, repeats: int, dtype: str) -> dict:
    target = engine.target
    torch_dtype = target.dtype
    cells = {}
    vocabs = {"full": None, "16384": 16384}
    bar = tqdm(total=repeats * 2 * len(vocabs), desc=f"(b) drafter {dtype}", unit="step",
               dynamic_ncols=True, leave=False)
    for label, dvs in vocabs.items():
        drafter = init_drafter(target.config, "eagle3.1", draft_vocab_size=dvs).to(torch_dtype)
        attach_drafter(target, drafter)  # shares the target embedding, sets the aux layers
        # context of context+1 tokens so the drafter ends up with exactly `context` rows
        cache = filled_drafter_cache(engine, drafter, torch.cat([ctx, ctx[-1:]]))
        n = cache.length
        H = drafter.config.hidden_size
        x1 = torch.randn(1, 1, H, dtype=torch_dtype)
        tok1 = ctx[-1:].view(1, 1)
        # one tree level of 8 siblings (all at the same depth): context + itself, like EagleProposer._tree
        k = 8
        allowed = torch.cat([torch.ones(k, n, dtype=torch.bool), torch.eye(k, dtype=torch.bool)], dim=1)
        mask8 = additive_mask(allowed, torch_dtype)[None, None]
        x8 = torch.randn(1, k, H, dtype=torch_dtype)
        tok8 = ctx[-k:].view(1, k)
        pos8 = torch.full((1, k), n)
        rollback = lambda: cache.crop(n)  # noqa: E731

        cells[f"{label}_1"] = time_repeats(lambda: drafter.step(tok1, x1, torch.tensor([[n]]), cache),
                                           repeats, after=rollback, bar=bar)
        cells[f"{label}_8"] = time_repeats(lambda: drafter.step(tok8, x8, pos8, cache, mask8),
                                           repeats, after=rollback, bar=bar)
        cells[f"{label}_draft_vocab"] = drafter.config.draft_vocab_size
    bar.close()
    return cells


# --- reporting --------------------------------------------------------------------------------------

def print_generation(dtype: str, g: dict) -> None:
    print(f"\n(a) plain decoding, {dtype}, {g['prompts']} prompts")
    print(f"  {'method':<28}{'median tok/s':>14}{'new tokens':>12}{'total s':>10}")
    for name, label in (("ours", "anchorspec generate_vanilla"), ("hf", "HF model.generate")):
        s = g[name]
        print(f"  {label:<28}{s['median_tokens_per_s']:>14.2f}{s['total_new_tokens']:>12d}{s['total_seconds']:>10.1f}")
    print(f"  median per-prompt ratio ours/HF: {g['median_ratio_ours_over_hf']:.3f}")
    print(f"  token-id mismatches ours vs HF: {g['mismatches']}/{g['prompts']}"
          + (f" (question ids {g['mismatched_ids']})" if g["mismatches"] else ""))


def print_costs(dtype: str, verify: dict, drafter: dict, context: int) -> None:
    ref = verify["tree_1"]
    print(f"\n(b) cost per call, {dtype}, {context}-token context, median ms (x = ratio to the 1-token verify forward)")
    print("    verify = one target forward over a 4-ary draft tree; drafter = random-init EAGLE-3.1, one step")
    print(f"  {'call':<46}{'ms':>9}{'x':>8}")
    rows = [("target forward, 1 token, no mask (vanilla step)", verify["vanilla_1"])]
    rows += [(f"target verify, {n} tree tokens (4-D mask, aux)", verify[f"tree_{n}"]) for n in VERIFY_SIZES]
    for label in ("full", "16384"):
        v = drafter[f"{label}_draft_vocab"]
        rows += [(f"drafter step, 1 token, draft vocab {v}", drafter[f"{label}_1"]),
                 (f"drafter step, 8-token level, draft vocab {v}", drafter[f"{label}_8"])]
    for name, s in rows:
        print(f"  {name:<46}{s * 1e3:>9.2f}{s / ref:>8.2f}")


def cpu_model() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def environment(args) -> dict:
    return {
        "anchorspec": anchorspec.__version__, "torch": torch.__version__,
        "transformers": __import__("transformers").__version__, "python": platform.python_version(),
        "machine": platform.machine(), "cpu": cpu_model(), "cpu_count": os.cpu_count(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(), "threads": torch.get_num_threads(),
        "loadavg_at_start": os.getloadavg(), "args": vars(args),
    }


def warn_if_busy(threads: int) -> None:
    """OpenMP threads spin-wait for each other: with fewer idle cores than threads, every op waits
    on a descheduled thread and timings get 10-30x worse, so say so up front."""
    load1 = os.getloadavg()[0]
    if load1 + threads > (os.cpu_count() or 1) + 0.5:
        print(f"warning: load average {load1:.1f} with {threads} threads on {os.cpu_count()} CPUs; "
              "the machine is busy and timings will be noisy (try a quiet machine or fewer --threads)",
              file=sys.stderr)


# --- main -------------------------------------------------------------------------------------------

def run_dtype(args, dtype: str, prompts: list[dict]) -> dict:
    engine = load(args.target, dtype=dtype)
    encoded = [engine.encode(p["text"], chat=True) for p in prompts]
    result = {}
    if not args.skip_generate:
        stock = Engine(stock_twin(engine.target, args.target, engine.target.dtype))
        result["generation"] = bench_generation(engine, stock, prompts, encoded, args.max_new_tokens, dtype)
        print_generation(dtype, result["generation"])
    if not args.skip_forward:
        ctx = context_ids(encoded, args.context)
        verify = bench_verify(engine, ctx, args.repeats, dtype)
        drafter = bench_drafter(engine, ctx, args.repeats, dtype)
        result["verify_forward_s"] = verify
        result["drafter_step_s"] = drafter
        result["ratios_to_verify_1"] = {k: v / verify["tree_1"] for k, v in {**verify, **drafter}.items()
                                        if not k.endswith("draft_vocab")}
        print_costs(dtype, verify, drafter, args.context)
    return result


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    from transformers.utils import logging as hf_logging
    hf_logging.set_verbosity_error()  # generation-config chatter would break the progress bars

    warn_if_busy(args.threads)
    prompts = load_prompts(args.data, args.limit)
    if not prompts:
        sys.exit(f"no prompts in {args.data}")
    results = {"environment": environment(args), "results": {}}
    for dtype in [d.strip() for d in args.dtypes.split(",") if d.strip()]:
        results["results"][dtype] = run_dtype(args, dtype, prompts)
        gc.collect()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
