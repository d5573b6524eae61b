"""Proposers: anything that turns the committed sequence into a draft tree.

The contract (like HF's candidate generators, in tree form):
  reset()                               forget everything (new request)
  update(tokens, aux)                   `tokens` = the whole sequence so far, ending with the pending
                                        token the target has not seen; `aux` = target features of the
                                        positions committed since the last update
  propose(shape, params, generator)     a DraftTree rooted at the pending token
A proposer that can draft in lockstep with other sequences also has `update_passes` and
`propose_passes`: the same two as programs of drafter passes (decode/drafting.py), and
`use_slot` / `cache_rows` to move its drafter cache into a shared batch cache.
"""

from __future__ import annotations

from typing import Protocol

import torch

from ..errors import AnchorspecError
from ..models.drafter import Eagle3Drafter
from ..models.dtype import argmax_last
from .batch import BatchKV, KVSlot
from .drafting import DraftPass, Program, run_program
from .program import run_nested
from .sampling import SamplingParams, probs_from_logits, sample, sample_without_replacement
from .tree import DraftTree, TreeShape, dynamic_tree, sampled_tree


class Proposer(Protocol):
    def reset(self) -> None: ...

    def update(self, tokens: torch.Tensor, aux: torch.Tensor | None) -> None: ...

    def propose(self, shape: TreeShape, params: SamplingParams, generator: torch.Generator | None) -> DraftTree: ...


# Drift-aware pruning (`prune="drift"`): a draft node whose drafter state (the raw residual output h,
# before the final norm: both variants have it) has grown past DRIFT_RATIO times that of the last real
# position is not expanded. The drift diagnosis of the released drafters (`anchorspec drift`) shows
# the mean norm growing ~1.1x by depth 2 and ~1.5x by depth 8, with acceptance gone long before: a
# node 1.25x over its context has left the states the drafter was trained on.
DRIFT_RATIO = 1.25
PRUNE_RULES = (None, "drift")
OWN_CAPACITY = 256  # rows of a proposer's own drafter cache to start with (it doubles when a prompt needs more)


class EagleProposer:
    """EAGLE-3/3.1 drafting: real-feature positions stay in the drafter's KV cache; speculative
    entries are appended while drafting and dropped afterwards. `prune`: None (EAGLE-2's expansion,
    by confidence only) or "drift" (see DRIFT_RATIO)."""

    def __init__(self, drafter: Eagle3Drafter, prune: str | None = None):
        self.drafter = drafter
        self.draft_to_target = drafter.draft_to_target
        self.vocab_size = drafter.config.vocab_size
        self.prune = prune
        self.reset()

    @property
    def prune(self) -> str | None:
        return self._prune

    @prune.setter
    def prune(self, rule: str | None) -> None:
        if rule not in PRUNE_RULES:
            raise AnchorspecError(f"unknown pruning rule {rule!r}; choose drift (or none)")
        self._prune = rule

    def reset(self) -> None:
        # Committed rows only, between drafts. Alone, a one-slot BatchKV of the proposer's own (a solo
        # generation drafts as a batch of one, through the same padded forward as a batch round).
        self.cache: KVSlot = self._own_slot()
        self.logits: torch.Tensor | None = None  # drafter logits after the last real position
        self.hidden: torch.Tensor | None = None  # its next_hidden: x_in for the first draft level
        self.context_norm = 0.0  # its state norm: the drift reference
        self.root: int | None = None

    # --- batch 1 --------------------------------------------------------------------------------
    def update(self, tokens: torch.Tensor, aux: torch.Tensor | None) -> None:
        run_program(self.update_passes(tokens, aux))

    def propose(self, shape: TreeShape, params: SamplingParams, generator: torch.Generator | None) -> DraftTree:
        return run_program(self.propose_passes(shape, params, generator))

    # --- in a batch -----------------------------------------------------------------------------
    def _own_slot(self) -> KVSlot:
        c, w = self.drafter.config, self.drafter.fc.weight
        self._own = BatchKV(slots=1, capacity=OWN_CAPACITY)
        return self._own.attach_empty(c.num_hidden_layers, c.num_key_value_heads, c.head_dim, w.dtype, w.device)

    def cache_rows(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The committed drafter rows, every layer's ([keys], [values]) [1, kv_heads, rows, head_dim]."""
        if self.cache.kv is not self._own:
            raise ValueError("the drafter cache is already in a shared batch slot")
        n = self.cache.length
        return ([k[:1, :, :n] for k in self._own.keys], [v[:1, :, :n] for v in self._own.values])

    def use_slot(self, slot: KVSlot) -> None:
        """Continue on `slot` of a shared BatchKV, which holds a copy of cache_rows() (BatchKV.attach_rows)."""
        if slot.length != self.cache.length:
            raise ValueError(f"slot holds {slot.length} drafter rows, the proposer has {self.cache.length}")
        own, self.cache = self.cache, slot
        if own.kv is self._own:
            own.release()  # its buffers go with it

    # --- the programs ---------------------------------------------------------------------------
    def update_passes(self, tokens: torch.Tensor, aux: torch.Tensor) -> Program:
        start = self.cache.length
        m = aux.shape[0]
        if start + m != tokens.numel() - 1:
            raise ValueError(f"proposer has {start} positions, got {m} new features for {tokens.numel()} tokens")
        # The spec's shift: the feature of position t is paired with token t+1.
        out = yield DraftPass(self.drafter, self.cache, start, tokens[start + 1: start + 1 + m].clone(),
                              torch.arange(start, start + m), aux=aux)
        self.logits, self.hidden = out.logits[0], out.hidden[0]
        self.context_norm = float(out.state_norm[0])
        self.root = int(tokens[-1])

    def drifted(self, state_norm: torch.Tensor) -> torch.Tensor:
        """[m] bool: which rows are not to be expanded (all False without pruning)."""
        if self.prune != "drift":
            return torch.zeros(state_norm.shape, dtype=torch.bool, device=state_norm.device)
        return state_norm > DRIFT_RATIO * self.context_norm

    def propose_passes(self, shape: TreeShape, params: SamplingParams, generator: torch.Generator | None) -> Program:
        committed = self.cache.length
        tree = yield from (self._chain(shape.depth, params, generator) if shape.is_chain
                           else self._tree(shape, params, generator))
        self.cache.crop(committed)  # drop the speculative rows
        return tree

    def _chain(self, k: int, params: SamplingParams, generator) -> Program:
        """Greedy: argmax drafts. Sampling: draws from the drafter's distribution q (kept for
        rejection sampling). A single query row attends to everything before it, which for a chain
        is exactly the context plus its own ancestors, so no mask is needed."""
        n = self.cache.length
        logits, x = self.logits, self.hidden
        tokens, qs = [self.root], []
        for d in range(1, k + 1):
            if params.greedy:
                draft_id = int(argmax_last(logits))
            else:
                q = probs_from_logits(logits, params)
                draft_id = sample(q, generator)
                qs.append(torch.zeros(self.vocab_size, dtype=q.dtype, device=q.device).index_copy_(0, self.draft_to_target, q))
            tokens.append(int(self.draft_to_target[draft_id]))
            if d < k:
                out = yield DraftPass(self.drafter, self.cache, n + d - 1, torch.tensor([tokens[-1]]),
                                      torch.tensor([n + d - 1]), x_in=x.view(1, -1))
                if self.drifted(out.state_norm)[0]:
                    break  # a shorter chain
                logits, x = out.logits[0], out.hidden[0]
        probs = torch.stack([torch.zeros_like(qs[0])] + qs) if qs else None
        return DraftTree(torch.tensor(tokens), list(range(-1, len(tokens) - 1)), draft_probs=probs)

    def _tree(self, shape: TreeShape, params: SamplingParams, generator) -> Program:
        """Greedy: each expanded node's top-k tokens, scored by cumulative log-prob (EAGLE-2's dynamic tree).
        Sampling: top_k tokens drawn from the root's q without replacement, a sampled chain below each
        (`sampled_tree`), every q kept for recursive rejection (decode/verify.py)."""
        n = self.cache.length
        k = shape.top_k
        written = 0  # speculative rows in the cache after the n committed ones
        ancestry: dict[int, list[int]] = {-1: []}  # candidate id -> speculative rows of itself and ancestors
        out_hidden: dict[int, torch.Tensor] = {-1: self.hidden}
        depth: dict[int, int] = {-1: 0}

        def candidates(logits: torch.Tensor, width: int):
            """logits [m, Vd]: target ids [m, width], log-probs [m, width] (-inf: a draw q gave no mass),
            and for sampled drafts q over the target vocabulary [m, V]."""
            if params.greedy:
                top = torch.topk(torch.log_softmax(logits, dim=-1), width, dim=-1)
                return self.draft_to_target[top.indices], top.values, None
            q = probs_from_logits(logits, params)
            drawn = sample_without_replacement(q, width, generator)
            full = torch.zeros(q.shape[0], self.vocab_size, dtype=q.dtype, device=q.device)
            return self.draft_to_target[drawn], q.gather(-1, drawn).log(), full.index_copy_(1, self.draft_to_target, q)

        def expand(request) -> Program:
            nodes, toks, parents = request
            nonlocal written
            for i, (node, parent) in enumerate(zip(nodes, parents)):
                ancestry[node] = ancestry[parent] + [written + i]
                depth[node] = depth[parent] + 1
            # each node sees the committed context, then its own ancestors among the speculative rows
            block = torch.zeros(len(nodes), written + len(nodes), dtype=torch.bool)
            for i, node in enumerate(nodes):
                block[i, ancestry[node]] = True
            # a node at depth d predicts the token at target position n + d + 1 from drafter position n + d - 1
            out = yield DraftPass(self.drafter, self.cache, n + written, torch.tensor(toks),
                                  torch.tensor([n + depth[node] - 1 for node in nodes]),
                                  x_in=torch.stack([out_hidden[p] for p in parents]), block=block)
            written += len(nodes)
            for i, node in enumerate(nodes):
                out_hidden[node] = out.hidden[i]
            tokens, scores, probs = candidates(out.logits, k if params.greedy else 1)
            # a drifted node's children score -inf: the expansion never keeps them
            scores = scores.masked_fill(self.drifted(out.state_norm)[:, None], float("-inf"))
            return (tokens, scores) if probs is None else (tokens, scores, probs)

        tokens, scores, probs = candidates(self.logits.view(1, -1), k)
        expansion = (dynamic_tree(self.root, tokens[0], scores[0], shape) if probs is None
                     else sampled_tree(self.root, tokens[0], scores[0], probs[0], shape))
        return (yield from run_nested(expansion, expand))
