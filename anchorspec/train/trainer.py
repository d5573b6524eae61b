"""The TTT trainer: data -> online target features -> drafter update, with evaluation by acceptance.

One optimizer step consumes ``grad_accum x world_size`` micro-batches; micro-batch number
``(step * grad_accum + a) * world_size + rank`` goes to rank ``rank`` at accumulation round ``a``.
The batch order is a pure function of the seed (``dataset.BatchStream``), so a resumed job and a
job on N ranks see exactly the batches of an uninterrupted single-process job with the same global
batch.

Output directory:
    run.json              config, data and vocabulary figures (what was trained on)
    metrics.jsonl         one line per logged step / evaluation
    training.png          loss and learning rate, per-step accuracy and tau over steps
    best/                 the drafter with the best measured acceptance (not the lowest loss)
    final/                the drafter after the last step
    checkpoints/step-N/   resumable state (drafter + optimizer + scheduler), `latest` names the newest
"""

from __future__ import annotations

import copy
import json
import math
import os
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from anchorspec.errors import AnchorspecError

from ..data.chat import DROP, KEEP
from ..allocator import active_allocator, malloc_mode
from ..atomic import atomic_write
from ..models.drafter import Eagle3Drafter, deepen, init_drafter, layer_from_target, load_drafter, save_drafter
from ..models.dtype import argmax_last, resolve_device
from ..models.packed import is_packed
from ..models.target import Target, decoder_layers, load_target, parse_dtype
from ..data.chat import first_answer
from ..data.corpus import is_corpus, read_corpus
from ..data.readers import jsonl_lines
from .dataset import BatchStream, DataStats, Example, collate, epoch_batches, keep_fitting, read_conversations, \
    join_examples, split_heldout, tokenize_conversations
from .ttt import compile_loss, ttt_forward
from .vocab import count_loss_tokens, coverage, head_map, remap_head_rows, select_draft_vocab

# Changing any of these changes the training trajectory, so --resume refuses a different value.
TRAJECTORY_FIELDS = ("target", "data", "variant", "ttt_steps", "draft_vocab_size", "max_len", "lr", "warmup_ratio",
                     "betas", "weight_decay", "grad_clip", "batch_tokens", "grad_accum", "dtype", "seed", "heldout",
                     "system", "aux_layers", "epochs", "max_steps", "feature_cache", "init_from", "init_head",
                     "init_layer", "revocab", "draft_layers", "attn_align", "stage", "accept_slots", "order_seed",
                     "join_to", "join_share")
# Trajectory fields added later: a run.json written before them ran with these values.
FIELD_DEFAULTS = {"init_layer": "random", "draft_layers": 1, "attn_align": 0.0, "stage": "distill", "accept_slots": 16,
                  "order_seed": None, "join_to": None, "join_share": 0.5}
STAGES = ("distill", "accept")
DEFAULT_DRAFT_VOCAB = 16384


@dataclass
class TrainConfig:
    target: str
    data: list[str]
    out: str
    variant: str | None = "eagle3.1"  # None: the --init-from drafter's, else eagle3.1
    ttt_steps: int = 7
    draft_vocab_size: int | None = DEFAULT_DRAFT_VOCAB  # capped at the target vocabulary; None: --init-from's
    init_from: str | None = None  # a drafter directory to continue from (its weights and draft vocabulary)
    init_head: str = "random"  # random | target: lm_head rows and final norm copied from the target's head
    init_layer: str = "random"  # random | target: the decoder layer starts as the target's last (layer_from_target)
    revocab: bool = False  # with init_from: re-select the draft vocabulary from this data (draft_vocab_size: resize)
    draft_layers: int | None = None  # decoder layers: None = 1 for a new drafter, or --init-from's
    attn_align: float = 0.0  # weight of the attention-alignment loss (train/attn_align.py); 0 = off
    stage: str = "distill"  # distill (TTT) | accept (expected accepted length, train/accept.py; needs init_from)
    accept_slots: int = 16  # stage accept: drafted chains scored per sequence
    max_len: int = 2048
    join_to: int | None = None  # chain training examples into multi-turn sequences of up to this many tokens
    join_share: float = 0.5  # with join_to: the share of training examples that are chained
    epochs: int | None = None
    max_steps: int | None = None
    lr: float = 1e-4
    warmup_ratio: float = 0.015
    betas: tuple[float, float] = (0.9, 0.95)
    weight_decay: float = 0.0
    grad_clip: float = 0.5
    batch_tokens: int = 4096  # rows x longest row per micro-batch
    grad_accum: int = 1
    dtype: str = "bfloat16"  # target dtype and autocast dtype; masters stay fp32 (fp64 for float64)
    seed: int = 0
    order_seed: int | None = None  # the batch order's seed (None: seed); the held-out split stays keyed by seed
    heldout: float = 0.02
    system: str = "keep"  # keep | drop | vary
    system_choices: list | None = None  # for system="vary"; None entries = no system prompt
    aux_layers: list[int] | None = None
    log_every: int = 10
    eval_every: int = 100
    save_every: int = 100
    eval_prompts: int = 4  # held-out prompts answered by real speculative generation
    eval_new_tokens: int = 64
    eval_replay: int = 16  # held-out answers walked with the default tree (decode.shape.replay): the real tau, no noise
    eval_heldout: int = 0  # held-out conversations the accuracy scores (0 = all; else that many, spread over the set)
    feature_cache: str | None = None  # directory of the offline cache (built on first use); None = online
    compile_loss: bool = False  # inductor-fused cross-entropy kernels (ttt.compile_loss): same loss, faster
    device: str = "cpu"  # where the target and the drafter train: cpu, cuda[:N] or auto (models.dtype.resolve_device)
    resume: bool = False
    progress: bool = True

    def validate(self) -> None:
        for part, value in (("head", self.init_head), ("layer", self.init_layer)):  # --init-head, --init-layer
            if value not in ("random", "target"):
                raise AnchorspecError(f"--init-{part} must be random or target, got {value!r}")
            if self.init_from is not None and value != "random":
                raise AnchorspecError(f"--init-{part} applies to a new drafter; --init-from keeps the drafter's own {part}")
        if self.revocab and self.init_from is None:
            raise AnchorspecError("--revocab re-selects a continued drafter's vocabulary: it needs --init-from")
        if self.init_from is None:  # flags left out: a new drafter's defaults
            self.variant = self.variant or "eagle3.1"
            self.draft_vocab_size = self.draft_vocab_size or DEFAULT_DRAFT_VOCAB
            self.draft_layers = 1 if self.draft_layers is None else self.draft_layers
        if self.draft_layers is not None and self.draft_layers < 1:
            raise AnchorspecError(f"--draft-layers must be >= 1, got {self.draft_layers}")
        if self.variant is not None and self.variant not in ("eagle3", "eagle3.1"):
            raise AnchorspecError(f"--variant must be eagle3 or eagle3.1, got {self.variant!r}")
        if (self.epochs is None) == (self.max_steps is None):
            raise AnchorspecError("give exactly one of --epochs and --max-steps")
        for name in ("ttt_steps", "max_len", "batch_tokens", "grad_accum", "log_every", "eval_every", "save_every",
                     "eval_new_tokens"):
            if getattr(self, name) < 1:
                raise AnchorspecError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.join_to is not None:
            if not 0 < self.join_share <= 1:
                raise AnchorspecError(f"--join-share must be in (0, 1], got {self.join_share}")
            if self.join_to > self.batch_tokens:
                raise AnchorspecError(f"--join-to {self.join_to} is longer than --batch-tokens {self.batch_tokens} "
                                      "(a joined sequence is one row of a micro-batch)")
            if self.feature_cache:
                raise AnchorspecError("--join-to makes new sequences the feature cache does not hold; "
                                      "use online features: drop --feature-cache")
        if self.epochs is not None and self.epochs < 1:
            raise AnchorspecError(f"--epochs must be >= 1, got {self.epochs}")
        if self.max_steps is not None and self.max_steps < 1:
            raise AnchorspecError(f"--max-steps must be >= 1, got {self.max_steps}")
        if not self.lr > 0:
            raise AnchorspecError(f"--lr must be > 0, got {self.lr}")
        if not 0 <= self.warmup_ratio < 1:
            raise AnchorspecError(f"--warmup-ratio must be in [0, 1), got {self.warmup_ratio}")
        if not 0 < self.heldout < 1:
            raise AnchorspecError(f"--heldout must be in (0, 1), got {self.heldout}")
        if self.system not in ("keep", "drop", "vary"):
            raise AnchorspecError(f"--system must be keep, drop or vary, got {self.system!r}")
        if self.system == "vary" and not self.system_choices:
            raise AnchorspecError("--system vary needs system prompt choices")
        if not self.attn_align >= 0:
            raise AnchorspecError(f"--attn-align must be >= 0, got {self.attn_align}")
        if self.attn_align and self.feature_cache:
            raise AnchorspecError("--attn-align needs online target features: the feature cache stores no attention "
                                  "maps (drop --feature-cache)")
        if self.stage not in STAGES:
            raise AnchorspecError(f"--stage must be {' or '.join(STAGES)}, got {self.stage!r}")
        if self.stage == "accept":
            if self.init_from is None:
                raise AnchorspecError("--stage accept is a second stage: give the distilled drafter with --init-from")
            if self.feature_cache:
                raise AnchorspecError("--stage accept runs the target on the drafter's own drafts: drop --feature-cache")
            if self.attn_align:
                raise AnchorspecError("--attn-align applies to the distillation stage, not --stage accept")
        if self.accept_slots < 1:
            raise AnchorspecError(f"--accept-slots must be >= 1, got {self.accept_slots}")
        for name in ("eval_prompts", "eval_replay", "eval_heldout"):
            if getattr(self, name) < 0:
                raise AnchorspecError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(self, name)}")


def lr_factor(step: int, total: int, warmup: int) -> float:
    """Linear warmup to 1, then cosine decay to 0 at `total` (the multiplier of the peak lr)."""
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


def simulated_tau(acc_per_step) -> float:
    """Expected tokens per chain step if step k is accepted with probability acc_k given all earlier
    ones were: 1 + sum_k prod_{i<=k} acc_i (the bonus token plus the expected accepted drafts)."""
    tau, run = 1.0, 1.0
    for a in acc_per_step:
        run *= float(a)
        tau += run
    return tau


class AcceptObjective(nn.Module):
    """The drafter with the stage-accept loss (train/accept.py) as its forward; the target scores the
    drafts (held outside the module's parameters: it is frozen and not DDP's to synchronise)."""

    def __init__(self, drafter: Eagle3Drafter, target: Target, steps: int, slots: int):
        super().__init__()
        self.drafter = drafter
        object.__setattr__(self, "target", target)
        self.steps = steps
        self.slots = slots

    def forward(self, aux, input_ids, target_logits, loss_mask, padding_mask):
        """(loss = -mean expected accepted length, loss per depth, acceptance per depth, counts, mean E)."""
        from .accept import accept_objective, depth_figures

        out = accept_objective(self.drafter, self.target, aux, input_ids, target_logits, loss_mask, padding_mask,
                               self.steps, self.slots)
        loss_k, acc_k, valid_k = depth_figures(out, self.steps)
        return out["loss"], loss_k, acc_k, valid_k, -out["loss"].detach()


class TTTObjective(nn.Module):
    """The drafter with the TTT loss as its forward, so DistributedDataParallel can wrap it."""

    def __init__(self, drafter: Eagle3Drafter, steps: int, attn_align: float = 0.0):
        super().__init__()
        self.drafter = drafter
        self.steps = steps
        self.attn_align = attn_align

    def forward(self, aux, input_ids, target_logits, loss_mask, padding_mask, target_in_draft=None, target_attn=None):
        """(loss, loss per step, accuracy per step, valid counts, attention-alignment term or 0)."""
        out = ttt_forward(self.drafter, aux, input_ids, target_logits, loss_mask, self.steps, padding_mask,
                          target_in_draft=target_in_draft, target_attn=target_attn, attn_align=self.attn_align)
        attn = out.attn_loss.detach() if out.attn_loss is not None else out.loss.new_zeros(())
        return out.loss, out.loss_per_step, out.acc_per_step, out.valid_per_step, attn


@dataclass
class _Dist:
    rank: int = 0
    world: int = 1

    @property
    def main(self) -> bool:
        return self.rank == 0

    @classmethod
    def from_env(cls) -> "_Dist":
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world <= 1:
            return cls()
        if not dist.is_initialized():
            import datetime

            # Rank 0 alone builds the feature cache while the others wait: allow a long barrier.
            hours = float(os.environ.get("ANCHORSPEC_DIST_TIMEOUT_H", "12"))
            dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo",
                                    timeout=datetime.timedelta(hours=hours))
        return cls(dist.get_rank(), dist.get_world_size())

    def all_sum(self, t: torch.Tensor) -> torch.Tensor:
        if self.world > 1:
            if dist.get_backend() == "nccl":  # nccl reduces GPU tensors only
                moved = t.cuda()
                dist.all_reduce(moved)
                return moved.to(t.device)
            dist.all_reduce(t)
        return t

    def barrier(self) -> None:
        if self.world > 1:
            dist.barrier()


@dataclass
class _Accum:
    """Loss and accuracy sums over the micro-batches of a logging window (weighted by valid counts)."""
    loss: float = 0.0
    batches: int = 0
    tokens: int = 0
    correct: torch.Tensor | None = None
    valid: torch.Tensor | None = None
    loss_k: torch.Tensor | None = None
    extra: float = 0.0  # sum of the objective's 5th output: the attn-align KL, or stage accept's mean E

    def add(self, loss, loss_k, acc_k, valid_k, tokens, extra=None):
        c = (acc_k.detach().double() * valid_k.double())
        lk = loss_k.detach().double() * valid_k.double()
        self.correct = c if self.correct is None else self.correct + c
        self.valid = valid_k.double() if self.valid is None else self.valid + valid_k.double()
        self.loss_k = lk if self.loss_k is None else self.loss_k + lk
        self.loss += float(loss.detach())
        self.extra += 0.0 if extra is None else float(extra)
        self.batches += 1
        self.tokens += int(tokens)


def _system_arg(cfg: TrainConfig):
    return {"keep": KEEP, "drop": DROP, "vary": None}[cfg.system]


def prepare_data(cfg: TrainConfig, tokenizer) -> tuple[list[Example], DataStats]:
    stats = DataStats()
    examples: list[Example] = []
    for path in cfg.data:
        before = stats.examples
        if is_corpus(path):  # already rendered token ids (a released corpus): only the length rule applies
            if cfg.system != "keep":
                raise AnchorspecError(f"{path} is a corpus of rendered token ids; --system {cfg.system} needs "
                                      f"conversations (JSONL) to re-render")
            examples += keep_fitting(read_corpus(path, len(tokenizer)), cfg.max_len, stats)
        else:
            convs = read_conversations(path)
            examples += tokenize_conversations(tokenizer, convs, cfg.max_len, _system_arg(cfg) or KEEP,
                                               cfg.system_choices if cfg.system == "vary" else None, cfg.seed, stats)
        stats.per_source[path] = stats.examples - before
    if len(examples) < 2:
        raise AnchorspecError(f"only {len(examples)} usable training examples in {cfg.data} "
                              f"({stats.dropped_too_long} longer than --max-len {cfg.max_len})")
    return examples, stats


def stop_ids(target: Target) -> list[int]:
    from ..api import Engine  # one definition of a target's stop tokens (generation config + tokenizer)

    return list(Engine(target).stop_token_ids())


class Trainer:
    def __init__(self, cfg: TrainConfig):
        cfg.validate()
        self.cfg = cfg
        self.dist = _Dist.from_env()
        self.out = Path(cfg.out)
        self.ckpt_root = self.out / "checkpoints"
        dtype = parse_dtype(cfg.dtype)
        self.autocast = dtype == torch.bfloat16
        self.device = resolve_device(cfg.device)
        if cfg.feature_cache and self.device.type != "cpu":
            raise AnchorspecError(f"--feature-cache is built and read on the CPU path only; training on {self.device}, "
                                  "use online features: drop --feature-cache")
        self._cpu_target = None  # the evaluation's decoding target when training on a GPU (_decode_target)
        compile_loss(cfg.compile_loss)
        self.master_dtype = torch.float64 if dtype == torch.float64 else torch.float32
        self.target = load_target(cfg.target, dtype, aux_layer_ids=cfg.aux_layers, device=self.device)
        for p in self.target.model.parameters():
            p.requires_grad_(False)
        if self.target.tokenizer is None:
            raise AnchorspecError(f"target {cfg.target!r} has no tokenizer; training needs one")

        examples, self.data_stats = prepare_data(cfg, self.target.tokenizer)
        self.examples = examples
        self.train_idx, self.held_idx = split_heldout([e.input_ids for e in examples], cfg.heldout, cfg.seed, minimum=2)
        self.train_examples = [examples[i] for i in self.train_idx]
        self.held_examples = [examples[i] for i in self.held_idx]
        if cfg.join_to:  # after the split: held-out conversations stay whole and alone, as every round scored them
            self.train_examples = join_examples(self.train_examples, cfg.join_to, cfg.join_share,
                                                cfg.seed if cfg.order_seed is None else cfg.order_seed)
            self.train_idx = list(range(len(examples), len(examples) + len(self.train_examples)))
            self.examples = examples + self.train_examples
        self.cache = None
        self.cache_index = None
        if cfg.feature_cache:
            from .features import FeatureCache, build_feature_cache

            if self.dist.main:
                self.cache_index = build_feature_cache(self.target, examples, cfg.feature_cache, cfg.batch_tokens,
                                                       progress=cfg.progress)
            self.dist.barrier()
            self.cache = FeatureCache(cfg.feature_cache, examples)
        self.stream = BatchStream([len(e.input_ids) for e in self.train_examples], cfg.batch_tokens,
                                  cfg.seed if cfg.order_seed is None else cfg.order_seed)
        per_step = cfg.grad_accum * self.dist.world
        self.total_steps = cfg.max_steps or max(1, self.stream.total(cfg.epochs) // per_step)
        self.warmup = int(cfg.warmup_ratio * self.total_steps)

        V = self.target.vocab_size
        counts = count_loss_tokens(((e.input_ids, e.loss_mask) for e in self.train_examples), V)
        self.revocab_report = None
        if cfg.init_from:
            drafter = self._continued_drafter()
            draft_ids = drafter.draft_to_target
            if cfg.revocab:
                draft_ids = self._revocab(drafter, counts)
        else:
            Vd = min(cfg.draft_vocab_size or V, V)
            draft_ids = select_draft_vocab(counts, Vd, always_include=stop_ids(self.target))
            drafter = init_drafter(self.target.config, cfg.variant, Vd, self.target.aux_layer_ids, seed=cfg.seed,
                                   num_layers=cfg.draft_layers)
            drafter.set_vocab_mapping(draft_ids)
            if cfg.init_head == "target":
                self._head_from_target(drafter, draft_ids)
            if cfg.init_layer == "target":  # read from stock fp32 weights: a prepacked target has no .weight
                packed = is_packed(self.target.model)
                stock = load_target(cfg.target, torch.float32, pack="off", device=self.device) if packed else self.target
                layer_from_target(drafter, decoder_layers(stock.model)[-1])
                del stock
        self.vocab_coverage = coverage(counts, draft_ids)
        # detached: a Parameter assigned to a module attribute would become a drafter parameter (and be saved)
        drafter.to(device=self.device, dtype=self.master_dtype).bind_target_embedding(self.target.embed_weight.detach())
        self.drafter = drafter
        self.objective = TTTObjective(drafter, cfg.ttt_steps, cfg.attn_align)
        self.accept = AcceptObjective(drafter, self.target, cfg.ttt_steps, cfg.accept_slots)
        self.model: nn.Module = self.accept if cfg.stage == "accept" else self.objective
        if self.dist.world > 1:
            self.model = nn.parallel.DistributedDataParallel(self.model, broadcast_buffers=False)
        params = [p for p in drafter.parameters() if p.requires_grad]
        # fused on a GPU: one kernel for every parameter instead of a launch per tensor (the CPU keeps torch's default)
        self.optimizer = torch.optim.AdamW(params, lr=cfg.lr, betas=tuple(cfg.betas), weight_decay=cfg.weight_decay,
                                           fused=self.device.type == "cuda" or None)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: lr_factor(s, self.total_steps, self.warmup))
        self.step = 0
        self.best = {"metric": None, "step": None}
        self.fit = None  # the latest fit gap (fit_gap): at the start of a continued run and at the end
        self.train_seconds = 0.0
        self.train_tokens = 0
        self.eval_prompt_ids = self._eval_prompts()
        self.replay_answers = self._replay_answers()

    def _continued_drafter(self) -> Eagle3Drafter:
        """The --init-from drafter, checked against the target and the flags that must agree with it."""
        cfg = self.cfg
        drafter = load_drafter(cfg.init_from, self.master_dtype)
        dc = drafter.config
        if cfg.variant is not None and dc.variant != cfg.variant:
            raise AnchorspecError(f"--init-from {cfg.init_from} is an {dc.variant} drafter, not --variant {cfg.variant}")
        cfg.variant = dc.variant
        if cfg.draft_layers is not None and cfg.draft_layers < dc.num_hidden_layers:
            raise AnchorspecError(f"--init-from {cfg.init_from} has {dc.num_hidden_layers} decoder layers; "
                                  f"--draft-layers can add layers, not remove them (got {cfg.draft_layers})")
        if cfg.draft_layers is not None and cfg.draft_layers > dc.num_hidden_layers:
            drafter = deepen(drafter, cfg.draft_layers, seed=cfg.seed)  # new layers start as the identity
        cfg.draft_layers = drafter.config.num_hidden_layers
        if cfg.draft_vocab_size not in (None, dc.draft_vocab_size) and not cfg.revocab:
            raise AnchorspecError(f"--init-from {cfg.init_from} has a draft vocabulary of {dc.draft_vocab_size}, "
                                  f"not --draft-vocab-size {cfg.draft_vocab_size} (leave the flag out, or add "
                                  f"--revocab to re-select it at the new size)")
        if dc.vocab_size != self.target.vocab_size or dc.target_hidden_size != self.target.config.hidden_size:
            raise AnchorspecError(f"--init-from {cfg.init_from} was made for another target (vocabulary "
                                  f"{dc.vocab_size}, hidden size {dc.target_hidden_size})")
        if list(dc.eagle_aux_hidden_state_layer_ids) != list(self.target.aux_layer_ids):
            raise AnchorspecError(f"--init-from {cfg.init_from} reads aux layers {dc.eagle_aux_hidden_state_layer_ids}, "
                                  f"the target is set up for {list(self.target.aux_layer_ids)} (--aux-layers)")
        return drafter

    def _revocab(self, drafter: Eagle3Drafter, counts: torch.Tensor) -> torch.Tensor:
        """Re-select the continued drafter's draft vocabulary from this data (at --draft-vocab-size if
        given, else the same size): a vocabulary chosen on other data can cover far fewer of this data's
        tokens (89.7 % against 96.8 % measured on the corpus of round 3), and a token outside it can never
        be accepted (session 35: over half the misses where the target was sure, on MT-bench writing and
        stem, were such tokens). Rows of tokens in both vocabularies keep their trained weights; new
        tokens start from the target's head rows mapped into the drafter's (`head_map`)."""
        old_ids, old_rows = drafter.draft_to_target.clone(), drafter.lm_head.weight.detach().clone()
        size = min(self.cfg.draft_vocab_size or drafter.config.draft_vocab_size, self.target.vocab_size)
        new_ids = select_draft_vocab(counts, size, always_include=stop_ids(self.target))
        head = self.target.model.get_output_embeddings().weight.detach().cpu()  # the drafter is still on the CPU here
        mapping = head_map(old_ids, old_rows, head)
        if mapping is not None:
            head = (head.double() @ mapping).to(old_rows.dtype)
        if size != drafter.config.draft_vocab_size:
            drafter.resize_draft_vocab(size)
        with torch.no_grad():
            rows, kept = remap_head_rows(old_ids, old_rows, new_ids, head)
            drafter.lm_head.weight.copy_(rows)
        drafter.set_vocab_mapping(new_ids)
        self.revocab_report = {"kept_rows": kept, "new_rows": int(new_ids.numel()) - kept,
                               "coverage_before": coverage(counts, old_ids), "size_before": int(old_ids.numel()),
                               "new_rows_from": "target head, mapped" if mapping is not None else "target head"}
        return new_ids

    def _head_from_target(self, drafter: Eagle3Drafter, draft_ids: torch.Tensor) -> None:
        """Start the drafter's head where the target's is: its output rows for the draft vocabulary and
        its final norm, so step 0 begins as "the target's head on a hidden state" instead of noise."""
        head = self.target.model.get_output_embeddings().weight.detach()
        norm = getattr(getattr(self.target.model, "model", None), "norm", None)
        with torch.no_grad():
            drafter.lm_head.weight.copy_(head[draft_ids.to(head.device)].to(drafter.lm_head.weight.dtype))
            if norm is not None and getattr(norm, "weight", None) is not None:
                drafter.norm.weight.copy_(norm.weight.detach().to(drafter.norm.weight.dtype))

    # --- evaluation ---------------------------------------------------------------------------

    def scored_heldout(self) -> list[int]:
        """The examples (indices into `examples`) an evaluation's accuracy scores: every held-out one, or with
        `eval_heldout` N that many spread evenly over the held-out list, so every corpus part stays represented
        (a 2 % split of a 13.6M-token corpus is 853 conversations: 12 minutes an evaluation on 2 CPU cores)."""
        return _spread(self.held_idx, self.cfg.eval_heldout)

    def _heldout_batches(self, scored: list[int]) -> list[list[int]]:
        """`scored` (example indices) in the evaluation's batches, each a list of example indices."""
        lengths = [len(self.examples[i].input_ids) for i in scored]
        return [[scored[i] for i in idx] for idx in epoch_batches(lengths, self.cfg.batch_tokens, self.cfg.seed, 0)]

    @torch.no_grad()
    def _accuracy(self, scored: list[int]) -> list[float]:
        """TTT accuracy per step over the examples `scored` (indices into `examples`), token-weighted, in eval mode:
        the one scorer held-out and training conversations are both measured with."""
        was_training = self.drafter.training
        self.drafter.eval()
        correct = valid = None
        for members in self._heldout_batches(scored):
            with self._autocast():
                batch = self._batch(members)
                _, _, acc, n, _ = self.objective(*batch)
            c = acc.double() * n.double()
            correct = c if correct is None else correct + c
            valid = n.double() if valid is None else valid + n.double()
        self.drafter.train(was_training)
        return (correct / valid.clamp(min=1)).tolist()

    def scored_train(self) -> list[int]:
        """As many training conversations as an evaluation scores held-out ones, spread evenly over the training
        list the same way (`scored_heldout`), for the fit gap."""
        return _spread(self.train_idx, len(self.scored_heldout()))

    def fit_gap(self, heldout_acc: list[float] | None = None) -> dict:
        """Training against held-out accuracy per TTT step, one scorer, the drafter as it is now. A drafter that
        scores its training conversations well above unseen ones has memorised them: more data is what it needs.
        Level (or below) says the data is not the limit: the steps' noise (learning rate against batch size) or
        the drafter's capacity is. `heldout_acc`: the held-out figures of an evaluation of these weights."""
        held = heldout_acc if heldout_acc is not None else self._accuracy(self.scored_heldout())
        scored = self.scored_train()
        train = self._accuracy(scored)
        return {"train_acc": train, "heldout_acc": list(held), "gap": [t - h for t, h in zip(train, held)],
                "scored": len(scored)}

    def _eval_prompts(self) -> list[list[int]]:
        """Held-out prompts: each example's tokens before its first assistant token."""
        out = []
        for e in self.held_examples[: self.cfg.eval_prompts]:
            first = e.loss_mask.index(1)
            out.append(e.input_ids[:first])
        return out

    def _replay_answers(self) -> list[tuple[list[int], int]]:
        """Held-out (sequence, answer start) pairs for the replay tau: each example's first answer."""
        out = []
        for e in self.held_examples:
            if len(out) == self.cfg.eval_replay:
                break
            got = first_answer(e.input_ids, e.loss_mask)
            if got is not None and len(got[0]) - got[1] >= 3:  # a root and something to draft
                out.append(got)
        return out

    def _autocast(self):
        return torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.autocast)

    @torch.no_grad()
    def evaluate(self) -> dict:
        """Held-out TTT accuracy per step, its simulated tau, and the real tau of speculative generation."""
        from ..decode.engine import GenerationConfig, generate_speculative
        from ..decode.propose import EagleProposer
        from ..api import DEFAULT_TREE
        from ..decode.shape import replay
        from ..metrics import GenerationStats

        self.drafter.eval()
        scored = self.scored_heldout()
        acc = self._accuracy(scored)
        result = {"heldout_acc": acc, "sim_tau": simulated_tau(acc), "heldout_scored": len(scored)}
        if self.cfg.stage == "accept":
            result.update(self.heldout_acceptance())
        if self.eval_prompt_ids or self.replay_answers:
            target = self._decode_target()
            drafter = copy.deepcopy(self.drafter).to(device=target.embed_weight.device, dtype=target.dtype).eval()
            drafter.bind_target_embedding(target.embed_weight.detach())
            proposer = EagleProposer(drafter)
        if self.replay_answers:
            # The default tree walked along held-out answers: the tau `generate` would reach on them (greedy),
            # over far more steps than a few generated prompts, so checkpoints are told apart by more than noise.
            walked = GenerationStats()
            for seq, start in self.replay_answers:
                walked = walked.merge(replay(target, proposer, torch.tensor(seq), start, DEFAULT_TREE))
            result["replay_tau"] = walked.tau
            result["replay_acceptance_per_depth"] = walked.acceptance_per_depth
        if self.eval_prompt_ids:
            gcfg = GenerationConfig(max_new_tokens=self.cfg.eval_new_tokens, stop_token_ids=tuple(stop_ids(self.target)))
            total = None
            for ids in self.eval_prompt_ids:
                res = generate_speculative(target, proposer, torch.tensor(ids), gcfg, DEFAULT_TREE)
                total = res.stats if total is None else total.merge(res.stats)
            result["gen_tau"] = total.tau
            result["gen_acceptance_per_depth"] = total.acceptance_per_depth
        self.drafter.train()
        return result

    def _decode_target(self) -> Target:
        """The target the evaluation's real decoding runs on: the training target on a CPU; when training on
        a GPU, a CPU copy loaded once, since the decode path is verified on the CPU only (on an H100 in session
        40 it mixed devices; fixed since, not yet run on a GPU again)."""
        if self.device.type == "cpu":
            return self.target
        if self._cpu_target is None:
            self._cpu_target = load_target(self.cfg.target, self.target.dtype, aux_layer_ids=self.target.aux_layer_ids)
        return self._cpu_target

    @torch.no_grad()
    def heldout_acceptance(self) -> dict:
        """Stage accept's objective on the held-out data: the mean expected accepted length of the
        drafter's own chains (and the mean greedy accepted length), over every scored chain."""
        total = greedy = chains = 0.0
        for members in self._heldout_batches(self.scored_heldout()):
            with self._autocast():
                loss, _, acc, n, _ = self.accept(*self._accept_batch(members))
            count = float(n[0])
            total += float(-loss) * count
            greedy += (simulated_tau(acc.tolist()) - 1) * count
            chains += count
        return {"heldout_expected_accept_len": total / max(chains, 1), "heldout_greedy_accept_len": greedy / max(chains, 1)}

    # --- checkpoints --------------------------------------------------------------------------

    def _state(self) -> dict:
        return {"step": self.step, "optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict(),
                "best_metric": self.best["metric"], "best_step": self.best["step"],
                "train_seconds": self.train_seconds, "train_tokens": self.train_tokens}

    def save_checkpoint(self) -> Path:
        """Write checkpoints/step-N atomically (temp dir + rename), then point `latest` at it."""
        self.ckpt_root.mkdir(parents=True, exist_ok=True)
        name = f"step-{self.step:07d}"
        final = self.ckpt_root / name
        tmp = self.ckpt_root / f".{name}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        save_drafter(self.drafter, tmp)
        torch.save(self._state(), tmp / "trainer_state.pt")
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        atomic_write(self.ckpt_root / "latest", lambda f: Path(f).write_text(name + "\n"))
        for old in self.ckpt_root.glob("step-*"):
            if old.name != name:
                shutil.rmtree(old, ignore_errors=True)
        return final

    def load_checkpoint(self) -> bool:
        latest = self.ckpt_root / "latest"
        if not latest.is_file():
            return False
        path = self.ckpt_root / latest.read_text().strip()
        if not (path / "trainer_state.pt").is_file():
            raise AnchorspecError(f"{latest} names {path}, which holds no trainer_state.pt")
        load_drafter(path, self.master_dtype)  # validates the checkpoint against its config
        # The raw tensors, not load_drafter's module: it builds the drafter in float32 first, which would
        # round float64 masters and make a resumed run diverge from an uninterrupted one.
        from safetensors.torch import load_file

        from ..models.drafter import module_state

        self.drafter.load_state_dict(module_state(load_file(str(path / "model.safetensors"))))
        state = torch.load(path / "trainer_state.pt", weights_only=True, map_location=self.device)
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.step = int(state["step"])
        self.best = {"metric": state["best_metric"], "step": state["best_step"]}
        self.train_seconds = float(state["train_seconds"])
        self.train_tokens = int(state["train_tokens"])
        return True

    def _check_resume_config(self) -> None:
        run = self.out / "run.json"
        if not run.is_file():
            return
        before = json.loads(run.read_text())["config"]
        now = json.loads(json.dumps(asdict(self.cfg)))
        diff = [k for k in TRAJECTORY_FIELDS if before.get(k, FIELD_DEFAULTS.get(k)) != now.get(k)]
        if diff:
            raise AnchorspecError(f"--resume with a different {', '.join(diff)} than the run in {self.out} "
                                  f"(was {', '.join(f'{k}={before.get(k, FIELD_DEFAULTS.get(k))!r}' for k in diff)}); use a new --out")

    def _trim_metrics(self) -> None:
        """Drop log lines past the resumed step: they came from work the checkpoint does not hold."""
        path = self.out / "metrics.jsonl"
        if not path.is_file():
            return
        keep = []
        for line in jsonl_lines(path.read_text()):
            try:
                if json.loads(line)["step"] <= self.step:
                    keep.append(line)
            except (json.JSONDecodeError, KeyError, TypeError):
                continue  # a line cut off by the crash
        atomic_write(path, lambda f: Path(f).write_text("".join(x + "\n" for x in keep)))

    def _log(self, record: dict) -> None:
        with open(self.out / "metrics.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")

    def _write_run(self, extra: dict | None = None) -> None:
        s = self.data_stats
        run = {"config": json.loads(json.dumps(asdict(self.cfg))),
               "data": {"conversations": s.conversations, "examples": s.examples, "train": len(self.train_examples),
                        "heldout": len(self.held_examples), "dropped_too_long": s.dropped_too_long,
                        "dropped_no_loss": s.dropped_no_loss, "tokens": s.tokens, "loss_tokens": s.loss_tokens,
                        "per_source": s.per_source},
               "draft_vocab": {"size": self.drafter.config.draft_vocab_size, "coverage": self.vocab_coverage,
                               **({"revocab": self.revocab_report} if self.revocab_report else {})},
               "total_steps": self.total_steps, "warmup_steps": self.warmup, "world_size": self.dist.world,
               "micro_batches_per_epoch": self.stream.per_epoch(0), "torch_threads": torch.get_num_threads(),
               "allocator": active_allocator(), "anchorspec_malloc": malloc_mode()}
        if self.cache_index is not None:
            run["feature_cache"] = {"dir": self.cfg.feature_cache, "tokens": self.cache_index["tokens"],
                                    "bytes": self.cache_index["bytes"], "shards": len(self.cache_index["shards"])}
        run.update(extra or {})
        self.out.mkdir(parents=True, exist_ok=True)
        atomic_write(self.out / "run.json", lambda f: Path(f).write_text(json.dumps(run, indent=2) + "\n"))

    # --- the loop ------------------------------------------------------------------------------

    def _collated(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Token ids, loss mask and padding mask of examples `indices` (global), right-padded, on the device."""
        return tuple(t.to(self.device) for t in collate([self.examples[i] for i in indices]))

    def _batch(self, indices: list[int]) -> tuple:
        """The objective's inputs for examples `indices` (global): from the cache or a target pass."""
        ids, lm, pm = self._collated(indices)
        if self.cache is None:
            # The target's own logits (exact for heads with logit scaling too), handed to TTT already
            # in the draft vocabulary: a [B, T, V] fp32 copy and a bf16 argmax cost more than the step.
            if self.cfg.attn_align:
                from .attn_align import target_attention

                feats, attn_map = target_attention(self.target, ids, pm, max(self.target.aux_layer_ids))
            else:
                feats, attn_map = self.target.features(ids, pm), None
            in_draft = self.drafter.t2d[argmax_last(feats.logits)]
            batch = (feats.aux, ids, feats.logits[..., self.drafter.draft_to_target], lm, pm, in_draft)
            return batch if attn_map is None else batch + (attn_map,)
        from .features import draft_logits

        f = self.cache.batch(indices)
        head = self.target.model.get_output_embeddings()
        Z = draft_logits(f.hidden, head.weight, self.drafter.draft_to_target, getattr(head, "bias", None))
        return f.aux, ids, Z, lm, pm, self.drafter.t2d[f.argmax]

    def _accept_batch(self, indices: list[int]) -> tuple:
        """Stage accept's inputs: aux, ids, the target's full-vocabulary logits, loss and padding masks."""
        ids, lm, pm = self._collated(indices)
        feats = self.target.features(ids, pm)
        return feats.aux, ids, feats.logits, lm, pm

    def _micro_batch(self, step: int, a: int) -> tuple:
        i = (step * self.cfg.grad_accum + a) * self.dist.world + self.dist.rank
        indices = [self.train_idx[j] for j in self.stream.get(i)]
        return self._accept_batch(indices) if self.cfg.stage == "accept" else self._batch(indices)

    def train_step(self, window: _Accum) -> tuple[float, int]:
        """One optimizer step; returns the gradient norm before clipping and this rank's real tokens."""
        cfg = self.cfg
        tokens = 0
        self.drafter.train()
        for a in range(cfg.grad_accum):
            last = a == cfg.grad_accum - 1
            sync = self.model.no_sync() if (self.dist.world > 1 and not last) else _null()
            with sync:
                with self._autocast():
                    batch = self._micro_batch(self.step, a)
                    loss, loss_k, acc_k, valid_k, attn = self.model(*batch)
                (loss / cfg.grad_accum).backward()
            pm = batch[4]
            window.add(loss, loss_k, acc_k, valid_k, int(pm.sum()), attn)
            tokens += int(pm.sum())
        params = [p for p in self.drafter.parameters() if p.requires_grad]
        gnorm = torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        return float(gnorm), tokens

    def _window_record(self, window: _Accum, gnorm: float, seconds: float) -> dict:
        t = torch.tensor([window.loss, window.batches, window.tokens, window.extra], dtype=torch.float64)
        packed = torch.cat([t, window.correct.cpu(), window.valid.cpu(), window.loss_k.cpu()])
        packed = self.dist.all_sum(packed)
        K = self.cfg.ttt_steps
        loss, batches, tokens, extra = packed[:4].tolist()
        correct, valid, loss_k = packed[4:4 + K], packed[4 + K:4 + 2 * K], packed[4 + 2 * K:]
        acc = (correct / valid.clamp(min=1)).tolist()
        rec = {"step": self.step, "loss": loss / max(batches, 1), "loss_per_step": (loss_k / valid.clamp(min=1)).tolist(),
               "acc_per_step": acc, "train_sim_tau": simulated_tau(acc), "lr": self.scheduler.get_last_lr()[0],
               "grad_norm": gnorm, "tokens_per_s": tokens / max(seconds, 1e-9), "seconds": seconds}
        if self.cfg.attn_align:
            rec["attn_align_kl"] = extra / max(batches, 1)
        if self.cfg.stage == "accept":
            rec["expected_accept_len"] = extra / max(batches, 1)
        return rec

    def _maybe_best(self, ev: dict) -> bool:
        metric = ev.get("replay_tau", ev.get("gen_tau", 1 + ev["heldout_expected_accept_len"]
                                             if "heldout_expected_accept_len" in ev else ev["sim_tau"]))
        if self.best["metric"] is None or metric > self.best["metric"]:
            self.best = {"metric": metric, "step": self.step}
            save_drafter(self.drafter, self.out / "best")
            atomic_write(self.out / "best" / "best.json",
                          lambda f: Path(f).write_text(json.dumps({"step": self.step, **ev}) + "\n"))
            return True
        return False

    def _evaluate_and_log(self, bar, label: str, mark_best: bool = True, fit: bool = False) -> None:
        """Evaluate, keep best/ if it is the best so far, log the record and print one line; with `fit`, the
        fit gap too (the start of a continued run and the end: whether the round memorised its corpus)."""
        ev = self.evaluate()
        if fit:
            ev["fit"] = self.fit = self.fit_gap(ev["heldout_acc"])
        best = self._maybe_best(ev)
        self._log({"step": self.step, "eval": ev, "best": best})
        bar.write(f"{label}: held-out sim tau {ev['sim_tau']:.2f}"
                  + (f", replay tau {ev['replay_tau']:.3f}" if "replay_tau" in ev else "")
                  + (f", generate tau {ev['gen_tau']:.2f}" if "gen_tau" in ev else "")
                  + (" (best)" if best and mark_best else ""))
        if fit:
            g = ev["fit"]
            bar.write(f"{label}: fit gap {g['gap'][0]:+.3f} at TTT step 1 ({g['gap'][-1]:+.3f} at the last): "
                      f"{g['scored']} training conversations score {g['train_acc'][0]:.3f}, held-out {g['heldout_acc'][0]:.3f}")

    def run(self) -> dict:
        from ..progress import progress_bar

        cfg = self.cfg
        resumed = False
        if cfg.resume:
            self._check_resume_config()
            resumed = self.load_checkpoint()
        elif (self.ckpt_root / "latest").exists():
            raise AnchorspecError(f"{self.out} already holds a training run; pass --resume to continue it, "
                                  f"or choose another --out")
        if self.dist.main:
            self._write_run()
            if resumed:
                self._trim_metrics()
            elif (self.out / "metrics.jsonl").exists():
                (self.out / "metrics.jsonl").unlink()
        self.dist.barrier()
        bar = progress_bar(total=self.total_steps, initial=self.step, desc=f"train {cfg.variant}", unit="step",
                           disable=not (cfg.progress and self.dist.main), dynamic_ncols=True)
        if cfg.init_from and self.step == 0:
            # the drafter a continued run starts from, scored on this run's held-out set: the baseline its
            # evaluations must beat, and the best so far (a round that only gets worse releases its start)
            if self.dist.main:
                self._evaluate_and_log(bar, "step 0 (--init-from)", mark_best=False, fit=True)
            self.dist.barrier()
        window, t_window = _Accum(), time.perf_counter()
        while self.step < self.total_steps:
            t0 = time.perf_counter()
            gnorm, tokens = self.train_step(window)
            self.train_seconds += time.perf_counter() - t0
            self.train_tokens += tokens
            bar.update(1)
            if self.step % cfg.log_every == 0 or self.step == self.total_steps:
                rec = self._window_record(window, gnorm, time.perf_counter() - t_window)
                if self.dist.main:
                    self._log(rec)
                    bar.set_postfix_str(f"loss {rec['loss']:.3f} acc0 {rec['acc_per_step'][0]:.2f} "
                                        f"tau~{rec['train_sim_tau']:.2f}")
                window, t_window = _Accum(), time.perf_counter()
            if self.step % cfg.eval_every == 0 or self.step == self.total_steps:
                if self.dist.main:
                    self._evaluate_and_log(bar, f"step {self.step}", fit=self.step == self.total_steps)
                    self._plot()
                self.dist.barrier()
                t_window = time.perf_counter()
            if self.step % cfg.save_every == 0 or self.step == self.total_steps:
                if self.dist.main:
                    self.save_checkpoint()
                self.dist.barrier()
        bar.close()
        summary = {"steps": self.step, "train_seconds": self.train_seconds,
                   "train_tokens_per_s": self.train_tokens * self.dist.world / max(self.train_seconds, 1e-9),
                   "best_step": self.best["step"], "best_metric": self.best["metric"]}
        if self.dist.main:
            save_drafter(self.drafter, self.out / "final")
            if self.fit is not None:
                summary["fit"] = self.fit
            self._write_run({"summary": summary})
            self._plot()
        self.dist.barrier()
        return summary

    def _plot(self) -> None:
        try:
            from .plots import plot_training

            plot_training(self.out / "metrics.jsonl", self.out / "training.png", title=f"{self.cfg.variant} TTT")
        except ImportError:  # matplotlib is optional for training itself
            pass


def _spread(indices: list[int], n: int) -> list[int]:
    """`n` of `indices` spread evenly over the list, first one included (all of them for n = 0 or n >= the list)."""
    if n == 0 or n >= len(indices):
        return list(indices)
    return [indices[i * len(indices) // n] for i in range(n)]


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False
