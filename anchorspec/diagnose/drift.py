"""Attention drift (spec §1): how a drafter's attention, fed-back state and acceptance change with depth.

For each prompt the target answers greedily; at a few points n of its answer the drafter gets the
target's real features of positions < n (as in decoding) and drafts a greedy chain of `depth`
tokens. The chain is EagleProposer's own: a probe stands in for the drafter inside the proposer and
records, for each query that picks a draft, its attention row and the hidden state it feeds back.

Depth d's query is the drafter row whose logits give draft d: the last real position for d = 1
(it attends to context only), the (d-1)-th drafted position for d > 1.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..api import attach_drafter
from ..decode.engine import GenerationConfig, generate_vanilla
from ..decode.propose import EagleProposer
from ..decode.sampling import SamplingParams
from ..decode.tree import TreeShape
from ..errors import AnchorspecError
from ..models.drafter import Eagle3Drafter, rows_forward
from ..models.masks import causal_mask
from ..models.target import Target


@dataclass
class _Row:
    attn: torch.Tensor  # [heads, S] attention of the query row over the drafter cache
    fed_back: torch.Tensor  # [H] next_hidden: x_in of the next step
    raw: torch.Tensor  # [H] the layer's raw residual output h


class _Probe:
    """Stands in for the drafter inside EagleProposer (every other attribute is the drafter's).
    While `on`, each pass through the decoder layers also computes attention probabilities (of the
    first layer) and its last row is recorded, with the raw state h and the state fed back."""

    def __init__(self, drafter: Eagle3Drafter):
        self._drafter = drafter
        self.on = False
        self.rows: list[_Row] = []

    def __getattr__(self, name):
        return getattr(self._drafter, name)

    def forward_rows(self, token_ids, x_in, position_ids, cache, mask, rows):
        """The drafter's forward_rows, through this probe's `layer` while on (never a compiled graph)."""
        if not self.on:
            return self._drafter.forward_rows(token_ids, x_in, position_ids, cache, mask, rows)
        return rows_forward(self, token_ids, x_in, position_ids, cache, mask, rows)

    def layer(self, token_ids, x_in, position_ids, cache, mask=None, want_attn=False):
        if not self.on:
            return self._drafter.layer(token_ids, x_in, position_ids, cache, mask, want_attn)
        if isinstance(mask, str):  # SDPA's own causal mask: the probabilities need it as a tensor
            mask = causal_mask(token_ids.shape[1], 0, self._drafter.fc.weight.dtype, token_ids.device)
        h, normed, probs = self._drafter.layer(token_ids, x_in, position_ids, cache, mask, want_attn=True)
        # the proposer reads the last row of a pass: a context pass's last position, a chain step's only one
        self.rows.append(_Row(probs[0, :, -1].float(), self._drafter.fed_back(h, normed)[0, -1], h[0, -1]))
        return h, normed, probs


def _rms(x: torch.Tensor) -> float:
    return float(x.double().pow(2).mean().sqrt())


def _points(prompt_len: int, total_len: int, depth: int, count: int) -> list[int]:
    """Evenly spaced n with a pending token n in the prompt's last position or the answer, and all
    `depth` reference tokens n+1..n+depth inside the target's own greedy answer (so a draft's
    acceptance is exactly greedy verification's). n >= 1: the drafter needs one real feature."""
    lo, hi = max(prompt_len - 1, 1), total_len - depth - 1
    if hi < lo:
        return []
    return sorted({round(lo + (hi - lo) * i / max(count - 1, 1)) for i in range(count)})


def _prompt_chains(target, proposer, probe, ids, depth, positions, new_tokens, stop_token_ids):
    """(n, drafts, reference, rows) for each point of one prompt."""
    ids = torch.as_tensor(ids, dtype=torch.long).view(-1)
    cfg = GenerationConfig(max_new_tokens=new_tokens, stop_token_ids=tuple(stop_token_ids))
    seq = torch.cat([ids, torch.tensor(generate_vanilla(target, ids, cfg).token_ids, dtype=torch.long)])
    aux = target.forward(seq, torch.arange(seq.numel()), target.new_cache(), capture_aux=True, last_only=True).aux
    proposer.reset()
    out = []
    for n in _points(ids.numel(), seq.numel(), depth, positions):
        # The proposer is incremental: feed rows up to n-1 quietly, then the last real row with the probe on.
        start = proposer.cache.length
        if n - 1 > start:
            proposer.update(seq[:n], aux[start:n - 1])
        probe.on, probe.rows = True, []
        try:
            proposer.update(seq[:n + 1], aux[n - 1:n])
            tree = proposer.propose(TreeShape.chain(depth), SamplingParams(), None)
        finally:
            probe.on = False
        out.append((n, tree.tokens[1:].tolist(), seq[n + 1:n + 1 + depth].tolist(), probe.rows))
    return out


@torch.inference_mode()
def measure_drift(target: Target, drafter: Eagle3Drafter, prompt_ids_list, depth: int = 8,
                  positions_per_prompt: int = 4, new_tokens: int = 64, sink_tokens: int = 4,
                  stop_token_ids=()) -> dict:
    """Per-depth attention shares, fed-back hidden RMS and acceptance of greedy draft chains.

    `prompt_ids_list` is any iterable of token-id lists (a tqdm bar works). Attaches the drafter to
    the target (sets the target's aux layers to the drafter's). Returns a JSON-able dict; the
    per-depth lists have `depth` entries, index 0 = depth 1.
    """
    if depth < 1 or positions_per_prompt < 1 or sink_tokens < 1:
        raise AnchorspecError(f"depth, positions_per_prompt and sink_tokens must be >= 1, "
                              f"got {depth}, {positions_per_prompt}, {sink_tokens}")
    if new_tokens < depth:
        raise AnchorspecError(f"new_tokens ({new_tokens}) must be >= depth ({depth}): drafts are checked "
                              "against the target's answer")
    attach_drafter(target, drafter)
    probe = _Probe(drafter)
    proposer = EagleProposer(probe)
    keys = ("attn_sink", "attn_context", "attn_own", "hidden_rms", "raw_hidden_rms")
    sums = {k: [0.0] * depth for k in keys}
    accepted = [0] * depth  # samples whose drafts 1..d all match
    chains, prompts, skipped = [], 0, 0
    for p, ids in enumerate(prompt_ids_list):
        prompts += 1
        found = _prompt_chains(target, proposer, probe, ids, depth, positions_per_prompt, new_tokens, stop_token_ids)
        skipped += not found
        for n, drafts, ref, rows in found:
            for d, row in enumerate(rows):
                head_mean = row.attn.mean(0)  # [S]; positions < n are real, >= n drafted
                sums["attn_sink"][d] += float(head_mean[:min(sink_tokens, n)].sum())
                sums["attn_context"][d] += float(head_mean[:n].sum())
                sums["attn_own"][d] += float(head_mean[n:].sum())
                sums["hidden_rms"][d] += _rms(row.fed_back)
                sums["raw_hidden_rms"][d] += _rms(row.raw)
            run = 0
            while run < depth and drafts[run] == ref[run]:
                run += 1
            for d in range(run):
                accepted[d] += 1
            chains.append({"prompt": p, "position": n, "drafts": drafts, "reference": ref})
    m = len(chains)
    per_depth = {k: [s / m if m else None for s in v] for k, v in sums.items()}
    before = [m] + accepted[:-1]
    c = drafter.config
    return {
        "config": {"variant": c.variant, "fc_norm": c.fc_norm, "norm_output": c.norm_output,
                   "aux_layer_ids": list(target.aux_layer_ids), "depth": depth,
                   "positions_per_prompt": positions_per_prompt, "new_tokens": new_tokens, "sink_tokens": sink_tokens},
        "num_prompts": prompts,
        "skipped_prompts": skipped,  # answers shorter than `depth` tokens leave no point to draft from
        "num_samples": m,
        "depth": list(range(1, depth + 1)),
        **per_depth,
        "acceptance": [a / m if m else None for a in accepted],  # cumulative: drafts 1..d all right
        "conditional_acceptance": [a / b if b else None for a, b in zip(accepted, before)],
        "mean_accepted": sum(accepted) / m if m else None,  # expected accepted drafts of a depth-long chain
        "chains": chains,
    }

