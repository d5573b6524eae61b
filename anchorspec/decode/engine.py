"""The generation loops, batch 1: plain decoding and speculative decoding.

Speculative loop, one iteration:
    tree    = proposer.propose(...)                      # draft (root = pending token)
    logits  = target(tree tokens, tree mask, positions)  # verify in one forward
    verdict = verify(tree, logits)                       # accepted path + one target token
    commit_path(cache, ...)                              # keep the path's KV rows, drop the rest
    proposer.update(sequence, aux features of the path)  # drafter sees the real features
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from ..errors import AnchorspecError
from ..metrics import GenerationStats
from ..models.target import Target
from .kv import commit_path
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


@torch.inference_mode()
def generate_vanilla(target: Target, prompt_ids, cfg: GenerationConfig) -> GenerationResult:
    """Plain autoregressive decoding with a KV cache: the reference every speculative run must match."""
    ids = _check_prompt(target, prompt_ids, cfg)
    stats = GenerationStats(prompt_tokens=ids.numel())
    gen = cfg.generator()
    out = _Output(cfg)
    cache = target.new_cache()
    t0 = time.perf_counter()
    logits = target.forward(ids, torch.arange(ids.numel()), cache, last_only=True).logits[-1]
    stats.prefill_s = time.perf_counter() - t0
    stats.target_forwards = 1
    pos = ids.numel()
    while not out.push(pick_token(logits, cfg.sampling, gen)):
        logits = target.forward(torch.tensor([out.tokens[-1]]), torch.tensor([pos]), cache).logits[-1]
        stats.target_forwards += 1
        pos += 1
    stats.total_s = time.perf_counter() - t0
    stats.new_tokens = len(out.tokens)
    return GenerationResult(out.tokens, out.finish, stats)


def _verify(tree: DraftTree, logits: torch.Tensor, params: SamplingParams, gen) -> Verdict:
    if params.greedy:
        return verify_greedy(tree, logits)
    probs = probs_from_logits(logits, params)
    if tree.draft_probs is not None:
        return verify_chain_sampling(tree, probs, gen)
    return verify_tree_sampling(tree, probs, gen)


def _shape_for(shape: TreeShape, remaining: int) -> TreeShape | None:
    """Never draft deeper than the tokens still allowed (the bonus token takes one)."""
    depth = min(shape.depth, remaining - 1)
    if depth < 1:
        return None
    if depth == shape.depth:
        return shape
    return TreeShape.chain(depth) if shape.is_chain else TreeShape(shape.top_k, depth, shape.total_tokens)


@torch.inference_mode()
def generate_speculative(target: Target, proposer: Proposer, prompt_ids, cfg: GenerationConfig,
                         shape: TreeShape) -> GenerationResult:
    ids = _check_prompt(target, prompt_ids, cfg)
    stats = GenerationStats(prompt_tokens=ids.numel())
    gen = cfg.generator()
    out = _Output(cfg)
    cache = target.new_cache()
    proposer.reset()

    t0 = time.perf_counter()
    first = target.forward(ids, torch.arange(ids.numel()), cache, capture_aux=True, last_only=True)
    stats.prefill_s = time.perf_counter() - t0
    stats.target_forwards = 1
    committed = ids.numel()  # rows in the target cache
    sequence = torch.cat([ids, torch.tensor([pick_token(first.logits[-1], cfg.sampling, gen)])])
    stop = out.push(int(sequence[-1]))
    aux = first.aux

    while not stop:
        t = time.perf_counter()
        step_shape = _shape_for(shape, out.remaining)
        if step_shape is None:  # room for one token only: a plain decode step, nothing to draft
            tree = DraftTree(sequence[-1:].clone(), [-1])
        else:
            proposer.update(sequence, aux)
            tree = proposer.propose(step_shape, cfg.sampling, gen)
        t1 = time.perf_counter()
        stats.draft_s += t1 - t
        verified = target.forward(tree.tokens, tree_position_ids(tree, committed), cache,
                                  attention_mask=tree_attention_mask(tree, committed, target.dtype),
                                  capture_aux=True)
        stats.verify_s += time.perf_counter() - t1

        verdict = _verify(tree, verified.logits, cfg.sampling, gen)
        commit_path(cache, committed, verdict.path)
        committed += len(verdict.path)
        if tree.size > 1:
            stats.record_step(tree.depth, tree.size - 1, verdict.accepted)
        else:
            stats.target_forwards += 1
        new = [int(tree.tokens[i]) for i in verdict.path[1:]] + [verdict.next_token]
        for token in new:
            if out.push(token):
                stop = True
                break
        sequence = torch.cat([sequence, torch.tensor(new, dtype=torch.long)])
        aux = verified.aux[verdict.path]

    stats.total_s = time.perf_counter() - t0
    stats.new_tokens = len(out.tokens)
    return GenerationResult(out.tokens, out.finish, stats)
