"""Proposers: anything that turns the committed sequence into a draft tree.

The contract (like HF's candidate generators, in tree form):
  reset()                               forget everything (new request)
  update(tokens, aux)                   `tokens` = the whole sequence so far, ending with the pending
                                        token the target has not seen; `aux` = target features of the
                                        positions committed since the last update
  propose(shape, params, generator)     a DraftTree rooted at the pending token
"""

from __future__ import annotations

from typing import Protocol

import torch

from ..models.drafter import Eagle3Drafter, KVCache, additive_mask
from .sampling import SamplingParams, probs_from_logits, sample
from .tree import DraftTree, TreeShape, build_dynamic_tree


class Proposer(Protocol):
    def reset(self) -> None: ...

    def update(self, tokens: torch.Tensor, aux: torch.Tensor | None) -> None: ...

    def propose(self, shape: TreeShape, params: SamplingParams, generator: torch.Generator | None) -> DraftTree: ...


class EagleProposer:
    """EAGLE-3/3.1 drafting: real-feature positions stay in the drafter's KV cache; speculative
    entries are appended while drafting and cropped away afterwards."""

    def __init__(self, drafter: Eagle3Drafter):
        self.drafter = drafter
        self.draft_to_target = drafter.draft_to_target
        self.vocab_size = drafter.config.vocab_size
        self.reset()

    def reset(self) -> None:
        self.cache = KVCache()
        self.logits: torch.Tensor | None = None  # drafter logits after the last real position
        self.hidden: torch.Tensor | None = None  # its next_hidden: x_in for the first draft level
        self.root: int | None = None

    @torch.inference_mode()
    def update(self, tokens: torch.Tensor, aux: torch.Tensor | None) -> None:
        start = self.cache.length
        m = aux.shape[0]
        if start + m != tokens.numel() - 1:
            raise ValueError(f"proposer has {start} positions, got {m} new features for {tokens.numel()} tokens")
        # The spec's shift: the feature of position t is paired with token t+1.
        ids = tokens[start + 1: start + 1 + m].view(1, -1)
        pos = torch.arange(start, start + m).view(1, -1)
        out = self.drafter.step(ids, self.drafter.project_features(aux).unsqueeze(0), pos, self.cache, last_only=True)
        self.logits, self.hidden = out.logits[0, -1], out.next_hidden[0, -1]
        self.root = int(tokens[-1])

    @torch.inference_mode()
    def propose(self, shape: TreeShape, params: SamplingParams, generator: torch.Generator | None) -> DraftTree:
        if shape.is_chain:
            return self._chain(shape.depth, params, generator)
        return self._tree(shape)

    def _chain(self, k: int, params: SamplingParams, generator) -> DraftTree:
        """Greedy: argmax drafts. Sampling: draws from the drafter's distribution q (kept for
        rejection sampling). A single query row attends to the whole cache, which for a chain is
        exactly the context plus its own ancestors, so no mask is needed."""
        n = self.cache.length
        logits, x = self.logits, self.hidden
        tokens, qs = [self.root], []
        for d in range(1, k + 1):
            if params.greedy:
                draft_id = int(torch.argmax(logits))
            else:
                q = probs_from_logits(logits, params)
                draft_id = sample(q, generator)
                qs.append(torch.zeros(self.vocab_size, dtype=q.dtype).index_copy_(0, self.draft_to_target, q))
            tokens.append(int(self.draft_to_target[draft_id]))
            if d < k:
                out = self.drafter.step(torch.tensor([[tokens[-1]]]), x.view(1, 1, -1),
                                        torch.tensor([[n + d - 1]]), self.cache)
                logits, x = out.logits[0, -1], out.next_hidden[0, -1]
        self.cache.crop(n)
        probs = torch.stack([torch.zeros_like(qs[0])] + qs) if qs else None
        return DraftTree(torch.tensor(tokens), list(range(-1, k)), draft_probs=probs)

    def _tree(self, shape: TreeShape) -> DraftTree:
        n = self.cache.length
        k = shape.top_k
        slot: dict[int, int] = {}  # candidate id -> its row in the drafter cache
        ancestry: dict[int, list[int]] = {-1: []}  # candidate id -> cache rows of itself and ancestors
        out_hidden: dict[int, torch.Tensor] = {-1: self.hidden}
        depth: dict[int, int] = {-1: 0}

        def expand(nodes: list[int], toks: list[int], parents: list[int]):
            base = self.cache.length
            for i, (node, parent) in enumerate(zip(nodes, parents)):
                slot[node] = base + i
                ancestry[node] = ancestry[parent] + [base + i]
                depth[node] = depth[parent] + 1
            allowed = torch.zeros(len(nodes), base + len(nodes), dtype=torch.bool)
            allowed[:, :n] = True
            for i, node in enumerate(nodes):
                allowed[i, ancestry[node]] = True
            dtype = self.drafter.fc.weight.dtype
            x_in = torch.stack([out_hidden[p] for p in parents]).unsqueeze(0)
            # a node at depth d predicts the token at target position n + d + 1 from drafter position n + d - 1
            pos = torch.tensor([[n + depth[node] - 1 for node in nodes]])
            out = self.drafter.step(torch.tensor([toks]), x_in, pos, self.cache, additive_mask(allowed, dtype)[None, None])
            for i, node in enumerate(nodes):
                out_hidden[node] = out.next_hidden[0, i]
            logp = torch.log_softmax(out.logits[0], dim=-1)
            top = torch.topk(logp, k, dim=-1)
            return self.draft_to_target[top.indices], top.values

        first = torch.topk(torch.log_softmax(self.logits, dim=-1), k)
        tree = build_dynamic_tree(self.root, self.draft_to_target[first.indices], first.values, expand, shape)
        self.cache.crop(n)
        return tree
