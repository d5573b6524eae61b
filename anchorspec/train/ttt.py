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

Gradients reach fc, fc_norm (3.1), the midlayer, norm and lm_head; the token embedding (the
target's, bound with `bind_target_embedding`) is frozen: it is used detached. Works in
float32/float64 and under bf16 autocast (attention scores and softmax are kept in fp32).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..errors import AnchorspecError
from ..models.drafter import Eagle3Drafter, apply_rope

DECAY = 0.8


@dataclass
class TTTOutput:
    loss: torch.Tensor  # scalar: sum_k DECAY**k * loss_per_step[k]
    loss_per_step: torch.Tensor  # [K]
    acc_per_step: torch.Tensor  # [K] (no grad)
    valid_per_step: torch.Tensor  # [K] int64 counts
    logits: torch.Tensor | None = None  # [K, B, T, Vd] when return_logits (slot t, step k)


def _score_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


class _SoftCrossEntropy(torch.autograd.Function):
    """-sum_i p_i log_softmax(x)_i over the last dim, = logsumexp(x) - <p, x> since p sums to 1, with
    the gradient (softmax(x) - p) written directly: the [.., V] log-probabilities are never stored,
    which on a CPU was most of the loss's time. The argmax comes from the fp32 copy because a bf16
    argmax has no vectorised CPU kernel (20x slower, measured)."""

    @staticmethod
    def forward(ctx, logits, p):
        x = logits.to(_score_dtype(logits.dtype))
        lse = torch.logsumexp(x, dim=-1)
        ce = lse - torch.linalg.vecdot(x, p.to(x.dtype))
        ctx.save_for_backward(x, p, lse)
        ctx.logits_dtype = logits.dtype
        top = x.argmax(-1)
        ctx.mark_non_differentiable(top)
        return ce, top

    @staticmethod
    def backward(ctx, grad, _grad_top):
        x, p, lse = ctx.saved_tensors
        g = (x - lse.unsqueeze(-1)).exp_().sub_(p.to(x.dtype)).mul_(grad.unsqueeze(-1))
        return g.to(ctx.logits_dtype), None


def soft_cross_entropy(logits: torch.Tensor, p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(cross-entropy of ``logits`` against the distribution ``p`` per row, the argmax of ``logits``),
    computed in fp32 (fp64 for fp64 logits); no gradient reaches ``p``."""
    return _SoftCrossEntropy.apply(logits, p.detach())


def _ttt_attention(drafter: Eagle3Drafter, u, cos, sin, k, kv0, diag, allowed0):
    """One TTT attention. u [B,T,2H]; kv0 = step-0 (K, V) [B,nh,T,hd] (None at step 0, then set);
    diag = list of (K_j, V_j) for steps 1..k-1, this step's appended; allowed0 [B,1,T,T] bool."""
    attn = drafter.midlayer.self_attn
    c = drafter.config
    B, T, _ = u.shape
    groups = c.num_attention_heads // c.num_key_value_heads
    q = attn.q_proj(u).view(B, T, c.num_attention_heads, c.head_dim).transpose(1, 2)
    key = attn.k_proj(u).view(B, T, c.num_key_value_heads, c.head_dim).transpose(1, 2)
    val = attn.v_proj(u).view(B, T, c.num_key_value_heads, c.head_dim).transpose(1, 2)
    q, key = apply_rope(q, cos, sin), apply_rope(key, cos, sin)
    key = key.repeat_interleave(groups, dim=1)
    val = val.repeat_interleave(groups, dim=1)
    if k == 0:
        kv0 = (key, val)
    else:
        diag.append((key, val))
    K0, V0 = kv0
    sdt = _score_dtype(q.dtype)
    scale = 1.0 / math.sqrt(c.head_dim)
    qs = q.to(sdt)
    scores0 = (qs @ K0.to(sdt).transpose(-1, -2)) * scale  # [B,nh,T,T]
    scores0 = scores0.masked_fill(~allowed0, float("-inf"))
    parts = [scores0] + [(qs * Kj.to(sdt)).sum(-1, keepdim=True) * scale for Kj, _ in diag]
    probs = torch.cat(parts, dim=-1).softmax(-1)
    out = probs[..., :T].to(V0.dtype) @ V0
    for j, (_, Vj) in enumerate(diag):
        out = out + probs[..., T + j: T + j + 1].to(Vj.dtype) * Vj
    out = out.transpose(1, 2).reshape(B, T, -1)
    return attn.o_proj(out), kv0


def ttt_forward(drafter: Eagle3Drafter, aux: torch.Tensor, input_ids: torch.Tensor, target_logits: torch.Tensor,
                loss_mask: torch.Tensor, steps: int = 7, padding_mask: torch.Tensor | None = None,
                return_logits: bool = False, target_in_draft: torch.Tensor | None = None) -> TTTOutput:
    """The TTT unroll and loss (see the module docstring for the exact semantics).

    aux [B,T,n_aux*Ht], input_ids [B,T], target_logits [B,T,V], loss_mask [B,T] (1 = assistant),
    padding_mask [B,T] (1 = real token; None = no padding).

    With ``target_in_draft`` [B,T] bool (= t2d[argmax Z_t], computed where the full logits were
    seen), ``target_logits`` are already restricted to the draft vocabulary, [B,T,Vd] in draft-id
    order (Z[..., draft_to_target]): what the offline feature cache provides without storing V logits.
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
    draft_space = target_in_draft is not None
    want = drafter.config.draft_vocab_size if draft_space else drafter.config.vocab_size
    if target_logits.shape[-1] != want:
        raise AnchorspecError(f"target logits have {target_logits.shape[-1]} entries, expected "
                              + (f"the draft vocabulary's {want}" if draft_space else f"the drafter's vocab_size {want}"))
    if draft_space and tuple(target_in_draft.shape) != (B, T):
        raise AnchorspecError(f"target_in_draft has shape {tuple(target_in_draft.shape)}, expected {(B, T)}")
    device = input_ids.device
    K = steps
    mid = drafter.midlayer
    pad = (torch.ones(B, T, dtype=torch.bool, device=device) if padding_mask is None
           else padding_mask.to(device=device).bool())
    lmask = loss_mask.to(device) > 0

    # Frozen target embedding of x_{t+k+1} for every step: ids padded with K+1 zeros at the end.
    ids_pad = torch.cat([input_ids, input_ids.new_zeros(B, K + 1)], dim=1)
    emb_all = F.embedding(ids_pad, drafter.embed_weight.detach())

    ar = torch.arange(T, device=device)
    causal = ar[None, :] <= ar[:, None]  # [T(query), T(key)]
    allowed0 = causal[None] & (pad[:, None, :] | torch.eye(T, dtype=torch.bool, device=device)[None])
    allowed0 = allowed0[:, None]  # [B,1,T,T]

    draft_to_target = drafter.draft_to_target
    t2d = drafter.t2d

    # The soft targets of every slot, once: step k reads the window [k+1, k+1+n) of the same rows.
    with torch.no_grad():
        Z_all = target_logits.detach()
        Z_all = Z_all.to(_score_dtype(Z_all.dtype))
        if draft_space:
            representable_all = target_in_draft.to(device).bool()
        else:
            representable_all = t2d[Z_all.argmax(-1)]
            Z_all = Z_all[..., draft_to_target]
        p_all = torch.softmax(Z_all, dim=-1)
        p_argmax_all = Z_all.argmax(-1)  # = p's argmax: the target's choice within the draft vocabulary
        del Z_all

    x_in = drafter.project_features(aux)
    kv0, diag = None, []
    losses, accs, counts, all_logits = [], [], [], []
    for k in range(K):
        emb = emb_all[:, k + 1: k + 1 + T].to(drafter.fc.weight.dtype)
        pos = (ar + k)[None].expand(B, T)
        cos, sin = drafter.rope(pos, drafter.fc.weight.dtype)
        u = torch.cat([mid.input_layernorm(emb), mid.hidden_norm(x_in)], dim=-1)
        attn_out, kv0 = _ttt_attention(drafter, u, cos, sin, k, kv0, diag, allowed0)
        r1 = x_in + attn_out
        h = r1 + mid.mlp(mid.post_attention_layernorm(r1))
        normed = drafter.norm(h)
        x_in = normed if drafter.config.norm_output else h
        n = T - k - 2  # slots t with t + k + 2 < T: the head runs only where a prediction is scored
        if return_logits:
            all_logits.append(drafter.lm_head(normed).to(_score_dtype(normed.dtype)))
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
        losses.append(torch.where(valid, ce, torch.zeros_like(ce)).sum() / count.clamp(min=1))
        with torch.no_grad():
            correct = ((top == p_argmax_all[:, k + 1: k + 1 + n]) & valid).sum()
            accs.append(correct.float() / count.clamp(min=1).float())
        counts.append(count)

    loss_per_step = torch.stack([lk.to(losses[0].dtype) for lk in losses])
    weights = DECAY ** torch.arange(K, dtype=loss_per_step.dtype, device=device)
    return TTTOutput(
        loss=(weights * loss_per_step).sum(),
        loss_per_step=loss_per_step,
        acc_per_step=torch.stack(accs),
        valid_per_step=torch.stack(counts),
        logits=torch.stack(all_logits) if return_logits else None,
    )
