"""Multi-layer drafters (`--draft-layers N`): the math (vLLM's multi-layer Eagle3 LlamaModel), the
checkpoint layout (`layers.i.*` + num_hidden_layers; one-layer checkpoints unchanged, byte for byte),
TTT through the drafter's own layers, lossless decoding in float64 (chain and tree, stop token
inside a draft, token limit, batched drafting), the exports (vLLM yes; SGLang, llama.cpp refused)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import transformers

from anchorspec.api import attach_drafter
from anchorspec.decode.batch import BatchKV
from anchorspec.decode.drafting import run_lockstep, run_program
from anchorspec.decode.engine import GenerationConfig, generate_speculative, generate_vanilla
from anchorspec.decode.propose import EagleProposer
from anchorspec.decode.sampling import SamplingParams
from anchorspec.decode.tree import TreeShape
from anchorspec.errors import AnchorspecError
from anchorspec.models.drafter import KVCache, init_drafter, load_drafter, save_drafter
from anchorspec.models.export import export_drafter
from anchorspec.models.export_gguf import llamacpp_refusal
from anchorspec.train.ttt import ttt_forward
from helpers import VOCAB, tiny_target

pytestmark = pytest.mark.usefixtures("one_thread")

ROOT = Path(__file__).resolve().parents[1]
V, H, VD = 96, 32, 48


def llama_config():
    return transformers.LlamaConfig(vocab_size=V, hidden_size=H, intermediate_size=64, num_hidden_layers=6,
                                    num_attention_heads=4, num_key_value_heads=2)


def make_drafter(variant="eagle3.1", layers=2, seed=0):
    """float64, large random weights and random norm weights (so every norm's placement shows)."""
    d = init_drafter(llama_config(), variant, draft_vocab_size=VD, init_std=0.2, seed=seed, num_layers=layers)
    gen = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():
        for name, p in d.named_parameters():
            if p.dim() == 1 and name.endswith("weight"):
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=gen))
    d.set_vocab_mapping(torch.randperm(V, generator=gen)[:VD])
    d = d.to(torch.float64)
    d.bind_target_embedding(torch.randn(V, H, generator=gen, dtype=torch.float64))
    return d


# --- math ---------------------------------------------------------------------------------------

def _rms(w, x, eps):
    return w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def _causal_attention(attn, u, pos, d):
    c = d.config
    T = u.shape[0]
    q = (u @ attn.q_proj.weight.T).view(T, c.num_attention_heads, c.head_dim).transpose(0, 1)
    k = (u @ attn.k_proj.weight.T).view(T, c.num_key_value_heads, c.head_dim).transpose(0, 1)
    v = (u @ attn.v_proj.weight.T).view(T, c.num_key_value_heads, c.head_dim).transpose(0, 1)
    inv = 1.0 / (c.rope_theta ** (torch.arange(0, c.head_dim, 2, dtype=torch.float64) / c.head_dim))
    ang = pos[:, None].float() * inv.float()  # RoPE angles in fp32, as the target computes them
    cos, sin = torch.cat([ang, ang], -1).cos().double(), torch.cat([ang, ang], -1).sin().double()

    def rot(x):
        half = c.head_dim // 2
        return x * cos + torch.cat([-x[..., half:], x[..., :half]], -1) * sin

    q, k = rot(q), rot(k)
    g = c.num_attention_heads // c.num_key_value_heads
    k, v = k.repeat_interleave(g, 0), v.repeat_interleave(g, 0)
    scores = q @ k.transpose(-1, -2) / c.head_dim ** 0.5
    scores = scores.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
    out = (scores.softmax(-1) @ v).transpose(0, 1).reshape(T, -1)
    return out @ attn.o_proj.weight.T


def vllm_style_forward(d, tokens, x, pos):
    """vLLM's Eagle3 LlamaModel.forward written out with its (hidden_states, residual) pairs: layer 0
    concatenates; layer i >= 1 does `hidden, residual = input_layernorm(hidden, residual)` (add, then
    norm); the model ends with `norm(hidden, residual)`. Returns (normed, pre-norm)."""
    eps = d.config.rms_norm_eps
    emb = d.embed_weight[tokens]
    residual, hidden = None, x
    for i, layer in enumerate(d.decoder_layers):
        if i == 0:
            residual = hidden
            u = torch.cat([_rms(layer.input_layernorm.weight, emb, eps), _rms(layer.hidden_norm.weight, hidden, eps)], -1)
        else:
            residual = hidden + residual
            u = _rms(layer.input_layernorm.weight, residual, eps)
        a = _causal_attention(layer.self_attn, u, pos, d)
        residual = a + residual
        m = layer.mlp
        z = _rms(layer.post_attention_layernorm.weight, residual, eps)
        hidden = (F.silu(z @ m.gate_proj.weight.T) * (z @ m.up_proj.weight.T)) @ m.down_proj.weight.T
    pre = hidden + residual
    return _rms(d.norm.weight, pre, eps), pre


@pytest.mark.parametrize("layers", [2, 4])
@pytest.mark.parametrize("variant", ["eagle3", "eagle3.1"])
def test_step_equals_vllm_multilayer_math(variant, layers):
    d = make_drafter(variant, layers)
    assert len(d.decoder_layers) == layers and not hasattr(d.deep_layers[0], "hidden_norm")
    assert d.deep_layers[0].self_attn.q_proj.in_features == H and d.midlayer.self_attn.q_proj.in_features == 2 * H
    gen = torch.Generator().manual_seed(3)
    T = 7
    tokens = torch.randint(0, V, (T,), generator=gen)
    x = torch.randn(T, H, generator=gen, dtype=torch.float64)
    pos = torch.arange(T)
    normed, pre = vllm_style_forward(d, tokens, x, pos)
    with torch.no_grad():
        h, n, _ = d.layer(tokens[None], x[None], pos[None], KVCache())
    torch.testing.assert_close(h[0], pre, atol=1e-10, rtol=0)
    torch.testing.assert_close(n[0], normed, atol=1e-10, rtol=0)
    # negative control: the same weights read as a one-layer drafter give something else
    one = make_drafter(variant, 1)
    one.load_state_dict({k: v for k, v in d.state_dict().items() if not k.startswith("deep_layers.")})
    with torch.no_grad():
        h1, _, _ = one.layer(tokens[None], x[None], pos[None], KVCache())
    assert (h1[0] - pre).abs().max() > 1e-3


def test_incremental_steps_equal_one_pass_every_layer_cached():
    """Each layer keeps its own KV rows: T one-token steps equal one T-token pass, and a crop
    rolls back every layer."""
    d = make_drafter("eagle3.1", 3)
    gen = torch.Generator().manual_seed(5)
    T = 6
    tokens = torch.randint(0, V, (1, T), generator=gen)
    x = torch.randn(1, T, H, generator=gen, dtype=torch.float64)
    pos = torch.arange(T)[None]
    with torch.no_grad():
        full = d.step(tokens, x, pos, KVCache())
        cache = KVCache()
        outs = [d.step(tokens[:, t:t + 1], x[:, t:t + 1], pos[:, t:t + 1], cache) for t in range(T)]
        assert [cache.layer(i).length for i in range(3)] == [T] * 3
        torch.testing.assert_close(torch.cat([o.logits for o in outs], 1), full.logits, atol=1e-10, rtol=0)
        cache.crop(2)
        assert [cache.layer(i).length for i in range(3)] == [2] * 3
        again = d.step(tokens[:, 2:], x[:, 2:], pos[:, 2:], cache)
        torch.testing.assert_close(again.logits, full.logits[:, 2:], atol=1e-10, rtol=0)


# --- checkpoints ---------------------------------------------------------------------------------

@pytest.mark.parametrize("variant", ["eagle3", "eagle3.1"])
def test_multilayer_checkpoint_layout_and_round_trip(variant, tmp_path):
    from safetensors.torch import load_file

    d = make_drafter(variant, 3)
    save_drafter(d, tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 3
    keys = set(load_file(str(tmp_path / "model.safetensors")))
    assert not any(k.startswith(("midlayer.", "deep_layers.")) for k in keys)
    assert {k.split(".")[1] for k in keys if k.startswith("layers.")} == {"0", "1", "2"}
    assert "layers.0.hidden_norm.weight" in keys and "layers.1.hidden_norm.weight" not in keys
    assert "layers.1.input_layernorm.weight" in keys and "layers.2.mlp.down_proj.weight" in keys
    back = load_drafter(tmp_path, torch.float64)
    back.bind_target_embedding(d.embed_weight)
    for (k, a), (k2, b) in zip(d.state_dict().items(), back.state_dict().items()):
        assert k == k2 and torch.equal(a, b), k
    # vLLM's builds carry an unused hidden_norm in every layer: such a checkpoint loads too
    raw = load_file(str(tmp_path / "model.safetensors"))
    raw["layers.1.hidden_norm.weight"] = torch.ones(H, dtype=torch.float64)
    from safetensors.torch import save_file
    save_file(raw, str(tmp_path / "model.safetensors"))
    load_drafter(tmp_path)
    # a deeper layer the config does not have is refused
    cfg["num_hidden_layers"] = 2
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(AnchorspecError, match="unexpected.*deep_layers.1"):
        load_drafter(tmp_path)


def test_one_layer_keys_unchanged(tmp_path):
    from safetensors.torch import load_file

    save_drafter(make_drafter("eagle3.1", 1), tmp_path)
    keys = set(load_file(str(tmp_path / "model.safetensors")))
    assert any(k.startswith("midlayer.") for k in keys) and not any(k.startswith("layers.") for k in keys)
    assert json.loads((tmp_path / "config.json").read_text())["num_hidden_layers"] == 1


@pytest.mark.parametrize("name", ["smollm2-135m-instruct-eagle3", "smollm2-135m-instruct-eagle3.1"])
def test_released_checkpoints_load_and_resave_byte_identical(name, tmp_path):
    src = ROOT / "checkpoints" / name
    if not (src / "model.safetensors").is_file():
        pytest.skip(f"{src} not present")
    d = load_drafter(src, torch.bfloat16)
    assert d.config.num_hidden_layers == 1 and len(d.deep_layers) == 0
    save_drafter(d, tmp_path)
    assert (tmp_path / "model.safetensors").read_bytes() == (src / "model.safetensors").read_bytes()
    assert json.loads((tmp_path / "config.json").read_text()) == json.loads((src / "config.json").read_text())


@pytest.mark.parametrize("n", [0, -1, 1.5])
def test_bad_layer_count_rejected(n):
    with pytest.raises(AnchorspecError, match="num_hidden_layers"):
        init_drafter(llama_config(), num_layers=n)


# --- exports -------------------------------------------------------------------------------------

def vllm_param_names(num_layers: int, variant: str) -> set[str]:
    """The parameters of vLLM's Eagle3LlamaForCausalLM (llama_eagle3.py) that a checkpoint fills,
    after its renames (q/k/v -> qkv_proj, gate/up -> gate_up_proj, d2t -> draft_id_to_target_id)."""
    names = {"model.fc.weight", "model.norm.weight", "lm_head.weight", "draft_id_to_target_id"}
    for i in range(num_layers):
        p = f"model.layers.{i}."
        names |= {p + s for s in ("input_layernorm.weight", "post_attention_layernorm.weight",
                                   "self_attn.qkv_proj.weight", "self_attn.o_proj.weight",
                                   "mlp.gate_up_proj.weight", "mlp.down_proj.weight")}
        if i == 0:
            names.add(p + "hidden_norm.weight")
    if variant == "eagle3.1":
        names |= {f"model.fc_norm.{j}.weight" for j in range(3)}
    return names


def vllm_rename(key: str) -> str | None:
    """Eagle3LlamaForCausalLM.load_weights + LlamaModel.load_weights, as read in vLLM 00bd1493."""
    if "t2d" in key:
        return None
    if "d2t" in key:
        return key.replace("d2t", "draft_id_to_target_id")
    if "lm_head" not in key:
        key = "model." + key
    key = key.replace("midlayer.", "layers.0.")
    for shard, fused in ((".q_proj", ".qkv_proj"), (".k_proj", ".qkv_proj"), (".v_proj", ".qkv_proj"),
                         (".gate_proj", ".gate_up_proj"), (".up_proj", ".gate_up_proj")):
        if shard in key:
            return key.replace(shard, fused)
    return key


@pytest.mark.parametrize("layers", [1, 2, 4])
@pytest.mark.parametrize("variant", ["eagle3", "eagle3.1"])
def test_vllm_export_fills_every_vllm_parameter(variant, layers, tmp_path):
    from safetensors.torch import load_file

    d = make_drafter(variant, layers)
    export_drafter(d, tmp_path, "vllm")
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["num_hidden_layers"] == layers
    state = load_file(str(tmp_path / "model.safetensors"))
    renamed = {vllm_rename(k) for k in state} - {None}
    assert renamed == vllm_param_names(layers, variant)
    for i in range(layers):  # qkv input: 2H for the first layer (concat), H after (vLLM's qkv_input_size)
        prefix = "midlayer." if layers == 1 else f"layers.{i}."
        assert state[prefix + "self_attn.q_proj.weight"].shape[1] == (2 * H if i == 0 else H)


def test_sglang_and_gguf_refuse_multilayer(tmp_path):
    d = make_drafter("eagle3", 2)
    with pytest.raises(AnchorspecError, match="SGLang.*2-layer.*--format vllm"):
        export_drafter(d, tmp_path / "s", "sglang")
    assert not (tmp_path / "s" / "model.safetensors").exists()
    reason = llamacpp_refusal(d)
    assert reason is not None and "one decoder layer" in reason and "\n" not in reason
    assert llamacpp_refusal(make_drafter("eagle3", 1)) is None  # negative control
    export_drafter(make_drafter("eagle3", 1), tmp_path / "one", "sglang")


# --- TTT ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("variant", ["eagle3", "eagle3.1"])
def test_ttt_logits_equal_inference_chain_multilayer(variant):
    """TTT's unroll runs the drafter's own layers: its logits at (slot t, step k) equal a chain drafted
    with `step` on a KVCache, for a 2-layer drafter."""
    d = make_drafter(variant, 2)
    gen = torch.Generator().manual_seed(0)
    B, T, K = 2, 8, 4
    aux = torch.randn(B, T, 3 * H, generator=gen, dtype=torch.float64) * 2
    ids = torch.randint(0, V, (B, T), generator=gen)
    tl = torch.randn(B, T, V, generator=gen, dtype=torch.float64) * 3
    mask = torch.ones(B, T, dtype=torch.long)
    out = ttt_forward(d, aux, ids, tl, mask, steps=K, return_logits=True)
    checked = 0
    with torch.no_grad():
        hidden0 = d.project_features(aux)
        for b in range(B):
            for t in range(T - 1):
                cache = KVCache()
                st = d.step(ids[b:b + 1, 1:t + 2], hidden0[b:b + 1, :t + 1], torch.arange(t + 1)[None], cache)
                for k in range(K):
                    if t + k + 1 >= T:
                        break
                    if k > 0:
                        st = d.step(ids[b:b + 1, t + k + 1:t + k + 2], st.next_hidden[:, -1:], torch.tensor([[t + k]]),
                                    cache)
                    x = st.next_hidden[0, -1]
                    ref = d.lm_head(x if d.config.norm_output else d.norm(x))
                    torch.testing.assert_close(out.logits[k, b, t], ref, atol=1e-10, rtol=0)
                    checked += 1
    assert checked == B * sum(min(K, T - t - 1) for t in range(T - 1))


def test_ttt_gradients_reach_every_layer():
    d = make_drafter("eagle3.1", 2).train()
    gen = torch.Generator().manual_seed(1)
    aux = torch.randn(1, 8, 3 * H, generator=gen, dtype=torch.float64)
    ids = torch.randint(0, V, (1, 8), generator=gen)
    tl = torch.randn(1, 8, V, generator=gen, dtype=torch.float64) * 3
    tl[0, torch.arange(8), d.draft_to_target[torch.randint(0, VD, (8,), generator=gen)]] += 10
    ttt_forward(d, aux, ids, tl, torch.ones(1, 8, dtype=torch.long), steps=3).loss.backward()
    for name, p in d.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name
    assert any(n.startswith("deep_layers.0.self_attn") for n, _ in d.named_parameters())


# --- lossless decoding -----------------------------------------------------------------------------

SHAPES = [TreeShape.chain(1), TreeShape.chain(5), TreeShape(2, 3, 6), TreeShape(8, 6, 32)]


def random_drafter(target, layers=2, variant="eagle3.1", seed=1):
    d = init_drafter(target.config, variant, draft_vocab_size=64, seed=seed, num_layers=layers).to(torch.float64)
    attach_drafter(target, d)
    return d


def prompts():
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(0, VOCAB, (10,), generator=gen), torch.tensor([5, 6, 7, 5, 6, 7, 5, 6, 7, 5])]


@pytest.mark.parametrize("variant", ["eagle3", "eagle3.1"])
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_two_layer_random_drafter_matches_greedy(family, variant):
    target = tiny_target(family)
    proposer = EagleProposer(random_drafter(target, 2, variant))
    cfg = GenerationConfig(max_new_tokens=24)
    for prompt in prompts():
        ref = generate_vanilla(target, prompt, cfg).token_ids
        for shape in SHAPES:
            res = generate_speculative(target, proposer, prompt, cfg, shape)
            assert res.token_ids == ref, (family, shape)
            assert res.stats.drafted_tokens > 0 and res.stats.new_tokens == 24


@pytest.mark.parametrize("shape", [TreeShape.chain(4), TreeShape(3, 4, 12)], ids=str)
def test_two_layer_drafter_stop_token_and_token_limit(shape):
    target = tiny_target("llama")
    proposer = EagleProposer(random_drafter(target, 2, seed=4))
    prompt = prompts()[0]
    free = generate_vanilla(target, prompt, GenerationConfig(max_new_tokens=30)).token_ids
    stop = free[6]
    cfg = GenerationConfig(max_new_tokens=30, stop_token_ids=(stop,))
    ref = generate_vanilla(target, prompt, cfg)
    res = generate_speculative(target, proposer, prompt, cfg, shape)
    assert res.token_ids == ref.token_ids and res.finish_reason == "stop" == ref.finish_reason
    for max_new in (1, 3, 7):
        cfg = GenerationConfig(max_new_tokens=max_new)
        res = generate_speculative(target, proposer, prompt, cfg, shape)
        assert res.token_ids == generate_vanilla(target, prompt, cfg).token_ids and res.finish_reason == "length"


def test_two_layer_random_drafter_really_drafts():
    """Control for the equality tests: the random 2-layer drafter's drafts are verified and some
    rejected, so equality is not a drafter that never ran or always matched."""
    target = tiny_target("llama")
    res = generate_speculative(target, EagleProposer(random_drafter(target, 2)), prompts()[0],
                               GenerationConfig(max_new_tokens=30), TreeShape.chain(3))
    assert res.stats.drafted_tokens >= 30 and res.stats.accepted_tokens < res.stats.drafted_tokens


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(temperature=1.0)], ids=["greedy", "sampled"])
def test_batched_drafting_with_every_layer_in_the_slot_equals_solo(params):
    """The drafter side of batched drafting for N layers: on slots of a BatchKV that hold every
    layer's rows (EagleProposer.cache_rows), lockstep drafting gives the solo trees and rows exactly."""
    target = tiny_target("llama")
    d = random_drafter(target, 2, seed=2)
    gen = torch.Generator().manual_seed(0)
    seqs = []
    for n in (5, 12, 3):
        tokens = torch.randint(0, VOCAB, (n + 1,), generator=gen)
        seqs.append((tokens, target.forward(tokens[:-1], torch.arange(n), target.new_cache(), capture_aux=True).aux))
    shapes = [TreeShape(4, 4, 16), TreeShape.chain(3), TreeShape(2, 3, 6)]

    def program(p, tokens, aux, shape, i):
        g = None if params.greedy else torch.Generator().manual_seed(i)
        yield from p.update_passes(tokens, aux)
        return (yield from p.propose_passes(shape, params, g))

    solo = [EagleProposer(d) for _ in seqs]
    batched = [EagleProposer(d) for _ in seqs]
    kv = BatchKV(slots=2, capacity=8)
    for p in batched:
        p.use_slot(kv.attach_rows(*p.cache_rows()))
    trees_solo = [run_program(program(p, t, a, s, i)) for i, (p, (t, a), s) in enumerate(zip(solo, seqs, shapes))]
    lock = run_lockstep([program(p, t, a, s, i) for i, (p, (t, a), s) in enumerate(zip(batched, seqs, shapes))])
    for a, b in zip(trees_solo, lock.results):
        assert not isinstance(b, Exception), b
        assert torch.equal(a.tokens, b.tokens) and a.parents == b.parents
    for p_solo, p_b in zip(solo, batched):
        n = p_solo.cache.length
        assert p_b.cache.length == n
        for layer in range(2):
            rows = kv.keys[layer][p_b.cache.index, :, :n]
            torch.testing.assert_close(rows, p_solo.cache_rows()[0][layer][0], atol=1e-12, rtol=0)


def test_batched_slot_with_one_layer_fails_with_one_line():
    """Until decode hands a slot every layer (propose.cache_rows), a one-layer slot is refused clearly."""
    target = tiny_target("llama")
    d = random_drafter(target, 2)
    p = EagleProposer(d)
    kv = BatchKV(slots=1, capacity=8)
    c = d.config
    empty = torch.zeros(1, c.num_key_value_heads, 0, c.head_dim, dtype=torch.float64)
    p.use_slot(kv.attach_rows([empty], [empty]))
    tokens = torch.randint(0, VOCAB, (6,))
    aux = target.forward(tokens[:-1], torch.arange(5), target.new_cache(), capture_aux=True).aux
    lock = run_lockstep([p.update_passes(tokens, aux)])
    assert isinstance(lock.results[0], AnchorspecError) and "fewer layers" in str(lock.results[0])
