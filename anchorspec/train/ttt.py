"""EAGLE-3 / EAGLE-3.1 training-time test (TTT): the unrolled forward and its loss (spec §5.3).

Notation: a sequence x_0..x_{T-1}; `aux[t]` are the raw target aux states at position t;
`target_logits[t]` = Z_t are the target's logits at position t (they predict x_{t+1}).

Semantics of `ttt_forward` (0-based step k = 0..K-1, "slot" t = 0..T-1):

* hidden_0 = drafter.project_features(aux)  (fc over fc_norm'd chunks in 3.1, plain fc in 3).
* Step k at slot t
    - feeds the token x_{t+k+1} (teacher forcing; ids past the end are padded with 0 and those
      (t, k) are never valid),
    - runs at RoPE position t + k,
    - takes x_in = hidden_0[t] at k = 0, else the fed-back state of step k-1 at the SAME slot t:
      the raw h for EAGLE-3, norm(h) for EAGLE-3.1 (the drafter's own `config.norm_output`,
      exactly what `Eagle3Drafter.step` returns as `next_hidden`),
    - predicts x_{t+k+2}; its logits are lm_head(norm(h)) over the draft vocabulary.
  This is exactly inference (`decode/propose.py`): the real feature of position t is paired with
  token t+1, and the chain token at depth d sits at drafter position n + d - 1; with n = t + 1
  real positions, chain depth d = k runs at position t + k.
* Attention at step k, slot t: the step-0 keys/values of slots s <= t (causal; padded slots are
  masked out, except the slot's own key so no row is empty) plus the keys/values produced by steps
  1..k at the same slot t only (the "diagonal"). Computed like EAGLE's traineagle3 code without a
  [T, K*T] mask: scores = concat(q_k K_0^T (causal-masked [T, T]), q_k[t]·K_j[t] for j = 1..k),
  one softmax over the concatenation (fp32, fp64 for fp64 models), then
  probs[:, :T] @ V_0 + sum_j probs[:, T+j-1] * V_j[t]. GQA via repeat_interleave; the drafter's own
  modules (q/k/v/o_proj, rope, apply_rope, norms, mlp, lm_head) are used, never copies.
* A multi-layer drafter (num_hidden_layers N) runs every step through each of its decoder layers in
  turn with the layers' own `attn_input` / `project` / `finish` (the math of `Eagle3Drafter.layer`);
  each layer attends with the pattern above over its own keys and values.
* Soft target at (t, k): p = softmax(Z_{t+k+1}[draft_to_target]) — the target distribution over
  x_{t+k+2} renormalised over the draft vocabulary, in draft-id order (draft id i <-> target id
  i + d2t[i]). CE(t, k) = -sum_i p_i log_softmax(drafter logits)_i.
* (t, k) is valid iff
    - t + k + 2 < T (the predicted token exists),
    - slots t, t+k+1, t+k+2 are not padding (`padding_mask` 1 = real token, 0 = padding),
    - loss_mask[t + k + 2] == 1: the PREDICTED token is an assistant token. The mask is aligned
      with the token being predicted, so the first assistant token of every turn is trained (a
      mask misaligned with the prediction is the SpecForge #885 boundary pitfall),
    - t2d[argmax Z_{t+k+1}]: the target's own choice is representable in the draft vocabulary.
* loss_k = sum over valid (b, t) of CE / number of valid (TorchSpec's denominator; EAGLE/SpecForge
  divide by all B*T instead), 0 when nothing is valid. loss = sum_k 0.8**k * loss_k.
* acc_k = fraction of valid (b, t) where argmax drafter logits == argmax p (the target's argmax
  restricted to the draft vocabulary); valid_k = the count.

Gradients reach fc, fc_norm (3.1), the decoder layers, norm and lm_head; the token embedding (the
target's, bound with `bind_target_embedding`) is frozen: it is used detached. Works in
float32/float64 and under bf16 autocast (attention scores and softmax are kept in fp32).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..errors import AnchorspecError
from ..models.drafter import Eagle3Drafter
from ..models.dtype import argmax_last
from .attn_align import attention_alignment_loss

DECAY = 0.8


@dataclass
class TTTOutput:
    loss: torch.Tensor  # scalar: sum_k DECAY**k * loss_per_step[k]
    loss_per_step: torch.Tensor  # [K]
    acc_per_step: torch.Tensor  # [K] (no grad)
    valid_per_step: torch.Tensor  # [K] int64 counts
    logits: torch.Tensor | None = None  # [K, B, T, Vd] when return_logits (slot t, step k)
    attn_loss: torch.Tensor | None = None  # the attention-alignment term (unweighted) when target_attn is given
    drafter_attn: torch.Tensor | None = None  # [B, T, T] head-mean step-0 attention of the first layer (then too)


def score_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _ce_forward(logits: torch.Tensor, p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(cross-entropy per row, logsumexp per row) of ``logits`` against ``p``, in p's dtype."""
    x = logits.to(p.dtype)
    lse = torch.logsumexp(x, dim=-1)
    return lse - (x * p).sum(-1), lse


def _ce_grad(logits: torch.Tensor, p: torch.Tensor, lse: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """d(ce)/d(logits) * grad = (softmax(logits) - p) * grad, in the logits' dtype."""
    return ((logits.to(p.dtype) - lse.unsqueeze(-1)).exp() - p).mul(grad.unsqueeze(-1)).to(logits.dtype)


# The two kernels the loss runs: eager by default; `compile_loss()` swaps in inductor-fused ones (one pass
# over the [rows, Vd] logits instead of one per elementwise op: the loss was ~40 % of a bf16 CPU step).
_CE_KERNELS = (_ce_forward, _ce_grad)


def compile_loss(on: bool = True) -> None:
    """Use torch.compile'd (inductor, dynamic shapes) cross-entropy kernels in this process, or eager ones."""
    global _CE_KERNELS
    _CE_KERNELS = ((torch.compile(_ce_forward, dynamic=True), torch.compile(_ce_grad, dynamic=True)) if on
                   else (_ce_forward, _ce_grad))


class _SoftCrossEntropy(torch.autograd.Function):
    """-sum_i p_i log_softmax(x)_i over the last dim, = logsumexp(x) - <p, x> since p sums to 1, with
    the gradient (softmax(x) - p) written directly: the [.., V] log-probabilities are never stored,
    which on a CPU was most of the loss's time. Only the logits (in their own dtype) are saved."""

    @staticmethod
    def forward(ctx, logits, p):
        p = p.to(score_dtype(logits.dtype))
        ce, lse = _CE_KERNELS[0](logits, p)
        ctx.save_for_backward(logits, p, lse)
        top = argmax_last(logits)
        ctx.mark_non_differentiable(top)
        return ce, top

    @staticmethod
    def backward(ctx, grad, _grad_top):
        logits, p, lse = ctx.saved_tensors
        return _CE_KERNELS[1](logits, p, lse, grad), None


def soft_cross_entropy(logits: torch.Tensor, p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(cross-entropy of ``logits`` against the distribution ``p`` per row, the argmax of ``logits``),
    computed in fp32 (fp64 for fp64 logits); no gradient reaches ``p``."""
    return _SoftCrossEntropy.apply(logits, p.detach())


def _ttt_attention(attn, u, cos, sin, k, kv0, diag, allowed0):
    """One TTT attention of one layer's DrafterAttention `attn`. u [B,T,in]; kv0 = step-0 (K, V)
    [B,nh,T,hd] (None at step 0, then set); diag = list of (K_j, V_j) for steps 1..k-1, this step's
    appended; allowed0 [B,1,T,T] bool."""
    c = attn.cfg
    B, T, _ = u.shape
    groups = c.num_attention_heads // c.num_key_value_heads
    q, key, val = attn.project(u, cos, sin)
    key = key.repeat_interleave(groups, dim=1)
    val = val.repeat_interleave(groups, dim=1)
    if k == 0:
        kv0 = (key, val)
    else:
        diag.append((key, val))
    K0, V0 = kv0
    T0 = K0.shape[2]  # context keys (= T, or more when the queries are a subset of the slots)
    sdt = score_dtype(q.dtype)
    scale = 1.0 / math.sqrt(c.head_dim)
    qs = q.to(sdt)
    scores0 = (qs @ K0.to(sdt).transpose(-1, -2)) * scale  # [B,nh,T,T]
    scores0 = scores0.masked_fill(~allowed0, float("-inf"))
    parts = [scores0] + [(qs * Kj.to(sdt)).sum(-1, keepdim=True) * scale for Kj, _ in diag]
    probs = torch.cat(parts, dim=-1).softmax(-1)
    out = probs[..., :T0].to(V0.dtype) @ V0
    for j, (_, Vj) in enumerate(diag):
        out = out + probs[..., T0 + j: T0 + j + 1].to(Vj.dtype) * Vj
    out = out.transpose(1, 2).reshape(B, T, -1)
    return attn.o_proj(out), kv0, probs


def context_mask(pad: torch.Tensor) -> torch.Tensor:
    """[B,1,T,T] bool: slot t sees the step-0 keys of real slots s <= t, and always its own."""
    T = pad.shape[1]
    ar = torch.arange(T, device=pad.device)
    causal = ar[None, :] <= ar[:, None]  # [T(query), T(key)]
    return (causal[None] & (pad[:, None, :] | torch.eye(T, dtype=torch.bool, device=pad.device)[None]))[:, None]


def unroll_step(drafter: Eagle3Drafter, emb, x_in, k: int, kv0s: list, diags: list, allowed0, slots=None):
    """Step k of the unroll at every slot (RoPE position t + k): token embeddings emb [B,T,H] and
    inputs x_in [B,T,H] through each decoder layer with the TTT attention (per layer: kv0s[i] the
    step-0 (K, V), diags[i] the diagonal ones; both updated). Returns (h, norm(h), the first layer's
    attention probabilities [B, heads, T, T + k]). At k >= 1 the queries may be a subset of the
    slots: `slots` [B,S] their indices, emb/x_in [B,S,H], allowed0 their rows [B,1,S,T]."""
    B, T, _ = x_in.shape
    base = torch.arange(T, device=x_in.device)[None].expand(B, T) if slots is None else slots
    pos = base + k
    cos, sin = drafter.rope(pos, drafter.fc.weight.dtype)
    h, first = x_in, None
    for i, layer in enumerate(drafter.decoder_layers):
        attn_out, kv0s[i], probs = _ttt_attention(layer.self_attn, layer.attn_input(emb, h), cos, sin, k, kv0s[i],
                                                  diags[i], allowed0)
        first = probs if i == 0 else first
        h = layer.finish(h, attn_out)
    return h, drafter.norm(h), first


def ttt_forward(drafter: Eagle3Drafter, aux: torch.Tensor, input_ids: torch.Tensor, target_logits: torch.Tensor,
                loss_mask: torch.Tensor, steps: int = 7, padding_mask: torch.Tensor | None = None,
                return_logits: bool = False, target_in_draft: torch.Tensor | None = None,
                target_attn: torch.Tensor | None = None, attn_align: float = 0.0) -> TTTOutput:
    """The TTT unroll and loss (see the module docstring for the exact semantics).

    aux [B,T,n_aux*Ht], input_ids [B,T], target_logits [B,T,V], loss_mask [B,T] (1 = assistant),
    padding_mask [B,T] (1 = real token; None = no padding).

    With ``target_in_draft`` [B,T] bool (= t2d[argmax Z_t], computed where the full logits were
    seen), ``target_logits`` are already restricted to the draft vocabulary, [B,T,Vd] in draft-id
    order (Z[..., draft_to_target]): what the offline feature cache provides without storing V logits.

    With ``target_attn`` [B,T,T] (the target's head-mean attention by position, train/attn_align.py),
    ``attn_align * KL(target || drafter)`` over the rows scored at step 0 is added to the loss.
    """
    if drafter.embed_weight is None:
        raise AnchorspecError("drafter has no token embedding: call bind_target_embedding(target embedding)")
    if steps < 1:
        raise AnchorspecError(f"TTT needs at least one step, got steps={steps}")
    B, T = input_ids.shape
    if aux.shape[:2] != (B, T) or target_logits.shape[:2] != (B, T) or tuple(loss_mask.shape) != (B, T):
        raise AnchorspecError(
            f"TTT inputs disagree: input_ids {tuple(input_ids.shape)}, aux {tuple(aux.shape)}, "
            f"target_logits {tuple(target_logits.shape)}, loss_mask {tuple(loss_mask.shape)}")
    if target_attn is not None and tuple(target_attn.shape) != (B, T, T):
        raise AnchorspecError(f"target attention has shape {tuple(target_attn.shape)}, expected {(B, T, T)}")
    draft_space = target_in_draft is not None
    want = drafter.config.draft_vocab_size if draft_space else drafter.config.vocab_size
    if target_logits.shape[-1] != want:
        raise AnchorspecError(f"target logits have {target_logits.shape[-1]} entries, expected "
                              + (f"the draft vocabulary's {want}" if draft_space else f"the drafter's vocab_size {want}"))
    if draft_space and tuple(target_in_draft.shape) != (B, T):
        raise AnchorspecError(f"target_in_draft has shape {tuple(target_in_draft.shape)}, expected {(B, T)}")
    device = input_ids.device
    K = steps
    layers = drafter.decoder_layers
    pad = (torch.ones(B, T, dtype=torch.bool, device=device) if padding_mask is None
           else padding_mask.to(device=device).bool())
    lmask = loss_mask.to(device) > 0

    # Frozen target embedding of x_{t+k+1} for every step: ids padded with K+1 zeros at the end.
    ids_pad = torch.cat([input_ids, input_ids.new_zeros(B, K + 1)], dim=1)
    emb_all = F.embedding(ids_pad, drafter.embed_weight.detach())

    allowed0 = context_mask(pad)

    draft_to_target = drafter.draft_to_target
    t2d = drafter.t2d

    # The soft targets of every slot, once: step k reads the window [k+1, k+1+n) of the same rows.
    with torch.no_grad():
        Z_all = target_logits.detach()
        Z_all = Z_all.to(score_dtype(Z_all.dtype))
        if draft_space:
            representable_all = target_in_draft.to(device).bool()
        else:
            representable_all = t2d[argmax_last(Z_all)]
            Z_all = Z_all[..., draft_to_target]
        p_all = torch.softmax(Z_all, dim=-1)
        p_argmax_all = argmax_last(Z_all)  # = p's argmax: the target's choice within the draft vocabulary
        del Z_all

    x_in = drafter.project_features(aux)
    kv0s, diags = [None] * len(layers), [[] for _ in layers]  # per layer: step-0 (K, V), diagonal (K_j, V_j)
    drafter_attn = attn_loss = None
    losses, accs, counts, all_logits = [], [], [], []
    for k in range(K):
        emb = emb_all[:, k + 1: k + 1 + T].to(drafter.fc.weight.dtype)
        h, normed, probs = unroll_step(drafter, emb, x_in, k, kv0s, diags, allowed0)
        if target_attn is not None and k == 0:
            drafter_attn = probs.mean(1)  # [B, T, T]: over heads (see attn_align.py)
        x_in = drafter.fed_back(h, normed)
        n = T - k - 2  # slots t with t + k + 2 < T: the head runs only where a prediction is scored
        if return_logits:
            all_logits.append(drafter.lm_head(normed).to(score_dtype(normed.dtype)))
        if n <= 0:
            zero = normed.sum() * 0
            losses.append(zero)
            accs.append(torch.zeros((), device=device))
            counts.append(torch.zeros((), dtype=torch.long, device=device))
            continue
        lg = drafter.lm_head(normed[:, :n])
        valid = (lmask[:, k + 2: k + 2 + n] & pad[:, :n] & pad[:, k + 1: k + 1 + n] & pad[:, k + 2: k + 2 + n]
                 & representable_all[:, k + 1: k + 1 + n])
        ce, top = soft_cross_entropy(lg, p_all[:, k + 1: k + 1 + n])
        count = valid.sum()
        if k == 0 and target_attn is not None:
            attn_loss = attention_alignment_loss(drafter_attn, target_attn.to(device), valid)
        losses.append(torch.where(valid, ce, torch.zeros_like(ce)).sum() / count.clamp(min=1))
        with torch.no_grad():
            correct = ((top == p_argmax_all[:, k + 1: k + 1 + n]) & valid).sum()
            accs.append(correct.float() / count.clamp(min=1).float())
        counts.append(count)

    loss_per_step = torch.stack([lk.to(losses[0].dtype) for lk in losses])
    weights = DECAY ** torch.arange(K, dtype=loss_per_step.dtype, device=device)
    loss = (weights * loss_per_step).sum()
    if attn_loss is not None:
        loss = loss + attn_align * attn_loss
    return TTTOutput(
        loss=loss,
        loss_per_step=loss_per_step,
        acc_per_step=torch.stack(accs),
        valid_per_step=torch.stack(counts),
        logits=torch.stack(all_logits) if return_logits else None,
        attn_loss=attn_loss,
        drafter_attn=drafter_attn,
    )
