"""Attention alignment (`train --attn-align WEIGHT`): an auxiliary loss that makes the drafter's
attention over the context follow the target's attention at the same query position.

Which positions correspond. The drafter's step-0 query at slot t (token x_{t+1}, target feature of
position t) predicts x_{t+2}, like the target's query at position t+1. Drafter key slot s carries
the target feature of position s, so target key j maps to slot j; the query's own key (position
t+1, token x_{t+1}) has no slot of its own and joins slot t, which holds that token. The target's
row over keys 0..t+1 thus becomes a distribution over slots 0..t (`target_slot_map`), and the
attention sink at position 0 stays on slot 0.

Which target layer. The highest aux layer (by default L-3): its attention's queries and keys are
computed from exactly the residual stream the drafter receives as that feature, so its map is one
the drafter can reproduce from its inputs, and of the layers it sees it is the closest to the
next-token prediction the drafter imitates. One layer keeps the probe to one extra [T, T] map.

Heads. Mean over heads on both sides: drafter and target heads have no one-to-one correspondence
(any permutation of the drafter's heads is the same model), while the head-mean is a distribution
over keys that is permutation-free, and it leaves the heads free to specialise.

The loss. KL(target || drafter) per query row, averaged over the rows scored at TTT step 0 (the
step whose keys are the real context; later steps add the drafter's own states, which have no target
counterpart). It is zero exactly when the maps match. The full map (not a sink/window summary) is
used: the drafter computes its probabilities anyway, and the target side is one layer's q.k^T.

Capturing the target's attention. The layer's attention module gets its own config whose
attention implementation is a registered probe: it computes the head-mean softmax(q.k^T * scale)
with a causal, key-padding mask from the (already normed and rotated) q and k the model hands to
its attention function, and then calls the model's own implementation for the output, so the
target's logits and aux states are unchanged. Sliding-window layers are refused.
"""

from __future__ import annotations

import copy
import sys

import torch

from ..errors import AnchorspecError
from ..models.target import Target, TargetOutput, decoder_layers

PROBE = "anchorspec_attention_probe"
_ACTIVE: dict[int, dict] = {}  # id(attention module) -> {"pad": [B, T] bool, "impl": callable, "map": result}


def _probe(module, query, key, value, attention_mask, **kwargs):
    state = _ACTIVE.get(id(module))
    if state is None:
        raise AnchorspecError("attention probe called outside target_attention()")
    if kwargs.get("sliding_window") is not None:
        raise AnchorspecError("--attn-align: the target's chosen layer uses sliding-window attention (not supported)")
    with torch.no_grad():
        B, heads, T, _ = query.shape
        k = key.repeat_interleave(heads // key.shape[1], dim=1)
        sdt = torch.float64 if query.dtype == torch.float64 else torch.float32
        scale = kwargs.get("scaling") or query.shape[-1] ** -0.5
        scores = (query.to(sdt) @ k.to(sdt).transpose(-1, -2)) * scale
        S = k.shape[2]
        allowed = torch.ones(T, S, dtype=torch.bool, device=query.device).tril(S - T)[None]
        allowed = allowed & state["pad"][:, None, :S] | torch.eye(T, S, dtype=torch.bool, device=query.device)[None]
        scores = scores.masked_fill(~allowed[:, None], float("-inf"))
        state["map"] = scores.softmax(-1).mean(1)  # [B, T, S]
    return state["impl"](module, query, key, value, attention_mask, **kwargs)


def _implementation(module, name: str):
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if name in ALL_ATTENTION_FUNCTIONS:
        return ALL_ATTENTION_FUNCTIONS[name]
    eager = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
    if name == "eager" and eager is not None:
        return eager
    raise AnchorspecError(f"--attn-align cannot probe a target whose attention implementation is {name!r}")


def target_attention(target: Target, input_ids: torch.Tensor, padding_mask: torch.Tensor | None,
                     layer: int) -> tuple[TargetOutput, torch.Tensor]:
    """`target.features(input_ids, padding_mask)` plus layer `layer`'s head-mean attention [B, T, T]
    (query position over key position; rows of padded queries see only themselves)."""
    from transformers import AttentionInterface

    AttentionInterface.register(PROBE, _probe)
    attn = decoder_layers(target.model)[layer].self_attn
    if not hasattr(attn, "config"):
        raise AnchorspecError(f"--attn-align: the target's layer {layer} attention has no config to probe through")
    B, T = input_ids.shape
    pad = (torch.ones(B, T, dtype=torch.bool, device=input_ids.device) if padding_mask is None
           else padding_mask.to(input_ids.device).bool())
    original = attn.config
    probed = copy.copy(original)
    probed._attn_implementation = PROBE
    _ACTIVE[id(attn)] = {"pad": pad, "impl": _implementation(attn, original._attn_implementation), "map": None}
    attn.config = probed
    try:
        feats = target.features(input_ids, padding_mask)
        attention = _ACTIVE[id(attn)]["map"]
    finally:
        attn.config = original
        _ACTIVE.pop(id(attn), None)
    if attention is None:
        raise AnchorspecError(f"--attn-align: the target's layer {layer} did not run its attention function")
    return feats, attention


def target_slot_map(target_map: torch.Tensor) -> torch.Tensor:
    """Target attention [B, T, T] (query position, key position) -> [B, T-1, T-1] over drafter slots:
    row t is the target's query at position t+1, key j -> slot j, and the query's own key t+1 added
    to slot t (see the module docstring). Rows still sum to 1."""
    q = target_map[:, 1:, :]  # row t: query position t+1
    n = q.shape[1]
    keep = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()  # keys j <= t keep their slot
    out = q[:, :, :-1] * keep
    idx = torch.arange(n, device=q.device)
    out[:, idx, idx] += q[:, idx, idx + 1]  # the query's own key t+1 -> slot t
    return out


def attention_alignment_loss(drafter_map: torch.Tensor, target_map: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Mean over valid rows of KL(target || drafter), both over drafter slots.

    drafter_map [B, T, T]: the head-mean step-0 attention of the drafter's first layer (slot t over
    slots s, causal); target_map [B, T, T]: the target's head-mean attention by position (see
    `target_slot_map`); valid [B, n] bool for slots t < n <= T-1 (the rows scored at step 0)."""
    B, T, _ = drafter_map.shape
    tgt = target_slot_map(target_map.to(drafter_map.dtype))
    d = drafter_map[:, :T - 1, :T - 1]
    rows = torch.zeros(B, T - 1, dtype=torch.bool, device=valid.device)
    rows[:, :valid.shape[1]] = valid
    tgt = tgt * rows[..., None]  # rows not scored contribute neither value nor gradient
    # d is 0 above the diagonal (masked) where tgt is 0 too: clamp so no 0/0 reaches the gradient
    log_d = d.clamp_min(torch.finfo(d.dtype).tiny).log()
    kl = (torch.xlogy(tgt, tgt) - tgt * log_d).sum(-1)
    return kl.sum() / rows.sum().clamp(min=1)
