"""The generation loops, batch 1: plain decoding and speculative decoding.

Speculative loop, one iteration:
    tree    = proposer.propose(...)                      # draft (root = pending token)
    logits  = target(tree tokens, tree mask, positions)  # verify in one forward
    verdict = verify(tree, logits)                       # accepted path + one target token
    commit_path(cache, ...)                              # keep the path's KV rows, drop the rest
    proposer.update(sequence, aux features of the path)  # drafter sees the real features

Both loops are step-able objects (PlainDecoding, SpeculativeDecoding: one step per `step()`), so a
server can interleave many sequences; generate_vanilla / generate_speculative just run them to the end.
A step after the prefill is split in three so that several sequences can share one target forward
(decode/round.py): `prepare()` drafts and returns the rows to verify (a DraftTree; a plain step is a
1-node tree), the caller runs the target on them, `finish(logits, aux, verify_s)` verifies, commits,
emits and counts. `step()` is exactly prepare + a batch-1 forward on the sequence's own cache + finish.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from ..errors import AnchorspecError
from ..metrics import GenerationStats
from ..models.target import Target
from .adaptive import AdaptiveDepth
from .batch import KVSlot
from .drafting import Program, finished, run_program
from .fallback import StreamMonitor
from .kv import StaticKV, commit_path, filled_full_attention
from .propose import Proposer
from .sampling import SamplingParams, pick_token, probs_from_logits
from .tree import DraftTree, TreeShape, tree_attention_mask, tree_position_ids
from .verify import Verdict, verify_chain_sampling, verify_greedy, verify_tree_sampling


@dataclass
class GenerationConfig:
    max_new_tokens: int = 128
    sampling: SamplingParams = field(default_factory=SamplingParams)
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self):
        if self.max_new_tokens < 1:
            raise AnchorspecError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")

    def generator(self) -> torch.Generator | None:
        if self.sampling.greedy:
            return None
        gen = torch.Generator()
        gen.manual_seed(self.seed if self.seed is not None else torch.seed())
        return gen


@dataclass
class GenerationResult:
    token_ids: list[int]  # new tokens only (a stop token, if hit, is the last one)
    finish_reason: str  # "stop" or "length"
    stats: GenerationStats


class _Output:
    """Collects emitted tokens and knows when to stop (stop token or budget)."""

    def __init__(self, cfg: GenerationConfig):
        self.cfg, self.tokens, self.finish = cfg, [], None

    def push(self, token: int) -> bool:
        """Append one token; True if generation must stop now."""
        self.tokens.append(token)
        if token in self.cfg.stop_token_ids:
            self.finish = "stop"
        elif len(self.tokens) >= self.cfg.max_new_tokens:
            self.finish = "length"
        return self.finish is not None

    @property
    def remaining(self) -> int:
        return self.cfg.max_new_tokens - len(self.tokens)


def _check_prompt(target: Target, prompt_ids: torch.Tensor, cfg: GenerationConfig) -> torch.Tensor:
    ids = torch.as_tensor(prompt_ids, dtype=torch.long).view(-1)
    if ids.numel() == 0:
        raise AnchorspecError("prompt is empty")
    if int(ids.max()) >= target.vocab_size or int(ids.min()) < 0:
        raise AnchorspecError(f"prompt token ids must lie in 0..{target.vocab_size - 1}")
    limit = getattr(target.config, "max_position_embeddings", None)
    if limit and ids.numel() + cfg.max_new_tokens > limit:
        raise AnchorspecError(
            f"prompt ({ids.numel()} tokens) + max_new_tokens ({cfg.max_new_tokens}) exceeds the target's "
            f"context of {limit} tokens"
        )
    return ids


def _verify(tree: DraftTree, logits: torch.Tensor, params: SamplingParams, gen) -> Verdict:
    if params.greedy:
        return verify_greedy(tree, logits)
    probs = probs_from_logits(logits, params)
    if tree.draft_probs is not None:
        return verify_chain_sampling(tree, probs, gen)
    return verify_tree_sampling(tree, probs, gen)


@dataclass
class StepReport:
    """What one step did: the tokens it emitted and, for a verified draft, how much was accepted."""

    tokens: list[int]
    kind: str  # "prefill", "speculative" (a draft was verified) or "plain" (one token, no draft)
    drafted: int = 0
    accepted: int = 0
    depth: int = 0  # levels of the verified draft
    draft_s: float = 0.0
    verify_s: float = 0.0  # the target forward of this step (for plain steps: the whole step)


STATIC_SLACK = 64  # rows a solo StaticKV holds beyond prompt + budget (a verified tree's extra rows)


class _Decoding:
    """Shared state of a step-able generation: prompt check, output, stats, wall clock, and the
    target KV cache: a DynamicCache for the prefill, then a StaticKV of its own when it steps alone,
    or a slot of a BatchKV once attached to a batch."""

    def __init__(self, target: Target, prompt_ids, cfg: GenerationConfig):
        self.target, self.cfg = target, cfg
        self.ids = _check_prompt(target, prompt_ids, cfg)
        self.stats = GenerationStats(prompt_tokens=self.ids.numel())
        self.gen = cfg.generator()
        self.out = _Output(cfg)
        self.cache = target.new_cache()
        self.started = False
        self.t0 = 0.0
        self.committed = 0  # rows in the target cache
        self._pending: tuple[DraftTree, float] | None = None  # prepared, not yet finished: (rows, draft_s)

    @property
    def finished(self) -> bool:
        return self.out.finish is not None

    @property
    def batched(self) -> bool:
        return isinstance(self.cache, KVSlot)

    def use_slot(self, slot: KVSlot) -> None:
        """Continue in a batch: `slot` holds a copy of this sequence's cache (BatchKV.attach)."""
        if slot.length != self.committed:
            raise AnchorspecError(f"KV slot holds {slot.length} rows, the sequence has {self.committed}")
        self.cache = slot

    def _emit(self, tokens: list[int]) -> list[int]:
        """Push tokens until a stop; returns the ones actually emitted."""
        emitted = []
        for token in tokens:
            emitted.append(token)
            if self.out.push(token):
                self.stats.total_s = time.perf_counter() - self.t0
                self.stats.new_tokens = len(self.out.tokens)
                break
        return emitted

    def _commit(self, keep: list[int], written: int) -> None:
        """Keep tree rows `keep` (of the `written` after the committed prefix), in whichever cache
        this sequence uses."""
        if isinstance(self.cache, (KVSlot, StaticKV)):
            self.cache.commit(self.committed, keep)
        elif keep != list(range(written)):  # else nothing to move or drop (e.g. a plain step)
            commit_path(self.cache, self.committed, keep)
        self.committed += len(keep)

    def _check_step(self) -> None:
        if self.finished:
            raise AnchorspecError("generation is already finished")
        if self._pending is not None:
            raise AnchorspecError("a prepared step is pending: call finish() first")

    def _begin(self, draft_tree: DraftTree, t: float) -> DraftTree:
        self._pending = (draft_tree, time.perf_counter() - t)
        return draft_tree

    def _take_pending(self) -> tuple[DraftTree, float]:
        if self._pending is None:
            raise AnchorspecError("finish() without prepare()")
        pending, self._pending = self._pending, None
        return pending

    def prepare(self, *args, **kwargs) -> DraftTree:
        raise NotImplementedError

    def draft(self, *args, **kwargs) -> Program:
        """`prepare` as a program of drafter passes (decode/drafting.py)."""
        raise NotImplementedError

    def slots(self) -> list[KVSlot]:
        """The batch cache slots this sequence holds (to release when it ends)."""
        return [self.cache] if self.batched else []

    def finish(self, logits: torch.Tensor, aux: torch.Tensor | None, verify_s: float) -> StepReport:
        raise NotImplementedError

    def _solo_step(self, *args) -> StepReport:
        """prepare + a batch-1 forward on this sequence's own cache (a StaticKV after the prefill) + finish."""
        if self.batched:
            raise AnchorspecError("this sequence is attached to a batch: step it with its BatchDecoder")
        if not isinstance(self.cache, StaticKV) and filled_full_attention(self.cache):
            # in-place writes from now on; a sliding-window cache stays a DynamicCache
            self.cache = StaticKV(self.cache, self.committed + self.out.remaining + STATIC_SLACK)
        tree = self.prepare(*args)
        t = time.perf_counter()
        out = self._solo_forward(tree)
        return self.finish(out.logits, out.aux, time.perf_counter() - t)

    def result(self) -> GenerationResult:
        if not self.finished:
            raise AnchorspecError("generation is not finished yet")
        return GenerationResult(self.out.tokens, self.out.finish, self.stats)

    def run(self) -> GenerationResult:
        while not self.finished:
            self.step()
        return self.result()


class PlainDecoding(_Decoding):
    """Plain autoregressive decoding with a KV cache, one token per step: the reference every
    speculative run must match."""

    @torch.inference_mode()
    def step(self) -> StepReport:
        self._check_step()
        if self.started:
            return self._solo_step()
        self.started = True
        self.t0 = t = time.perf_counter()
        logits = self.target.forward(self.ids, torch.arange(self.ids.numel()), self.cache, last_only=True).logits[-1]
        self.stats.prefill_s = time.perf_counter() - t
        self.stats.target_forwards = 1
        self.committed = self.ids.numel()
        token = pick_token(logits, self.cfg.sampling, self.gen)
        return StepReport(self._emit([token]), "prefill", verify_s=time.perf_counter() - t)

    def draft(self) -> Program:
        return finished(self.prepare())

    def prepare(self) -> DraftTree:
        """The pending token alone, at the next position."""
        self._check_step()
        if not self.started:
            raise AnchorspecError("prefill first: the first step() runs the prompt")
        return self._begin(DraftTree(torch.tensor([self.out.tokens[-1]]), [-1]), time.perf_counter())

    def _solo_forward(self, tree: DraftTree):
        return self.target.forward(tree.tokens, torch.tensor([self.committed]), self.cache)

    @torch.inference_mode()
    def finish(self, logits: torch.Tensor, aux: torch.Tensor | None, verify_s: float) -> StepReport:
        self._take_pending()
        t = time.perf_counter()
        self._commit([0], 1)
        self.stats.target_forwards += 1
        token = pick_token(logits[-1], self.cfg.sampling, self.gen)
        # verify_s covers the whole step, as the monitor's plain cost does
        return StepReport(self._emit([token]), "plain", verify_s=verify_s + time.perf_counter() - t)


class SpeculativeDecoding(_Decoding):
    """Speculative decoding of one sequence, one draft-verify-commit step per `step()` call, so a
    server can interleave many sequences. `step(speculate=False)` verifies the pending token
    alone (a plain decode step); the target features of such steps are kept and handed to the
    proposer when speculation resumes, so its cache stays exact."""

    def __init__(self, target: Target, proposer: Proposer, prompt_ids, cfg: GenerationConfig,
                 shape: TreeShape | AdaptiveDepth):
        super().__init__(target, prompt_ids, cfg)
        # an AdaptiveDepth changes the shape from step to step; self.shape is then its base shape
        self.policy = shape if isinstance(shape, AdaptiveDepth) else None
        self.proposer, self.shape = proposer, shape.base if self.policy else shape
        proposer.reset()

    @torch.inference_mode()
    def step(self, speculate: bool = True) -> StepReport:
        self._check_step()
        if not self.started:
            return self._prefill()
        return self._solo_step(speculate)

    @torch.inference_mode()
    def prepare(self, speculate: bool = True) -> DraftTree:
        """Draft (unless `speculate` is off or no room is left): the tree the target must verify."""
        return run_program(self.draft(speculate))

    def draft(self, speculate: bool = True) -> Program:
        """`prepare` as a program of drafter passes (decode/drafting.py), so that a BatchDecoder can
        run the passes of many sequences together. Its driver runs it under inference_mode."""
        self._check_step()
        if not self.started:
            raise AnchorspecError("prefill first: the first step() runs the prompt")
        t = time.perf_counter()
        shape = self.policy.shape() if self.policy else self.shape
        # never draft deeper than the tokens still allowed (the bonus token takes one)
        step_shape = shape.capped(self.out.remaining - 1) if speculate else None
        if step_shape is None:  # nothing to draft (no room, or speculation is off): verify the root alone
            return self._begin(DraftTree(self.sequence[-1:].clone(), [-1]), t)
        if hasattr(self.proposer, "propose_passes"):
            yield from self.proposer.update_passes(self.sequence, self.aux)
            self.aux = None
            tree = yield from self.proposer.propose_passes(step_shape, self.cfg.sampling, self.gen)
        else:  # a proposer without passes drafts in one go
            self.proposer.update(self.sequence, self.aux)
            self.aux = None
            tree = self.proposer.propose(step_shape, self.cfg.sampling, self.gen)
        return self._begin(tree, t)

    def slots(self) -> list[KVSlot]:
        proposer_cache = getattr(self.proposer, "cache", None)
        return super().slots() + ([proposer_cache] if isinstance(proposer_cache, KVSlot) else [])

    def _solo_forward(self, tree: DraftTree):
        # one token sees the whole cache: no mask (a plain step costs what PlainDecoding's does)
        mask = tree_attention_mask(tree, self.committed, self.target.dtype) if tree.size > 1 else None
        return self.target.forward(tree.tokens, tree_position_ids(tree, self.committed), self.cache,
                                   attention_mask=mask, capture_aux=True)

    def run(self, fallback: StreamMonitor | None = None) -> GenerationResult:
        """To the end; with `fallback`, steps go plain while it says speculation does not pay
        (decode/fallback.py), and its costs and acceptance learn from every step."""
        if fallback is None or not fallback.enabled:
            return super().run()
        if not fallback.calibrated and fallback.fixed_threshold is None:
            fallback.calibrate(self.target, self.proposer)  # leaves the proposer reset
        state = fallback.start(self.shape)
        previous = self.step()  # the prefill
        while not self.finished:
            fallback.start_round([state])  # a due retry turns speculation back on
            t = time.perf_counter()
            report = self.step(state.speculating)
            step_s = time.perf_counter() - t
            # after a prefill or plain stretch the drafter first reads those positions' features
            fallback.observe_step(report.kind, report.drafted + 1, report.depth, report.accepted, step_s,
                                  report.draft_s, catch_up=previous.kind != "speculative")
            fallback.record(state, report.kind, report.accepted, len(report.tokens))
            previous = report
        self.stats.fallback_switches = state.switches
        return self.result()

    @torch.inference_mode()
    def finish(self, logits: torch.Tensor, aux: torch.Tensor | None, verify_s: float) -> StepReport:
        """`logits` [N, V] and `aux` [N, n_aux * H]: the target on the prepared tree's N nodes."""
        tree, draft_s = self._take_pending()
        stats = self.stats
        stats.draft_s += draft_s
        stats.verify_s += verify_s
        verdict = _verify(tree, logits, self.cfg.sampling, self.gen)
        self._commit(verdict.path, tree.size)
        if tree.size > 1:
            stats.record_step(tree.depth, tree.size - 1, verdict.accepted)
            if self.policy is not None:
                self.policy.observe(tree.depth, verdict.accepted)
        else:
            stats.target_forwards += 1
        new = [int(tree.tokens[i]) for i in verdict.path[1:]] + [verdict.next_token]
        emitted = self._emit(new)
        self.sequence = torch.cat([self.sequence, torch.tensor(new, dtype=torch.long)])
        path_aux = aux[verdict.path]
        self.aux = path_aux if self.aux is None else torch.cat([self.aux, path_aux])
        if tree.size > 1:
            return StepReport(emitted, "speculative", tree.size - 1, verdict.accepted, tree.depth, draft_s,
                              verify_s)
        return StepReport(emitted, "plain", draft_s=draft_s, verify_s=verify_s)

    def _prefill(self) -> StepReport:
        self.started = True
        self.t0 = t = time.perf_counter()
        first = self.target.forward(self.ids, torch.arange(self.ids.numel()), self.cache, capture_aux=True, last_only=True)
        self.stats.prefill_s = time.perf_counter() - t
        self.stats.target_forwards = 1
        self.committed = self.ids.numel()
        token = pick_token(first.logits[-1], self.cfg.sampling, self.gen)
        self.sequence = torch.cat([self.ids, torch.tensor([token])])
        self.aux = first.aux  # target features not yet handed to the proposer
        return StepReport(self._emit([token]), "prefill", verify_s=self.stats.prefill_s)


def generate_vanilla(target: Target, prompt_ids, cfg: GenerationConfig) -> GenerationResult:
    """Plain autoregressive decoding with a KV cache: the reference every speculative run must match."""
    return PlainDecoding(target, prompt_ids, cfg).run()


def generate_speculative(target: Target, proposer: Proposer, prompt_ids, cfg: GenerationConfig,
                         shape: TreeShape | AdaptiveDepth, fallback: StreamMonitor | None = None) -> GenerationResult:
    """`fallback`: the stream's drift monitor (decode/fallback.py), kept across generations so that
    its costs and acceptance accumulate; None speculates at every step."""
    return SpeculativeDecoding(target, proposer, prompt_ids, cfg, shape).run(fallback)
