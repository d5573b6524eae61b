"""The generation loop, batch 1: speculative decoding, plain decoding as the same loop with no
proposer (a 1-node tree each step), and prompt lookup as that loop with a context lookup (the
chain copied from the sequence itself is the whole draft; decode/lookup.py).

One iteration:
    tree    = proposer.propose(...)                      # draft (root = pending token)
    logits  = target(tree tokens, tree mask, positions)  # verify in one forward
    verdict = verify(tree, logits)                       # accepted path + one target token
    slot.commit(...)                                     # keep the path's KV rows, drop the rest
    proposer.update(sequence, aux features of the path)  # drafter sees the real features

The target runs through decode/batch.py's batch_forward on a KV slot, always: a solo generation is
a batch of one on a one-slot BatchKV of its own (its prefill too), so there is one forward, one
commit and one cache for solo and batched decoding.

Staged verification (`staged=S`): the target's forward covers the root and the first S draft
levels only; the verifier still accepts or rejects level S+1 (its test needs only the parent's row),
and an accepted level-(S+1) node becomes the next token, whose drafted subtree is then verified by
the next step's forward with no new drafting. The deeper rows are computed only when the path
reaches them, which pays where a verify costs roughly in proportion to its tokens. Lossless: every
token is still accepted by the target's own test, and a held subtree was drafted before the target
saw any of it, like any draft.

Both loops are step-able objects (PlainDecoding, SpeculativeDecoding: one step per `step()`), so a
server can interleave many sequences; generate_vanilla / generate_speculative just run them to the end.
A step after the prefill is split in three so that several sequences can share one target forward
(decode/round.py): `prepare()` drafts and returns the rows to verify (a DraftTree; a plain step is a
1-node tree), the caller runs the target on them, `finish(logits, aux, verify_s)` verifies, commits,
emits and counts. `step()` is exactly prepare + a batch-of-one forward + finish.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..errors import AnchorspecError
from ..metrics import GenerationStats
from ..models.target import Target
from .adaptive import AdaptiveDepth
from .batch import BatchKV, KVSlot, SharedPrefix, batch_forward, one_offs
from .drafting import Program, run_program
from .fallback import StreamMonitor
from .lookup import ContextLookup, LookupSettings, common_prefix, merge_chain
from .propose import Proposer
from .sampling import SamplingParams, pick_token, probs_from_logits
from .tree import DraftTree, TreeShape
from .verify import Verdict, verify_greedy, verify_sampling


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
    if tree.size == 1:  # a plain step: the target's own next token
        return Verdict([0], pick_token(logits[0], params, gen))
    if params.greedy:
        return verify_greedy(tree, logits)
    return verify_sampling(tree, probs_from_logits(logits, params), gen)


@dataclass
class StepReport:
    """What one step did: the tokens it emitted and, for a verified draft, how much was accepted."""

    tokens: list[int]
    # "prefill", "speculative" (a drafter's draft was verified), "lookup" (only a chain copied from the text
    # was: prompt lookup, or a plain step of the fallback's that found one) or "plain" (one token, no draft)
    kind: str
    drafted: int = 0
    accepted: int = 0
    depth: int = 0  # levels of the verified draft
    draft_s: float = 0.0
    verify_s: float = 0.0  # the target forward of this step
    held: bool = False  # the verified tree was held back from the previous step's draft (staged)
    top_ranked: int = 0  # accepted nodes that were each the drafter's top-ranked child (DraftTree.top_ranked_run)
    top_depth: int = 0  # levels of the draft's top-1 chain (DraftTree.top_ranked_depth; a chain's depth)
    # the drafter's own tree within a draft that a context-lookup chain extended (decode/lookup.py): its
    # depth and the accepted nodes on it, which is what the monitor learns the drafter's acceptance from
    drafter_depth: int = 0
    drafter_accepted: int = 0
    lookup_rows: int = 0  # verified rows the lookup chain added beside the drafter's
    lookup_found: int = 0  # the chain's length as found, before a batch capped it (decode/round.py)
    chain_accepted: int = 0  # of the chain's verified tokens, those the target accepted (alone it would have too)


SLOT_SLACK = 64  # rows a solo slot holds beyond prompt + budget (a verified tree's extra rows)


def full_attention(target: Target) -> bool:
    """Whether every layer of the target's cache attends to the whole past (what a KV slot holds)."""
    from transformers.cache_utils import DynamicLayer

    return all(type(layer) is DynamicLayer for layer in target.new_cache().layers)


class SpeculativeDecoding:
    """Speculative decoding of one sequence, one draft-verify-commit step per `step()` call, so a
    server can interleave many sequences. `step(speculate=False)` verifies the pending token
    alone (a plain decode step; with a lookup, outside a batch, the pending token and the chain
    copied from the text, when one is found); the target features of such steps are kept and handed
    to the proposer when speculation resumes, so its cache stays exact. With no proposer and a
    lookup, every step is such a lookup step (prompt lookup).

    The target KV cache is a slot of a BatchKV: of the shared one once `join`ed to a batch, else of
    a one-slot BatchKV of its own (a solo generation is a batch of one). A target with sliding-window
    layers cannot use a slot: it keeps transformers' DynamicCache and takes plain steps only."""

    def __init__(self, target: Target, proposer: Proposer | None, prompt_ids, cfg: GenerationConfig,
                 shape: TreeShape | AdaptiveDepth | None, staged: int | None = None,
                 lookup: LookupSettings | None = None):
        if staged is not None and staged < 1:
            raise AnchorspecError(f"staged verification needs at least 1 level in its first stage, got {staged}")
        if staged is not None and isinstance(shape, AdaptiveDepth):
            raise AnchorspecError("staged verification and an adaptive depth do not combine: the controller "
                                  "would see each draft split in two")
        if lookup is not None and staged is not None:
            raise AnchorspecError("staged verification and a lookup chain do not combine: the chain's rows are not "
                                  "in level order")
        self.target, self.cfg, self.staged = target, cfg, staged
        # the chain is merged into the drafter's tree; with no proposer it is the whole draft (prompt lookup)
        self.lookup = ContextLookup(lookup) if lookup is not None else None
        # the drafter's tree, the chain merged into it, and how long the chain was found (before a batch's cap)
        self._lookup_step: tuple[DraftTree, list[int], int] | None = None
        self._lookup_skipped = False  # the prepared step drafted without the lookup (draft's `lookup`)
        self.ids = _check_prompt(target, prompt_ids, cfg)
        self.stats = GenerationStats(prompt_tokens=self.ids.numel())
        self.gen = cfg.generator()
        self.out = _Output(cfg)
        self.cache: KVSlot | object | None = None  # a KVSlot, or a DynamicCache (sliding-window target)
        self.batched = False  # in a BatchDecoder's shared cache (decode/round.py)
        self.started = False
        self.t0 = 0.0
        self.committed = 0  # rows in the target cache
        # prepared, not yet finished: (rows, draft_s, whether the rows were held back by a staged step)
        self._pending: tuple[DraftTree, float, bool] | None = None
        self._whole: DraftTree | None = None  # staged: the whole draft while its first levels are verified
        self._held: DraftTree | None = None  # staged: the subtree the next step verifies without drafting
        self._unread_aux: list[torch.Tensor] = []  # target features of committed rows the proposer has not read
        # an AdaptiveDepth changes the shape from step to step; self.shape is then its base shape
        self.policy = shape if isinstance(shape, AdaptiveDepth) else None
        self.proposer, self.shape = proposer, shape.base if self.policy else shape
        # whether steps draft (a drafter, or a lookup copying from the text): the sequence is then kept, and timed
        self.drafts = proposer is not None or self.lookup is not None
        # a solo greedy stream's rule for a step whose lookup found a chain of n tokens: True verifies the chain
        # alone, no drafter pass (StreamMonitor.chain_alone; run() sets it); None: the chain is merged
        self.chain_alone: Callable[[int], bool] | None = None
        if proposer is not None:
            proposer.reset()

    @property
    def finished(self) -> bool:
        return self.out.finish is not None

    def join(self, kv: BatchKV) -> None:
        """Decode in `kv`, shared with other sequences (before the prefill, which writes into it)."""
        if self.started:
            raise AnchorspecError("join a batch before the prefill")
        self.cache, self.batched = kv.attach_target(self.target), True

    def start_from(self, prefix: SharedPrefix) -> None:
        """Start without a prefill: `prefix` holds the target's rows for the prompt minus its last
        token, which are copied into this sequence's slot; the last prompt token is then fed like any
        pending token, by the first plain step (so in a batch it rides the round's forward instead of
        prefilling alone). Plain decoding or prompt lookup only: a drafter would need the prefix's target
        features."""
        if self.started:
            raise AnchorspecError("start_from replaces the prefill: call it before the first step")
        if self.proposer is not None:
            raise AnchorspecError("a shared-prefix start serves plain decoding only (the drafter would need the "
                                  "prefix's target features)")
        if prefix.tokens != tuple(self.ids[:-1].tolist()):
            raise AnchorspecError("a shared prefix must be the prompt without its last token")
        if self.cache is None:
            if not full_attention(self.target):
                raise AnchorspecError("a shared-prefix start needs a full-attention target (KV slots)")
            self.cache = self._solo_slot()
        self.cache.kv.extend(self.cache, prefix.keys, prefix.values)
        self.committed = len(prefix.tokens)
        if self.lookup is not None:
            self.sequence = self.ids  # ending with its pending token, the prompt's last
        self.started, self.t0 = True, time.perf_counter()

    def use_slot(self, slot: KVSlot) -> None:
        """Continue in a batch: `slot` holds a copy of this sequence's committed rows."""
        if slot.length != self.committed:
            raise AnchorspecError(f"KV slot holds {slot.length} rows, the sequence has {self.committed}")
        self.cache, self.batched = slot, True

    def slots(self) -> list[KVSlot]:
        """The KV slots this sequence holds, to release when it leaves a batch: the target's once it
        joined one, and its proposer's drafter slot (shared in a batch, else the proposer's own)."""
        target = [self.cache] if self.batched else []
        proposer_cache = getattr(self.proposer, "cache", None)
        return target + ([proposer_cache] if isinstance(proposer_cache, KVSlot) else [])

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

    def _forward(self, tree: DraftTree, capture_aux: bool, last_only: bool = False):
        """The target on `tree` after the committed rows, alone: (logits, aux or None)."""
        if isinstance(self.cache, KVSlot):
            out = batch_forward(self.target, [self.cache], [tree], capture_aux, last_only)
            return out.logits[0], out.aux[0] if capture_aux else None
        if self.committed and tree.size > 1:
            raise AnchorspecError("speculative decoding needs full-attention KV caches; this target has "
                                  "sliding-window layers (plain decoding works)")
        out = self.target.forward(tree.tokens, torch.arange(self.committed, self.committed + tree.size), self.cache,
                                  capture_aux=capture_aux, last_only=last_only)
        return out.logits, out.aux

    def _commit(self, keep: list[int], written: int) -> None:
        """Keep tree rows `keep` of the `written` after the committed prefix (a DynamicCache only
        takes 1-row steps: its row is already in place)."""
        if isinstance(self.cache, KVSlot):
            self.cache.commit(self.committed, keep)
        self.committed += len(keep)

    def _check_step(self) -> None:
        if self.finished:
            raise AnchorspecError("generation is already finished")
        if self._pending is not None:
            raise AnchorspecError("a prepared step is pending: call finish() first")

    def _begin(self, draft_tree: DraftTree, t: float, held: bool = False) -> DraftTree:
        self._pending = (draft_tree, time.perf_counter() - t, held)
        return draft_tree

    def _take_pending(self) -> tuple[DraftTree, float, bool]:
        if self._pending is None:
            raise AnchorspecError("finish() without prepare()")
        pending, self._pending = self._pending, None
        return pending

    @torch.inference_mode()
    def step(self, speculate: bool = True, shape: TreeShape | None = None) -> StepReport:
        """The prefill, then prepare + a batch-of-one forward + finish."""
        self._check_step()
        if not self.started:
            return self._prefill()
        if self.batched:
            raise AnchorspecError("this sequence is attached to a batch: step it with its BatchDecoder")
        tree = self.prepare(speculate, shape)
        t = time.perf_counter()
        logits, aux = self._forward(tree, capture_aux=self.proposer is not None)
        return self.finish(logits, aux, time.perf_counter() - t)

    @torch.inference_mode()
    def prepare(self, speculate: bool = True, shape: TreeShape | None = None) -> DraftTree:
        """Draft (unless `speculate` is off or no room is left): the tree the target must verify.
        `shape`: this step's draft shape instead of the sequence's (not with an adaptive depth)."""
        return run_program(self.draft(speculate, shape))

    def draft(self, speculate: bool = True, shape: TreeShape | None = None, lookup: bool = True) -> Program:
        """`prepare` as a program of drafter passes (decode/drafting.py), so that a BatchDecoder can
        run the passes of many sequences together. Its driver runs it under inference_mode. `lookup` False: this
        step drafts without the lookup chain (a batched round that one row's chain would widen for every row)."""
        self._check_step()
        self._lookup_skipped = self.lookup is not None and not lookup
        if not self.started:
            raise AnchorspecError("prefill first: the first step() runs the prompt")
        t = time.perf_counter()
        held, self._held = self._held, None
        if held is not None and speculate:  # the rest of a staged draft, within the token budget
            return self._begin(held.levels(self.out.remaining - 1)[0], t, held=True)
        if shape is not None and self.policy is not None:
            raise AnchorspecError("a step's own shape and an adaptive depth do not combine")
        explored = shape is not None  # a step drafting another shape than the sequence's, to price it
        shape = shape or (self.policy.shape() if self.policy else self.shape)
        # never draft deeper than the tokens still allowed (the bonus token takes one)
        step_shape = shape.capped(self.out.remaining - 1) if speculate and self.proposer is not None else None
        if step_shape is None:  # nothing to draft (no proposer, no room, or speculation is off): the root alone
            root = self._root()
            return self._begin(self._merge_lookup(root) if lookup and self._looks_up_alone(speculate) else root, t)
        chain = self._copied_chain() if self.lookup is not None and lookup else []
        if chain and not explored and self._chain_alone_pays(len(chain)):
            return self._begin(self._merge_lookup(self._root(), chain), t)
        if hasattr(self.proposer, "propose_passes"):
            yield from self.proposer.update_passes(self.sequence, self._take_unread_aux())
            tree = yield from self.proposer.propose_passes(step_shape, self.cfg.sampling, self.gen)
        else:  # a proposer without passes drafts in one go
            self.proposer.update(self.sequence, self._take_unread_aux())
            tree = self.proposer.propose(step_shape, self.cfg.sampling, self.gen)
        if self.staged is not None and tree.depth > self.staged and tree.depth_ordered:
            self._whole, tree = tree, tree.levels(self.staged)[0]
        if chain:
            tree = self._merge_lookup(tree, chain)
        return self._begin(tree, t)

    def _root(self) -> DraftTree:
        """The pending token alone: the last one emitted, or the prompt's last after a shared-prefix start."""
        return DraftTree(torch.tensor([self.out.tokens[-1] if self.out.tokens else int(self.ids[-1])]), [-1])

    def _chain_alone_pays(self, found: int) -> bool:
        """Whether this speculating step verifies the copied chain alone (`chain_alone`, which decides for greedy
        decoding only): a solo stream on a KV slot only (a batch pads every row to its widest, decode/round.py)."""
        return (self.chain_alone is not None and not self.batched and isinstance(self.cache, KVSlot)
                and self.chain_alone(found))

    def _looks_up_alone(self, speculate: bool) -> bool:
        """Whether a step with no drafter passes still drafts the lookup chain: prompt lookup (no proposer),
        and a solo stream's plain steps, where the fallback found the drafter not paying but copied text may
        still (in a batch a chain would widen every row's forward, which a plain round is there to avoid)."""
        if self.lookup is None or not isinstance(self.cache, KVSlot):  # a DynamicCache takes 1-row steps only
            return False
        return speculate if self.proposer is None else not speculate and not self.batched

    def pending_chain(self) -> int:
        """Copied tokens in the prepared draft when it is a lookup chain alone (no drafter pass), else 0."""
        if self._pending is None or self._lookup_step is None or self._lookup_step[0].size != 1:
            return 0
        return self._pending[0].size - 1

    def cap_chain(self, tokens: int) -> DraftTree:
        """Verify at most `tokens` of the prepared copied chain (pending_chain): a batch prices each row's
        width (decode/round.py). The chain's adaptive length learns from what is verified; a chain capped to
        nothing is a plain step, which teaches it nothing. Returns the draft to verify."""
        if tokens < 0:
            raise AnchorspecError(f"a chain's cap is a count of tokens, got {tokens}")
        tree, draft_s, held = self._pending
        if tokens >= self.pending_chain():
            return tree
        kept, _ = tree.levels(tokens)  # a chain: its first levels are its first tokens
        drafted_by, chain, found = self._lookup_step
        self._lookup_step = (drafted_by, chain[:tokens], found) if tokens else None
        self._pending = (kept, draft_s, held)
        return kept

    def _copied_chain(self) -> list[int]:
        """The chain the lookup copies after the sequence's last token ([] where its suffix did not occur before)."""
        self.lookup.extend(self.sequence[len(self.lookup.tokens):].tolist())
        return self.lookup.propose(self.out.remaining - 1)  # the bonus token's slot stays free, as for the drafter

    def _merge_lookup(self, tree: DraftTree, chain: list[int] | None = None) -> DraftTree:
        """`tree` with the lookup chain (`chain`, else the one copied now) merged in, when there is one."""
        chain = self._copied_chain() if chain is None else chain
        if not chain:
            return tree
        self._lookup_step = (tree, chain, len(chain))
        return merge_chain(tree, chain)

    def result(self) -> GenerationResult:
        if not self.finished:
            raise AnchorspecError("generation is not finished yet")
        return GenerationResult(self.out.tokens, self.out.finish, self.stats)

    def run(self, fallback: StreamMonitor | None = None, explore: tuple[TreeShape, ...] | None = None) -> GenerationResult:
        """To the end; with `fallback`, steps go plain while it says speculation does not pay
        (decode/fallback.py), and its costs and acceptance learn from every step. `explore` (the
        candidate trees; None: off): the sequence's shape was measured, not given, so now and then a
        step drafts another candidate, to keep the costs that chose the shape current (StreamMonitor.explore)."""
        # a disabled monitor still learns (costs, acceptance), so the shape it chooses follows the drafter;
        # it never switches a step to plain (DriftMonitor._pays)
        if fallback is None or self.proposer is None:
            while not self.finished:
                self.step()
            return self.result()
        if fallback.enabled and not fallback.calibrated and fallback.fixed_threshold is None:
            fallback.calibrate(self.target, self.proposer)  # leaves the proposer reset
        state = fallback.start(self.shape, self.cfg.sampling)
        self.chain_alone = fallback.chain_alone if self.lookup is not None else None
        exploring = explore is not None and self.policy is None and self.staged is None
        previous = self.step()  # the prefill
        while not self.finished:
            fallback.start_round([state])  # a due retry turns speculation back on
            shape = fallback.explore(self.shape, explore) if exploring and state.speculating else None
            t, paid = time.perf_counter(), one_offs()
            report = self.step(state.speculating, shape)
            self.stats.explored_steps += shape is not None
            step_s = time.perf_counter() - t
            # after a prefill or plain stretch the drafter first reads those positions' features;
            # a held-back (staged) step drafted nothing, so it would teach the cost curves a free draft;
            # a step that compiled a graph (a compiled target's or drafter's new shape) or grew a cache paid a one-off
            if not report.held and one_offs() == paid:
                fallback.observe_step(report.kind, report.drafted + 1, report.drafter_depth, report.drafter_accepted,
                                      step_s, report.draft_s, catch_up=previous.kind != "speculative",
                                      top_ranked=report.top_ranked, top_depth=report.top_depth,
                                      shape=shape or self.shape,
                                      lookup_accepted=report.accepted - report.drafter_accepted)
            fallback.learn_chain(report.kind, report.lookup_found, report.chain_accepted, report.accepted,
                                 report.lookup_rows)
            fallback.record(state, report.kind, report.accepted, len(report.tokens))
            previous = report
        self.stats.fallback_switches = state.switches
        return self.result()

    def _take_unread_aux(self) -> torch.Tensor | None:
        """The target features the proposer has not read yet, in one tensor (None: none). Kept as a
        list until then: a plain stretch appends a row a step, and concatenating at each step copied
        the whole stretch every time."""
        parts, self._unread_aux = self._unread_aux, []
        return None if not parts else parts[0] if len(parts) == 1 else torch.cat(parts)

    @torch.inference_mode()
    def finish(self, logits: torch.Tensor, aux: torch.Tensor | None, verify_s: float) -> StepReport:
        """`logits` [N, V] and `aux` [N, n_aux * H] (None without a proposer): the target on the
        prepared tree's N nodes."""
        tree, draft_s, held = self._take_pending()
        stats = self.stats
        if self.drafts:  # plain decoding has no draft to time
            stats.draft_s += draft_s
            stats.verify_s += verify_s
        whole, self._whole = self._whole, None
        judged = tree  # the tree whose nodes the verdict's path numbers
        if whole is None:
            verdict = _verify(tree, logits, self.cfg.sampling, self.gen)
        else:  # staged: the level below the forwarded rows is verified too
            judged, kept = whole.levels(self.staged + 1)
            verdict = _verify(judged, logits, self.cfg.sampling, self.gen)
            if verdict.held is not None and whole.children[kept[verdict.held]]:
                self._held = whole.subtree(kept[verdict.held])
        self._commit(verdict.path, tree.size)
        # the drafter's own tree; the rows a lookup chain added, the chain and its length as found
        drafted_by, lookup_rows, chain, found = judged, 0, None, 0
        if self._lookup_step is not None:
            (drafted_by, chain, found), self._lookup_step = self._lookup_step, None
            lookup_rows = tree.size - drafted_by.size
        elif self.lookup is not None and tree.size > 1 and not self._lookup_skipped:
            self.lookup.observe(None)  # no match this step
        # the accepted path within the drafter's nodes (a lookup chain's own nodes come after all of them): what
        # the drafter's acceptance is learnt from, by the monitor and an adaptive depth
        own = next((k for k, node in enumerate(verdict.path) if node >= drafted_by.size), len(verdict.path))
        drafter_path = verdict.path[:own]
        drafter_depth = drafted_by.depth if chain is not None else tree.depth
        looked_up_alone = drafted_by.size == 1  # a copied chain, no drafter pass (prompt lookup, a fallback step)
        if tree.size > 1:
            stats.record_step(tree.depth, tree.size - 1, verdict.accepted)
            stats.lookup_rows += lookup_rows
            stats.lookup_tokens += verdict.accepted - (len(drafter_path) - 1)
            stats.copied_steps += looked_up_alone
            if self.policy is not None and not looked_up_alone:
                self.policy.observe(drafter_depth, len(drafter_path) - 1)
        else:
            stats.target_forwards += 1
        new = [int(tree.tokens[i]) for i in verdict.path[1:]] + [verdict.next_token]
        chain_accepted = 0 if chain is None else common_prefix(chain, new)
        if chain is not None:
            self.lookup.observe(chain_accepted)
        emitted = self._emit(new)
        if self.drafts:
            self.sequence = torch.cat([self.sequence, torch.tensor(new, dtype=torch.long)])
        if self.proposer is not None:
            self._unread_aux.append(aux[verdict.path])
        if tree.size > 1:
            return StepReport(emitted, "lookup" if looked_up_alone else "speculative", tree.size - 1,
                              verdict.accepted, tree.depth, draft_s, verify_s, held,
                              drafted_by.top_ranked_run(drafter_path), drafted_by.top_ranked_depth, drafter_depth,
                              len(drafter_path) - 1, lookup_rows, found, chain_accepted)
        return StepReport(emitted, "plain", draft_s=draft_s, verify_s=verify_s)

    def _solo_slot(self) -> KVSlot:
        """A one-slot cache of this sequence's own, room for the whole generation: the last new token
        is never fed, so prompt + budget - 1 rows, plus a verified tree's extra rows."""
        kv = BatchKV(slots=1, capacity=self.ids.numel() + self.cfg.max_new_tokens - 1 + SLOT_SLACK)
        return kv.attach_target(self.target)

    def _prefill(self) -> StepReport:
        self.started = True
        self.t0 = t = time.perf_counter()
        if self.cache is None:  # solo: a one-slot cache of its own, room for the whole generation
            if full_attention(self.target):
                self.cache = self._solo_slot()
            else:
                self.cache = self.target.new_cache()
        logits, aux = self._forward(DraftTree.chain(self.ids), capture_aux=self.proposer is not None, last_only=True)
        self._commit(list(range(self.ids.numel())), self.ids.numel())
        self.stats.prefill_s = time.perf_counter() - t
        self.stats.target_forwards = 1
        token = pick_token(logits[-1], self.cfg.sampling, self.gen)
        if self.drafts:
            self.sequence = torch.cat([self.ids, torch.tensor([token])])
        if self.proposer is not None:
            self._unread_aux = [aux]
        return StepReport(self._emit([token]), "prefill", verify_s=self.stats.prefill_s)


class PlainDecoding(SpeculativeDecoding):
    """Plain autoregressive decoding, one token per step: the speculative loop with no proposer (a
    1-node tree each step). The reference every speculative run must match."""

    def __init__(self, target: Target, prompt_ids, cfg: GenerationConfig):
        super().__init__(target, None, prompt_ids, cfg, None)


def generate_vanilla(target: Target, prompt_ids, cfg: GenerationConfig) -> GenerationResult:
    """Plain autoregressive decoding with a KV cache: the reference every speculative run must match."""
    return PlainDecoding(target, prompt_ids, cfg).run()


def generate_prompt_lookup(target: Target, prompt_ids, cfg: GenerationConfig,
                           lookup: LookupSettings = LookupSettings()) -> GenerationResult:
    """Speculative decoding with no drafter: each step verifies the chain copied from where the
    sequence's last tokens occurred before (decode/lookup.py), or decodes one token where they did not."""
    return SpeculativeDecoding(target, None, prompt_ids, cfg, None, lookup=lookup).run()


def generate_speculative(target: Target, proposer: Proposer, prompt_ids, cfg: GenerationConfig,
                         shape: TreeShape | AdaptiveDepth, fallback: StreamMonitor | None = None,
                         staged: int | None = None, explore: tuple[TreeShape, ...] | None = None,
                         lookup: LookupSettings | None = None) -> GenerationResult:
    """`fallback`: the stream's drift monitor (decode/fallback.py), kept across generations so that
    its costs and acceptance accumulate; None speculates at every step. `staged`: levels verified
    in the first stage of a staged verification (None: the whole draft at once). `explore`: see
    SpeculativeDecoding.run. `lookup`: merge a chain copied from the sequence itself into each greedy
    draft (decode/lookup.py)."""
    return SpeculativeDecoding(target, proposer, prompt_ids, cfg, shape, staged, lookup).run(fallback, explore)
