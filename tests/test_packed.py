"""Prepacked linear weights (models/packed.py): the same matmul, every family's target still decodes
losslessly through them, and load_target packs only when asked or measured faster."""

import pytest
import torch
import torch.nn.functional as F

from anchorspec.decode.engine import GenerationConfig, generate_speculative, generate_vanilla
from anchorspec.decode.propose import EagleProposer
from anchorspec.decode.tree import TreeShape
from anchorspec.models.dtype import dtype_name
from anchorspec.models.packed import FusedSibling, PackedLinear, pack_linears, packing_supported
from anchorspec.models.target import Target, load_target
from helpers import FAMILIES, OracleProposer, prompts, random_drafter, save_tiny_chat_target, tiny_target

# the dtypes oneDNN packs on this CPU (bf16 needs avx512bw/vl/dq or avx_ne_convert: none on an AVX2-only Zen3)
DTYPES = [d for d in (torch.bfloat16, torch.float32) if packing_supported(d, "cpu")]
PACK_DTYPE = DTYPES[0] if DTYPES else torch.float32  # bf16 where it packs, else fp32
pytestmark = pytest.mark.skipif(not DTYPES, reason="oneDNN packs no dtype here")
TOLERANCE = {torch.bfloat16: 1e-2, torch.float32: 1e-5}  # one rounding of the dtype apart, about


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(1, 48), (2, 48), (7, 48), (2, 5, 48)])
def test_packed_linear_is_the_same_matmul(bias, shape, dtype):
    torch.manual_seed(0)
    linear = torch.nn.Linear(48, 80, bias=bias).to(dtype)
    x = torch.randn(*shape).to(dtype)
    with torch.inference_mode():
        want, got = F.linear(x, linear.weight, linear.bias), PackedLinear(linear)(x)
    assert got.shape == want.shape and got.dtype == dtype
    # oneDNN may add the products in another order
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


def packed_target(family: str, dtype: torch.dtype = PACK_DTYPE, fuse: bool = False) -> tuple[Target, int, int]:
    model = tiny_target(family, dtype=dtype).model
    linears = sum(type(m) is torch.nn.Linear for m in model.modules())
    return Target(model, None), linears, pack_linears(model, fuse=fuse)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_linear_is_packed_and_the_head_keeps_its_weight(family):
    target, linears, packed = packed_target(family)
    assert packed == linears > 0
    assert not any(type(m) is torch.nn.Linear for m in target.model.modules())
    head = target.model.get_output_embeddings()
    assert isinstance(head, PackedLinear) and head.weight is not None  # the drafter's head init reads it


@pytest.mark.parametrize("fuse", [False, True])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_packed_target_gives_the_unpacked_logits(family, fuse):
    for dtype in DTYPES:
        plain = tiny_target(family, dtype=dtype)
        target = packed_target(family, dtype, fuse)[0]  # same seed: the same weights, packed
        ids = prompts()[0]
        with torch.inference_mode():
            want = plain.forward(ids, torch.arange(len(ids)), plain.new_cache()).logits.float()
            got = target.forward(ids, torch.arange(len(ids)), target.new_cache()).logits.float()
        if dtype == torch.float32:
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
            assert torch.equal(got.argmax(-1), want.argmax(-1))
        else:
            torch.testing.assert_close(got, want, rtol=0.05, atol=0.05)
            assert (got.argmax(-1) == want.argmax(-1)).float().mean() > 0.9


@pytest.mark.parametrize("fuse", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("family", ["llama", "qwen2", "granite"])
def test_packed_target_decodes_losslessly(family, dtype, fuse):
    """Speculative output == the packed target's own plain greedy output, chains and trees, random and
    oracle drafters (the peaked tiny models keep greedy paths far from ties)."""
    target = packed_target(family, dtype, fuse)[0]
    cfg = GenerationConfig(max_new_tokens=20)
    random = EagleProposer(random_drafter(target).to(dtype))
    for prompt in prompts():
        ref = generate_vanilla(target, prompt, cfg).token_ids
        for proposer in (random, OracleProposer(target)):
            for shape in (TreeShape.chain(4), TreeShape(2, 3, 6)):
                res = generate_speculative(target, proposer, prompt, cfg, shape)
                assert res.token_ids == ref, (family, shape, type(proposer).__name__)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_sibling_projections_fuse_into_one_product(family):
    """q/k/v and gate/up become FusedSibling modules sharing one product per group (qwen2's q/k/v
    biases included); the rest are PackedLinear; nothing is left unpacked."""
    target, linears, packed = packed_target(family, fuse=True)
    fused = [m for m in target.model.modules() if isinstance(m, FusedSibling)]
    layers = target.model.config.num_hidden_layers
    assert len(fused) == 5 * layers and packed == linears - len(fused)
    attn = target.layers[0].self_attn
    assert attn.q_proj.product is attn.k_proj.product is attn.v_proj.product
    assert not any(type(m) is torch.nn.Linear for m in target.model.modules())


@pytest.mark.parametrize("pack", [True, False], ids=["packed", "stock"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_fused_sibling_is_its_own_linear_layer_whatever_the_call_order(dtype, pack):
    """Each member returns its own product of its input: called in any order, on one input or on
    different ones (then the group computes again), and no input is held once all have taken theirs.
    Prepacked (eager inference) or stock (what torch.compile's frozen graph packs itself)."""
    torch.manual_seed(0)
    parent = torch.nn.Module()
    for name, out in (("q_proj", 24), ("k_proj", 8), ("v_proj", 8)):
        setattr(parent, name, torch.nn.Linear(16, out, bias=True).to(dtype))
    want = {n: getattr(parent, n) for n in ("q_proj", "k_proj", "v_proj")}
    x, y = torch.randn(3, 16).to(dtype), torch.randn(3, 16).to(dtype)
    ref = {n: {id(a): F.linear(a, m.weight, m.bias) for a in (x, y)} for n, m in want.items()}
    from anchorspec.models.packed import fuse_siblings

    assert fuse_siblings(parent, pack=pack) == 1
    assert parent.q_proj.product.pack is pack
    tol = TOLERANCE[dtype]
    with torch.inference_mode():
        for calls in ([("v_proj", x), ("q_proj", x), ("k_proj", x)], [("q_proj", x), ("k_proj", y), ("v_proj", x)],
                      [("q_proj", x), ("q_proj", y), ("k_proj", y), ("v_proj", y)]):
            for name, a in calls:
                torch.testing.assert_close(getattr(parent, name)(a), ref[name][id(a)], rtol=tol, atol=tol)
    product = parent.q_proj.product
    with torch.inference_mode():
        for name in ("q_proj", "k_proj", "v_proj"):
            getattr(parent, name)(x)
    assert product.input is None and product.outputs == []


def test_load_target_packs_when_asked(tmp_path, monkeypatch):
    name = dtype_name(PACK_DTYPE)
    path = save_tiny_chat_target(tmp_path / "t", dtype=PACK_DTYPE)
    packed = load_target(str(path), name, pack="on")
    assert any(isinstance(m, PackedLinear) for m in packed.model.modules())
    assert any(isinstance(m, PackedLinear) for m in load_target(str(path), "float32", pack="on").model.modules())
    if not packing_supported(torch.bfloat16, "cpu"):  # "on" packs only what oneDNN can pack here
        assert not any(isinstance(m, PackedLinear) for m in load_target(str(path), "bfloat16", pack="on").model.modules())
    monkeypatch.setenv("ANCHORSPEC_PACK", "off")
    assert not any(isinstance(m, PackedLinear) for m in load_target(str(path), name).model.modules())
    assert not any(isinstance(m, PackedLinear) for m in load_target(str(path), "float64", pack="on").model.modules())


def test_engine_packs_the_drafter_of_a_packed_target_and_stays_lossless():
    """An Engine pairs a packed target with a packed drafter (weights kept: read for the dtype and
    saved); its drafts are the unpacked drafter's logits to a rounding of the dtype, and output stays the
    packed target's plain greedy output."""
    from anchorspec.api import Engine
    from anchorspec.models.drafter import checkpoint_state

    target = packed_target("llama")[0]
    drafter = random_drafter(target).to(PACK_DTYPE)
    before = {k: v.clone() for k, v in checkpoint_state(drafter).items()}
    twin = random_drafter(target).to(PACK_DTYPE)  # the same seed: the same weights, left unpacked
    engine = Engine(target, drafter, shape=TreeShape(2, 3, 6), fallback=False)
    assert isinstance(drafter.fc, PackedLinear) and drafter.fc.weight is not None
    assert not any(type(m) is torch.nn.Linear for m in drafter.modules())
    after = checkpoint_state(drafter)
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)
    aux = torch.randn(1, 6, drafter.config.target_hidden_size * 3).to(PACK_DTYPE)
    tokens, pos = prompts()[0][None, :6], torch.arange(6)[None]
    with torch.inference_mode():
        from anchorspec.models.drafter import KVCache
        got = drafter.step(tokens, drafter.project_features(aux), pos, KVCache()).logits
        want = twin.step(tokens, twin.project_features(aux), pos, KVCache()).logits
    torch.testing.assert_close(got, want, rtol=0.05, atol=0.05)
    for prompt in prompts():
        ref = generate_vanilla(target, prompt, GenerationConfig(max_new_tokens=20)).token_ids
        assert engine.generate(prompt, max_new_tokens=20).token_ids == ref


def test_engine_packs_the_drafter_on_the_verdict_it_is_given():
    """`pack_drafter` is the packing verdict `load` resolves for the target's dtype: it overrides what the
    target's own weights show (a compiled target packs inside its graph, so they show nothing), and a
    drafter that is compiled is never packed (its frozen graph packs its own weights)."""
    from anchorspec.api import Engine

    stock = tiny_target("llama", dtype=PACK_DTYPE)
    told = random_drafter(stock).to(PACK_DTYPE)
    Engine(stock, told, pack_drafter=True)
    assert isinstance(told.fc, PackedLinear)
    untold = random_drafter(stock).to(PACK_DTYPE)
    Engine(stock, untold)  # None: as the target's weights, which are stock
    assert type(untold.fc) is torch.nn.Linear
    packed = packed_target("llama")[0]
    refused = random_drafter(packed).to(PACK_DTYPE)
    Engine(packed, refused, pack_drafter=False)
    assert type(refused.fc) is torch.nn.Linear
    compiled = random_drafter(packed).to(PACK_DTYPE)
    compiled.compile(aot=True)  # pending: nothing is built until a pass needs the graph
    Engine(packed, compiled, pack_drafter=True)
    assert type(compiled.fc) is torch.nn.Linear and compiled.aot
