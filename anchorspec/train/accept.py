"""Acceptance-maximising second stage (`train --stage accept`, after distillation).

The drafter drafts on training contexts, the target scores the drafts, and the drafter is trained to
maximise the expected accepted length of its own chains (the differentiable total-variation form):

* Contexts: in each sequence, up to S slots t inside the answer (evenly spaced, deterministic, so a
  resumed run sees the same ones). Slot t's context is x_0..x_{t+1} (target features of positions
  0..t, root token x_{t+1}), exactly the state decoding is in after committing x_{t+1}.
* Drafts (on-policy): the drafter's own greedy chain d_1..d_K from that context, drafted by the TTT
  unroll (`ttt.unroll_step`, the drafter's layers and the inference attention pattern) with each
  step fed the previous step's argmax instead of the data's next token. The tokens are constants;
  the drafter's distributions q_k along the chain carry the gradient.
* Scores: the target's distributions p_k after x_0..x_{t+1}, d_1..d_{k-1}: p_1 from the context pass,
  p_2..p_K from one more target pass over every chain (a tree-style mask: each chain token sees its
  context and its own chain).
* Objective: alpha_k = sum_x min(p_k(x), q_k(x)) over the draft vocabulary is the probability that
  speculative sampling accepts q_k's draft at depth k (1 - TV(p_k, q_k); p's mass outside the draft
  vocabulary is never accepted). The expected accepted length of the chain is
  E = sum_k prod_{i<=k} alpha_i, and the loss is -E averaged over the scored chains. q = p maximises
  it, like distillation, but the weight of depth k is the probability of reaching it under the
  drafter's own contexts, where distillation weighs every teacher-forced position alike.
* Reported alongside: the greedy accepted length (leading drafts equal to the target's argmax, what
  the greedy verifier accepts); with one-hot p and q, E equals it exactly.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..errors import AnchorspecError
from ..models.drafter import Eagle3Drafter
from ..models.masks import additive_mask
from ..models.target import Target
from .ttt import score_dtype, context_mask, unroll_step


def acceptance_rates(p_draft: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """alpha = sum_j min(p_j, q_j) [...]: p_draft [..., Vd] the target's probabilities of the draft
    tokens (NOT renormalised over the draft vocabulary), q [..., Vd] the drafter's."""
    return torch.minimum(p_draft, q).sum(-1)


def expected_accepted_length(alpha: torch.Tensor) -> torch.Tensor:
    """sum_k prod_{i<=k} alpha_i over the last dim [..., K]: the expected number of accepted drafts."""
    return torch.cumprod(alpha, dim=-1).sum(-1)


def greedy_accepted_length(drafted: torch.Tensor, target_choice: torch.Tensor) -> torch.Tensor:
    """Leading drafts equal to the target's choice [..., K] -> [...] (what verify_greedy accepts)."""
    return (drafted == target_choice).long().cumprod(dim=-1).sum(-1)


def choose_slots(input_ids: torch.Tensor, loss_mask: torch.Tensor, padding_mask: torch.Tensor | None,
                 per_row: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(slots [B, S] long, valid [B, S] bool): up to `per_row` slots t per row whose root x_{t+1} is
    real and whose context ends in the answer (x_{t+1} or x_{t+2} is an assistant token), evenly
    spaced; rows with fewer repeat a slot, marked not valid."""
    B, T = input_ids.shape
    pad = torch.ones(B, T, dtype=torch.bool) if padding_mask is None else padding_mask.bool().cpu()
    lm = loss_mask.bool().cpu() & pad
    ok = torch.zeros(B, T, dtype=torch.bool)
    ok[:, :T - 1] = pad[:, 1:] & lm[:, 1:]
    ok[:, :T - 2] |= pad[:, 1:T - 1] & lm[:, 2:]
    slots = torch.zeros(B, per_row, dtype=torch.long)
    valid = torch.zeros(B, per_row, dtype=torch.bool)
    for b in range(B):
        cand = ok[b].nonzero().view(-1)
        if cand.numel() == 0:
            continue
        take = cand[torch.linspace(0, cand.numel() - 1, min(per_row, cand.numel())).round().long()]
        slots[b, :take.numel()], valid[b, :take.numel()] = take, True
        slots[b, take.numel():] = take[-1]
    return slots.to(input_ids.device), valid.to(input_ids.device)


def draft_chains(drafter: Eagle3Drafter, aux: torch.Tensor, input_ids: torch.Tensor, slots: torch.Tensor,
                 steps: int, padding_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The drafter's greedy chains from slots [B,S]: (drafted target ids [B,S,K], draft logits
    [B,S,K,Vd] with gradient). Step 0 runs over every slot (its keys are the context); steps >= 1
    only over the chosen slots (a slot's chain sees the context and its own chain only)."""
    if drafter.embed_weight is None:
        raise AnchorspecError("drafter has no token embedding: call bind_target_embedding(target embedding)")
    B, T = input_ids.shape
    pad = (torch.ones(B, T, dtype=torch.bool, device=input_ids.device) if padding_mask is None
           else padding_mask.bool())
    dtype = drafter.fc.weight.dtype
    embed = drafter.embed_weight.detach()
    roots = torch.cat([input_ids[:, 1:], input_ids.new_zeros(B, 1)], dim=1)  # slot t feeds x_{t+1}
    allowed0 = context_mask(pad)
    layers = drafter.decoder_layers
    kv0s, diags = [None] * len(layers), [[] for _ in layers]
    h, normed, _ = unroll_step(drafter, F.embedding(roots, embed).to(dtype), drafter.project_features(aux), 0,
                               kv0s, diags, allowed0)
    index = slots[..., None].expand(B, slots.shape[1], h.shape[-1])
    h, normed = h.gather(1, index), normed.gather(1, index)
    allowed = allowed0.gather(2, slots[:, None, :, None].expand(B, 1, slots.shape[1], T))
    d2t = drafter.draft_to_target
    tokens, logits = [], []
    for k in range(steps):
        if k > 0:
            h, normed, _ = unroll_step(drafter, F.embedding(tokens[-1], embed).to(dtype), x_in, k, kv0s, diags,
                                       allowed, slots=slots)
        lg = drafter.lm_head(normed).to(score_dtype(normed.dtype))
        logits.append(lg)
        tokens.append(d2t[lg.detach().argmax(-1)])
        x_in = drafter.fed_back(h, normed)
    return torch.stack(tokens, dim=2), torch.stack(logits, dim=2)


def score_chains(target: Target, input_ids: torch.Tensor, padding_mask: torch.Tensor | None, slots: torch.Tensor,
                 drafted: torch.Tensor) -> torch.Tensor:
    """The target's logits [B,S,K-1,V] after each chain token d_1..d_{K-1} (the contexts of depths
    2..K), in one pass over the sequences and every chain: chain token (s, j) sits at position
    slots[b,s] + 1 + j and sees the real context up to slots[b,s] + 1 and its own chain up to j."""
    B, T = input_ids.shape
    S, K = drafted.shape[1], drafted.shape[2]
    if K < 2:
        return drafted.new_zeros(B, S, 0, 0, dtype=torch.float32)
    device = input_ids.device
    J = K - 1
    N = S * J
    pad = (torch.ones(B, T, dtype=torch.bool, device=device) if padding_mask is None
           else padding_mask.bool().to(device))
    ids = torch.cat([input_ids, drafted[:, :, :J].reshape(B, N)], dim=1)
    j = torch.arange(1, J + 1, device=device)
    chain_pos = (slots[:, :, None] + 1 + j).reshape(B, N)
    pos = torch.cat([torch.arange(T, device=device)[None].expand(B, T), chain_pos], dim=1)
    allowed = torch.zeros(B, T + N, T + N, dtype=torch.bool, device=device)
    allowed[:, :T, :T] = context_mask(pad)[:, 0]
    ar = torch.arange(T, device=device)
    ctx = (ar[None, None, :] <= (slots[:, :, None] + 1)) & pad[:, None, :]  # [B,S,T]
    allowed[:, T:, :T] = ctx[:, :, None, :].expand(B, S, J, T).reshape(B, N, T)
    own = torch.ones(J, J, dtype=torch.bool, device=device).tril()
    allowed[:, T:, T:] = torch.block_diag(*[own] * S)[None]
    mask = additive_mask(allowed, target.dtype)[:, None]
    keep = (torch.arange(B, device=device)[:, None] * (T + N) + T + torch.arange(N, device=device)).reshape(-1)
    out = target.forward_rows(ids, pos, target.new_cache(), mask, keep)
    return out.logits.clone().view(B, S, J, -1)  # clone: an ordinary tensor, not an inference one


def accept_objective(drafter: Eagle3Drafter, target: Target, aux, input_ids, target_logits, loss_mask,
                     padding_mask, steps: int, per_row: int) -> dict:
    """The stage's loss and figures for one batch. target_logits [B,T,V] (full vocabulary) of the
    context pass. Returns loss (-mean E), expected (E per chain), greedy (greedy length per chain),
    alpha [B,S,K], valid [B,S]."""
    slots, valid = choose_slots(input_ids, loss_mask, padding_mask, per_row)
    drafted, logits = draft_chains(drafter, aux, input_ids, slots, steps, padding_mask)
    B, S, K = drafted.shape
    with torch.no_grad():
        sdt = logits.dtype
        first = target_logits.to(sdt).gather(1, (slots + 1)[..., None].expand(B, S, target_logits.shape[-1]))
        rest = score_chains(target, input_ids, padding_mask, slots, drafted).to(sdt)
        Z = torch.cat([first[:, :, None], rest], dim=2) if K > 1 else first[:, :, None]  # [B,S,K,V]
        p = Z.softmax(-1)
        choice = Z.argmax(-1)
        p_draft = p[..., drafter.draft_to_target]
    q = logits.softmax(-1)
    alpha = acceptance_rates(p_draft, q)
    expected = expected_accepted_length(alpha)
    greedy = greedy_accepted_length(drafted, choice)
    count = valid.sum().clamp(min=1)
    loss = -(torch.where(valid, expected, torch.zeros_like(expected)).sum() / count)
    return {"loss": loss, "expected": expected.detach(), "greedy": greedy, "alpha": alpha.detach(), "valid": valid,
            "drafted": drafted, "choice": choice}


def depth_figures(out: dict, steps: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss_k, acc_k, valid_k) in the trainer's per-step form: valid_k = chains whose greedy drafts
    were all accepted before depth k; acc_k = the share of those accepted at depth k (so 1 + sum of
    cumulative products = 1 + mean greedy accepted length); loss_k = their mean 1 - alpha_k."""
    valid, greedy, alpha = out["valid"], out["greedy"], out["alpha"]
    ks = torch.arange(steps, device=greedy.device)
    reach = valid[..., None] & (greedy[..., None] >= ks)  # [B,S,K] reached depth k (0-based)
    passed = valid[..., None] & (greedy[..., None] > ks)
    n = reach.sum((0, 1))
    acc = passed.sum((0, 1)).double() / n.clamp(min=1).double()
    loss_k = torch.where(reach, 1 - alpha, torch.zeros_like(alpha)).sum((0, 1)) / n.clamp(min=1)
    return loss_k, acc, n
