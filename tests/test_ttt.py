"""TTT unroll (anchorspec.train.ttt): equality with the inference path, loss reference, gradients."""

from __future__ import annotations

import os

import pytest
import torch
import transformers

from anchorspec.models.drafter import KVCache, init_drafter
from anchorspec.train.ttt import ttt_forward

V, H, VD = 96, 32, 48
VARIANTS = ["eagle3", "eagle3.1"]


def llama_config():
    return transformers.LlamaConfig(vocab_size=V, hidden_size=H, intermediate_size=64, num_hidden_layers=6,
                                    num_attention_heads=4, num_key_value_heads=2)


def make_drafter(variant, seed=0, dtype=torch.float64):
    d = init_drafter(llama_config(), variant, draft_vocab_size=VD, init_std=0.2, seed=seed)
    gen = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():  # random norm weights make norm placement observable
        for name, p in d.named_parameters():
            if p.dim() == 1 and name.endswith("weight"):
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=gen))
    # A scattered draft vocabulary (not the first ids), so the d2t order matters.
    d.set_vocab_mapping(torch.randperm(V, generator=gen)[:VD])
    d = d.to(dtype)
    d.bind_target_embedding(torch.randn(V, H, generator=gen, dtype=torch.float64).to(dtype))
    return d


def make_batch(B=2, T=10, seed=0, dtype=torch.float64, drafter=None):
    gen = torch.Generator().manual_seed(seed)
    n_aux = 3
    aux = torch.randn(B, T, n_aux * H, generator=gen, dtype=dtype) * 2
    ids = torch.randint(0, V, (B, T), generator=gen)
    logits = torch.randn(B, T, V, generator=gen, dtype=dtype) * 3
    if drafter is not None:  # make most target argmaxes representable in the draft vocab
        boost = torch.rand(B, T, generator=gen) < 0.7
        dv = drafter.draft_to_target
        pick = dv[torch.randint(0, VD, (B, T), generator=gen)]
        logits[boost, pick[boost]] += 10
    mask = (torch.rand(B, T, generator=gen) < 0.7).long()
    return aux, ids, logits, mask


@pytest.mark.parametrize("variant", VARIANTS)
def test_ttt_logits_equal_inference_chain(variant):
    torch.manual_seed(0)
    d = make_drafter(variant)
    B, T, K = 2, 9, 4
    aux, ids, tl, mask = make_batch(B, T, drafter=d)
    out = ttt_forward(d, aux, ids, tl, mask, steps=K, return_logits=True)
    assert out.logits.shape == (K, B, T, VD)
    assert out.logits.dtype == torch.float64
    with torch.no_grad():
        hidden0 = d.project_features(aux)
        checked = 0
        for b in range(B):
            for t in range(T - 1):  # slot T-1 has no token x_T
                cache = KVCache()
                st = d.step(ids[b:b + 1, 1:t + 2], hidden0[b:b + 1, :t + 1], torch.arange(t + 1)[None], cache)
                # fp64 reference logits from the fed-back state (step() returns fp32 logits)
                def ref_logits(s):
                    x = s.next_hidden[0, -1]
                    return d.lm_head(x if d.config.norm_output else d.norm(x))
                ref = ref_logits(st)
                x = st.next_hidden[:, -1:]
                for k in range(K):
                    if t + k + 1 >= T:  # no teacher-forced token left
                        break
                    if k > 0:
                        st = d.step(ids[b:b + 1, t + k + 1:t + k + 2], x, torch.tensor([[t + k]]), cache)
                        ref = ref_logits(st)
                        x = st.next_hidden[:, -1:]
                    assert cache.length == t + 1 + k
                    torch.testing.assert_close(out.logits[k, b, t], ref, atol=1e-10, rtol=0)
                    torch.testing.assert_close(out.logits[k, b, t].float(), st.logits[0, -1], atol=1e-5, rtol=1e-5)
                    checked += 1
    assert checked == B * sum(min(K, T - t - 1) for t in range(T - 1))


def naive_loss(d, tl, ids, mask, K, logits, pad=None):
    """Per-(b, t, k) Python loop over the spec's rules, on given TTT logits [K,B,T,Vd]."""
    B, T = ids.shape
    pad = torch.ones(B, T, dtype=torch.bool) if pad is None else pad.bool()
    dv = d.draft_to_target.tolist()
    total = 0.0
    per, cnts, accs = [], [], []
    for k in range(K):
        s, n, c = 0.0, 0, 0
        for b in range(B):
            for t in range(T):
                if t + k + 2 >= T or not (pad[b, t] and pad[b, t + k + 1] and pad[b, t + k + 2]):
                    continue
                if mask[b, t + k + 2] != 1:
                    continue
                z = tl[b, t + k + 1]
                if int(z.argmax()) not in dv:
                    continue
                p = torch.softmax(torch.stack([z[i] for i in dv]), 0)
                lp = torch.log_softmax(logits[k, b, t], 0)
                s += float(-(p * lp).sum())
                n += 1
                c += int(lp.argmax() == p.argmax())
        per.append(s / n if n else 0.0)
        cnts.append(n)
        accs.append(c / n if n else 0.0)
        total += 0.8 ** k * per[-1]
    return total, per, cnts, accs


@pytest.mark.parametrize("variant", VARIANTS)
def test_loss_matches_naive_reference(variant):
    d = make_drafter(variant, seed=1)
    B, T, K = 3, 12, 7
    aux, ids, tl, mask = make_batch(B, T, seed=3, drafter=d)
    pad = torch.ones(B, T, dtype=torch.long)
    pad[1, 8:] = 0  # right padding
    pad[2, 10:] = 0
    out = ttt_forward(d, aux, ids, tl, mask, steps=K, padding_mask=pad, return_logits=True)
    total, per, cnts, accs = naive_loss(d, tl, ids, mask, K, out.logits.detach(), pad)
    assert out.loss_per_step.shape == (K,) and out.acc_per_step.shape == (K,) and out.valid_per_step.shape == (K,)
    assert out.valid_per_step.tolist() == cnts
    assert sum(cnts[:3]) > 0 and cnts[-1] >= 0
    torch.testing.assert_close(out.loss_per_step.detach(), torch.tensor(per, dtype=torch.float64), atol=1e-10, rtol=0)
    torch.testing.assert_close(out.acc_per_step.double(), torch.tensor(accs, dtype=torch.float64), atol=1e-6, rtol=0)
    assert abs(out.loss.item() - total) < 1e-10
    # Some target argmaxes are outside the draft vocab: those positions were dropped.
    assert not bool(d.t2d[tl.argmax(-1)].all())


def test_masked_positions_do_not_change_the_loss():
    d = make_drafter("eagle3.1", seed=2)
    B, T, K = 2, 10, 5
    aux, ids, tl, mask = make_batch(B, T, seed=5, drafter=d)
    mask[0, 6] = 0
    base = ttt_forward(d, aux, ids, tl, mask, steps=K).loss
    # Z_5 predicts x_6 whose mask is 0: perturbing it changes nothing.
    tl2 = tl.clone()
    tl2[0, 5] = torch.randn(V, dtype=tl.dtype) * 5
    tl2[0, 5, d.draft_to_target[3]] += 20  # keep the target's choice in the draft vocab
    assert ttt_forward(d, aux, ids, tl2, mask, steps=K).loss.item() == base.item()
    # ...while the same perturbation at an unmasked predicted token does.
    mask2 = mask.clone()
    mask2[0, 6] = 1
    a = ttt_forward(d, aux, ids, tl, mask2, steps=K).loss
    b = ttt_forward(d, aux, ids, tl2, mask2, steps=K).loss
    assert abs(a.item() - b.item()) > 1e-6
    # The mask is on the PREDICTED token (t+k+2): masking only x_0, x_1 changes nothing.
    mask3 = mask.clone()
    mask3[:, :2] = 1 - mask3[:, :2]
    assert ttt_forward(d, aux, ids, tl, mask3, steps=K).loss.item() == base.item()


def test_padding_is_respected():
    """Padded slots neither contribute to the loss nor influence real slots (keys are masked)."""
    d = make_drafter("eagle3", seed=4)
    B, T, K = 2, 11, 4
    aux, ids, tl, mask = make_batch(B, T, seed=7, drafter=d)
    L = 7
    pad = torch.ones(B, T, dtype=torch.long)
    pad[1, L:] = 0
    out = ttt_forward(d, aux, ids, tl, mask, steps=K, padding_mask=pad, return_logits=True)
    aux2, ids2, tl2, mask2 = aux.clone(), ids.clone(), tl.clone(), mask.clone()
    aux2[1, L:] = torch.randn_like(aux2[1, L:]) * 7
    ids2[1, L:] = (ids2[1, L:] + 5) % V
    tl2[1, L:] = torch.randn_like(tl2[1, L:])
    mask2[1, L:] = 1
    out2 = ttt_forward(d, aux2, ids2, tl2, mask2, steps=K, padding_mask=pad, return_logits=True)
    assert torch.equal(out.loss, out2.loss)
    assert torch.equal(out.valid_per_step, out2.valid_per_step)
    # Real slots of the padded row whose tokens are all real keep their logits.
    for k in range(K):
        n = L - k - 1
        if n > 0:
            torch.testing.assert_close(out.logits[k, 1, :n], out2.logits[k, 1, :n], atol=1e-12, rtol=0)
    # And the padded row alone equals the unpadded row cut at length L.
    cut = ttt_forward(d, aux[1:, :L], ids[1:, :L], tl[1:, :L], mask[1:, :L], steps=K)
    solo = ttt_forward(d, aux[1:], ids[1:], tl[1:], mask[1:], steps=K, padding_mask=pad[1:])
    torch.testing.assert_close(cut.loss, solo.loss, atol=1e-12, rtol=0)


@pytest.mark.parametrize("variant", VARIANTS)
def test_gradients_flow_to_trainable_parts_only(variant):
    d = make_drafter(variant, seed=5).train()
    d.embed_weight.requires_grad_(True)
    aux, ids, tl, mask = make_batch(2, 10, seed=9, drafter=d)
    out = ttt_forward(d, aux, ids, tl, mask, steps=7)
    assert torch.isfinite(out.loss)
    out.loss.backward()
    assert d.embed_weight.grad is None
    names = ["fc.weight", "midlayer.input_layernorm.weight", "midlayer.hidden_norm.weight",
             "midlayer.self_attn.q_proj.weight", "midlayer.self_attn.k_proj.weight",
             "midlayer.self_attn.v_proj.weight", "midlayer.self_attn.o_proj.weight",
             "midlayer.post_attention_layernorm.weight", "midlayer.mlp.gate_proj.weight",
             "midlayer.mlp.up_proj.weight", "midlayer.mlp.down_proj.weight", "norm.weight", "lm_head.weight"]
    if variant == "eagle3.1":
        names += [f"fc_norm.{i}.weight" for i in range(3)]
    params = dict(d.named_parameters())
    assert set(names) == set(params)
    for name in names:
        g = params[name].grad
        assert g is not None and torch.isfinite(g).all() and g.abs().sum() > 0, name


def test_gradcheck_small():
    """Analytic gradients of the TTT loss (incl. the diagonal attention) match finite differences."""
    d = make_drafter("eagle3.1", seed=6)
    aux, ids, tl, mask = make_batch(1, 6, seed=11, drafter=d)
    mask[:] = 1
    w = d.midlayer.self_attn.k_proj.weight

    def f(kw):
        with torch.no_grad():
            w.copy_(kw)
        return ttt_forward(d, aux, ids, tl, mask, steps=3).loss

    w0 = w.detach().clone()
    w.grad = None
    ttt_forward(d, aux, ids, tl, mask, steps=3).loss.backward()
    g = w.grad.clone()
    eps = 1e-6
    for idx in [(0, 0), (3, 17), (7, 40), (15, 63)]:
        wp, wm = w0.clone(), w0.clone()
        wp[idx] += eps
        wm[idx] -= eps
        fd = (f(wp).item() - f(wm).item()) / (2 * eps)
        assert abs(fd - float(g[idx])) < 1e-6 * max(1.0, abs(fd)), (idx, fd, float(g[idx]))
    with torch.no_grad():
        w.copy_(w0)


@pytest.mark.parametrize("variant", VARIANTS)
def test_float32_and_bf16_autocast(variant):
    d64 = make_drafter(variant, seed=7)
    aux, ids, tl, mask = make_batch(2, 10, seed=13, drafter=d64)
    ref = ttt_forward(d64, aux, ids, tl, mask, steps=4)
    d32 = make_drafter(variant, seed=7, dtype=torch.float32)
    d32.train()
    out32 = ttt_forward(d32, aux.float(), ids, tl.float(), mask, steps=4)
    assert out32.loss.dtype == torch.float32
    torch.testing.assert_close(out32.loss.double(), ref.loss, atol=1e-4, rtol=1e-4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        outbf = ttt_forward(d32, aux.float(), ids, tl.float(), mask, steps=4)
    assert torch.isfinite(outbf.loss)
    assert abs(outbf.loss.item() - ref.loss.item()) < 0.1 * ref.loss.item()
    outbf.loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in d32.parameters() if p.grad is not None)
    assert d32.fc.weight.grad is not None


def test_variants_differ_only_by_flags():
    """Same weights: with fc_norm weights 1 and aux chunks already RMS-normalised, eagle3.1 step 0
    equals eagle3 step 0; later steps differ only because 3.1 feeds back norm(h) — flipping
    norm_output on the eagle3 drafter reproduces 3.1 at every step."""
    d31 = make_drafter("eagle3.1", seed=8)
    d3 = make_drafter("eagle3", seed=8)
    state = {k: v for k, v in d31.state_dict().items() if not k.startswith("fc_norm.")}
    d3.load_state_dict(state)
    d3.bind_target_embedding(d31.embed_weight)
    with torch.no_grad():
        for n in d31.fc_norm:
            n.weight.fill_(1.0)
    B, T, K = 2, 8, 3
    aux, ids, tl, mask = make_batch(B, T, seed=17, drafter=d31)
    chunks = aux.split(H, dim=-1)
    eps = d31.config.rms_norm_eps
    aux = torch.cat([c * torch.rsqrt(c.pow(2).mean(-1, keepdim=True) + eps) for c in chunks], -1)
    a = ttt_forward(d31, aux, ids, tl, mask, steps=K, return_logits=True).logits
    b = ttt_forward(d3, aux, ids, tl, mask, steps=K, return_logits=True).logits
    torch.testing.assert_close(a[0], b[0], atol=1e-5, rtol=1e-5)
    assert (a[1] - b[1]).abs().max() > 1e-3
    d3.config.norm_output = True
    try:
        c = ttt_forward(d3, aux, ids, tl, mask, steps=K, return_logits=True).logits
    finally:
        d3.config.norm_output = False
    torch.testing.assert_close(a, c, atol=1e-5, rtol=1e-5)


def test_soft_cross_entropy_value_and_gradient_match_the_definition():
    from anchorspec.train.ttt import soft_cross_entropy

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 11, dtype=torch.float64, generator=gen, requires_grad=True)
    p = torch.softmax(torch.randn(3, 5, 11, dtype=torch.float64, generator=gen), -1)
    w = torch.randn(3, 5, dtype=torch.float64, generator=gen)
    ref = -(p * torch.log_softmax(x, -1)).sum(-1)
    got, top = soft_cross_entropy(x, p)
    torch.testing.assert_close(got, ref, atol=1e-12, rtol=0)
    assert torch.equal(top, x.argmax(-1))
    (gx,) = torch.autograd.grad((ref * w).sum(), x)
    (gy,) = torch.autograd.grad((got * w).sum(), x)
    torch.testing.assert_close(gy, gx, atol=1e-12, rtol=0)
    assert torch.autograd.gradcheck(lambda t: soft_cross_entropy(t, p)[0], (x,))
    # bf16 logits (autocast): the loss is computed in fp32 and the gradient comes back in bf16
    xb = x.detach().bfloat16().requires_grad_()
    lb, top = soft_cross_entropy(xb, p.float())
    assert torch.equal(top, xb.float().argmax(-1))
    assert lb.dtype == torch.float32
    torch.testing.assert_close(lb.double(), -(p * torch.log_softmax(xb.double(), -1)).sum(-1), atol=1e-5, rtol=0)
    lb.sum().backward()
    assert xb.grad.dtype == torch.bfloat16


def test_compiled_loss_kernels_match_the_eager_ones():
    """`compile_loss()` (train --compile-loss) swaps in inductor-fused kernels: same loss, gradient and
    argmax as the eager ones, on bf16 logits with ragged row counts (dynamic shapes: one compilation)."""
    import shutil

    from anchorspec.train import ttt

    if shutil.which(os.environ.get("CXX", "g++")) is None:
        pytest.skip("torch.compile on CPU needs a C++ compiler (g++), and none is installed")
    gen = torch.Generator().manual_seed(0)
    runs = {}
    try:
        for compiled in (False, True):
            ttt.compile_loss(compiled)
            out = []
            for rows in (7, 13):
                x = (torch.randn(rows, 300, generator=gen) * 3).bfloat16().requires_grad_()
                p = torch.softmax(torch.randn(rows, 300, generator=gen), -1)
                w = torch.randn(rows, generator=gen)
                ce, top = ttt.soft_cross_entropy(x, p)
                (ce * w).sum().backward()
                out.append((ce.detach(), top, x.grad))
            gen = torch.Generator().manual_seed(0)  # the same inputs for the second pass
            runs[compiled] = out
    finally:
        ttt.compile_loss(False)
    for (ce_e, top_e, g_e), (ce_c, top_c, g_c) in zip(runs[False], runs[True]):
        torch.testing.assert_close(ce_c, ce_e, atol=1e-5, rtol=1e-5)
        assert torch.equal(top_c, top_e)
        torch.testing.assert_close(g_c.float(), g_e.float(), atol=1e-6, rtol=1e-2)  # one bf16 ulp apart at most
        assert g_c.dtype == torch.bfloat16
