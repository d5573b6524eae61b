"""EAGLE-3 / EAGLE-3.1 drafter: flag semantics, checkpoints, vocabulary mapping, bad input, CLI.

Spec references: eagle31-spec.md §3 (drafter math, checkpoint keys), §4 (d2t/t2d), §11 (pitfalls);
peers-and-tests.md §2.2 items 21 (vocab mapping) and 22 (EAGLE-3.1 flag semantics).

Everything runs on tiny random Llama models (vocab 96, hidden 32, 8 layers), so the file is fast on CPU.
"""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
from pathlib import Path

import pytest
import torch
import transformers
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from anchorspec import cli
from anchorspec.api import Engine, attach_drafter
from anchorspec.errors import AnchorspecError
from anchorspec.models.drafter import (
    ARCHITECTURE,
    DrafterConfig,
    Eagle3Drafter,
    KVCache,
    average_drafters,
    init_drafter,
    load_drafter,
    save_drafter,
)
from anchorspec.models.hub import resolve_target
from anchorspec.models.target import Target

VOCAB, HIDDEN, LAYERS, DRAFT_VOCAB = 96, 32, 8, 40
DEFAULT_AUX = [2, LAYERS // 2, LAYERS - 3]  # (2, L//2, L-3) = [2, 4, 5]
VARIANTS = ["eagle3", "eagle3.1"]


# --------------------------------------------------------------------------------------------
# fixtures and helpers
# --------------------------------------------------------------------------------------------

pytestmark = pytest.mark.usefixtures("one_thread")


def llama_config(**overrides) -> transformers.LlamaConfig:
    kw = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=LAYERS,
              num_attention_heads=4, num_key_value_heads=2)
    kw.update(overrides)
    return transformers.LlamaConfig(**kw)


def tiny_model(seed: int = 0, **overrides) -> transformers.LlamaForCausalLM:
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(llama_config(**overrides)).eval()


@pytest.fixture(scope="module")
def target_model():
    return tiny_model()


@pytest.fixture(scope="module")
def target(target_model):
    return Target(target_model)


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory, target_model):
    """A saved tiny target with a tiny word-level tokenizer (w0..w93), usable by the CLI."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    path = tmp_path_factory.mktemp("target")
    target_model.save_pretrained(path)
    words = ["<unk>", "<eos>"] + [f"w{i}" for i in range(VOCAB - 2)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>").save_pretrained(path)
    return path


def randomize_norms(drafter: Eagle3Drafter, seed: int = 1) -> Eagle3Drafter:
    """init_drafter leaves every RMSNorm weight at 1; random weights make norm placement observable."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if p.dim() == 1:
                p.copy_(1.0 + 0.5 * torch.randn(p.shape, generator=gen))
    return drafter


def make_drafter(variant: str, draft_vocab_size: int | None = DRAFT_VOCAB, seed: int = 0) -> Eagle3Drafter:
    d = randomize_norms(init_drafter(llama_config(), variant, draft_vocab_size=draft_vocab_size, seed=seed), seed + 1)
    if draft_vocab_size is not None and draft_vocab_size < VOCAB:
        ids = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(seed + 2))[:draft_vocab_size]
        d.set_vocab_mapping(ids)  # a non-trivial mapping, so d2t offsets are not all zero
    return d


def rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * (x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def reference_step(d: Eagle3Drafter, embed: torch.Tensor, tokens, x_in, pos):
    """Spec §3 written out from the module weights (independent of the module forward code)."""
    c, m = d.config, d.midlayer
    B, T = tokens.shape
    nh, nkv, hd, eps = c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.rms_norm_eps
    u = torch.cat([rms(embed[tokens], m.input_layernorm.weight, eps), rms(x_in, m.hidden_norm.weight, eps)], -1)
    a = m.self_attn
    q = (u @ a.q_proj.weight.T).view(B, T, nh, hd)
    k = (u @ a.k_proj.weight.T).view(B, T, nkv, hd)
    v = (u @ a.v_proj.weight.T).view(B, T, nkv, hd)
    inv = 1.0 / (c.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
    ang = (pos[..., None].double() * inv).float()[:, :, None, :]  # [B, T, 1, hd/2]
    cos, sin = ang.cos(), ang.sin()

    def rot(x):  # HF half-split rotary convention
        x1, x2 = x[..., : hd // 2], x[..., hd // 2:]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)

    q, k = rot(q), rot(k)
    group = nh // nkv
    k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
    scores = torch.einsum("bthd,bshd->bhts", q, k) / math.sqrt(hd)
    scores = scores.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
    out = torch.einsum("bhts,bshd->bthd", scores.softmax(-1), v).reshape(B, T, nh * hd)
    r1 = x_in + out @ a.o_proj.weight.T  # residual on the UN-normed x_in
    mlp = m.mlp
    y = rms(r1, m.post_attention_layernorm.weight, eps)
    h = r1 + (torch.nn.functional.silu(y @ mlp.gate_proj.weight.T) * (y @ mlp.up_proj.weight.T)) @ mlp.down_proj.weight.T
    normed = rms(h, d.norm.weight, eps)
    return normed @ d.lm_head.weight.T, (normed if c.norm_output else h), h


def step_inputs(seed: int = 0, B: int = 2, T: int = 5, scale: float = 5.0):
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (B, T), generator=gen)
    x_in = scale * torch.randn(B, T, HIDDEN, generator=gen)  # far from unit RMS: hidden_norm(x_in) != x_in
    pos = torch.arange(T).expand(B, T) + 3
    return tokens, x_in, pos


def run_step(d: Eagle3Drafter, embed, tokens, x_in, pos):
    if d.embed_weight is None:
        d.bind_target_embedding(embed)
    with torch.no_grad():
        return d.step(tokens, x_in, pos, KVCache())


def config_fields(cfg: DrafterConfig) -> dict:
    out = dataclasses.asdict(cfg)
    out.pop("extra")
    return out


def write_drafter(path: Path, config: dict, state: dict) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in state.items()}, str(path / "model.safetensors"))
    return path


def saved_state(path: Path) -> dict:
    return load_file(str(path / "model.safetensors"))


def assert_same_state(a: Eagle3Drafter, b: Eagle3Drafter):
    sa, sb = a.state_dict(), b.state_dict()
    assert sorted(sa) == sorted(sb)
    for k in sa:
        assert sa[k].dtype == sb[k].dtype, k
        assert torch.equal(sa[k], sb[k]), k


def run_cli(argv, capsys):
    """Call the CLI like a user would; a Python exception escaping main() is a failure (a traceback)."""
    try:
        rc = cli.main([str(a) for a in argv])
    except SystemExit as exc:  # argparse
        rc = exc.code
    except Exception as exc:  # noqa: BLE001
        pytest.fail(f"anchorspec {' '.join(map(str, argv))} raised {type(exc).__name__}: {exc} (user sees a traceback)")
    out = capsys.readouterr()
    return rc, out.out, out.err


def assert_one_line_error(rc, err, *fragments, allow_progress_bars=False):
    """Exit code 2 and exactly one stderr line `anchorspec: error: ...` holding each fragment.

    allow_progress_bars: errors found after the target starts loading follow transformers'
    "Loading weights" tqdm bar on stderr, and the one line saying what `--dtype auto` chose; those
    are tolerated there, nothing else."""
    assert rc == 2, f"exit code {rc}, stderr {err!r}"
    lines = err.splitlines()
    if allow_progress_bars:
        lines = [ln for ln in lines
                 if ln.strip() and not ln.startswith(("Loading weights", "anchorspec: --dtype auto chose"))]
    assert len(lines) == 1, f"expected exactly one stderr line, got {len(lines)}: {err!r}"
    assert lines[0].startswith("anchorspec: error:"), lines[0]
    assert "Traceback" not in err
    for f in fragments:
        assert f in lines[0], f"{f!r} not in {lines[0]!r}"


# --------------------------------------------------------------------------------------------
# 1. flag semantics (spec §3, pitfall 4; peers item 22)
# --------------------------------------------------------------------------------------------

def test_fc_norm_is_one_rmsnorm_per_aux_chunk():
    d = make_drafter("eagle3.1")
    assert d.config.fc_norm and len(d.fc_norm) == 3
    eps = d.config.rms_norm_eps
    chunks = [s * torch.randn(2, 5, HIDDEN) for s in (0.3, 1.0, 30.0)]  # very different chunk scales
    aux = torch.cat(chunks, -1)
    with torch.no_grad():
        got = d.project_features(aux)
        per_chunk = torch.cat([rms(c, n.weight, eps) for c, n in zip(chunks, d.fc_norm)], -1) @ d.fc.weight.T
        whole_w = torch.cat([n.weight for n in d.fc_norm])
        whole = rms(aux, whole_w, eps) @ d.fc.weight.T  # the other variant's `norm_before_fc`
    torch.testing.assert_close(got, per_chunk, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(got, whole, rtol=1e-3, atol=1e-4), "fc_norm must not be one RMSNorm over the concat"
    # per-chunk normalisation makes each chunk's scale irrelevant
    rescaled = torch.cat([7.0 * chunks[0], chunks[1], 0.1 * chunks[2]], -1)
    with torch.no_grad():
        torch.testing.assert_close(d.project_features(rescaled), got, rtol=1e-4, atol=1e-5)


def test_fc_norm_false_is_plain_fc():
    d = make_drafter("eagle3")
    assert not d.config.fc_norm and d.fc_norm is None
    assert not any(k.startswith("fc_norm") for k in d.state_dict())
    aux = torch.cat([s * torch.randn(2, 5, HIDDEN) for s in (0.01, 1.0, 100.0)], -1)
    with torch.no_grad():
        torch.testing.assert_close(d.project_features(aux), aux @ d.fc.weight.T, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(d.project_features(3 * aux), 3 * d.project_features(aux), rtol=1e-5, atol=1e-4)


def test_project_features_rejects_wrong_width():
    d = make_drafter("eagle3.1")
    with pytest.raises(AnchorspecError, match=r"width 64.*expects 96"):
        d.project_features(torch.randn(1, 2, 2 * HIDDEN))


@pytest.mark.parametrize("variant", VARIANTS)
def test_step_matches_spec_math(variant, target):
    d = make_drafter(variant)
    tokens, x_in, pos = step_inputs()
    out = run_step(d, target.embed_weight, tokens, x_in, pos)
    with torch.no_grad():
        logits, nxt, _ = reference_step(d, target.embed_weight, tokens, x_in, pos)
    assert out.logits.shape == (2, 5, DRAFT_VOCAB) and out.logits.dtype == torch.float32
    torch.testing.assert_close(out.logits, logits, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(out.next_hidden, nxt, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("variant", VARIANTS)
def test_norm_placement_via_hooks(variant, target):
    """lm_head always sees norm(h), norm runs once; next_hidden is h (3) or norm(h) (3.1);
    the attention input is (input_layernorm(emb), hidden_norm(x_in)); the residual uses raw x_in."""
    d = make_drafter(variant)
    m = d.midlayer
    rec: dict[str, list] = {"norm": []}

    def keep(name):
        def hook(_mod, inp, out=None):
            rec[name] = (inp[0].detach().clone(), None if out is None else out[0] if isinstance(out, tuple) else out)
        return hook

    handles = [
        d.norm.register_forward_hook(lambda _m, i, o: rec["norm"].append((i[0].clone(), o.clone()))),
        d.lm_head.register_forward_hook(keep("lm_head")),
        m.register_forward_hook(keep("midlayer")),
        m.self_attn.register_forward_hook(keep("attn")),
        m.self_attn.q_proj.register_forward_pre_hook(keep("u")),
        m.post_attention_layernorm.register_forward_pre_hook(keep("r1")),
    ]
    tokens, x_in, pos = step_inputs(seed=3)
    try:
        out = run_step(d, target.embed_weight, tokens, x_in, pos)
    finally:
        for h in handles:
            h.remove()
    eps = d.config.rms_norm_eps
    h = rec["midlayer"][1]
    assert len(rec["norm"]) == 1, "final norm must run exactly once per step (no double norm)"
    norm_in, norm_out = rec["norm"][0]
    assert torch.equal(norm_in, h)
    assert torch.equal(rec["lm_head"][0], norm_out)
    with torch.no_grad():
        torch.testing.assert_close(out.logits, d.lm_head(rms(h, d.norm.weight, eps)).float(), rtol=1e-5, atol=1e-6)
        double = d.lm_head(rms(rms(h, d.norm.weight, eps), d.norm.weight, eps)).float()
    assert not torch.allclose(out.logits, double, atol=1e-4)
    if variant == "eagle3":
        assert torch.equal(out.next_hidden, h)
        assert not torch.allclose(out.next_hidden, norm_out, atol=1e-3)
    else:
        assert torch.equal(out.next_hidden, norm_out)
        assert not torch.allclose(out.next_hidden, h, atol=1e-3)
    # attention input: (emb, feature) order, each with its own norm
    u = rec["u"][0]
    emb = target.embed_weight[tokens]
    torch.testing.assert_close(u[..., :HIDDEN], rms(emb, m.input_layernorm.weight, eps), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(u[..., HIDDEN:], rms(x_in, m.hidden_norm.weight, eps), rtol=1e-5, atol=1e-6)
    # residual: r1 = x_in + attn, not hidden_norm(x_in) + attn
    attn = rec["attn"][1]
    torch.testing.assert_close(rec["r1"][0], x_in + attn, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(rec["r1"][0], rms(x_in, m.hidden_norm.weight, eps) + attn, atol=1e-2)


def test_norm_output_only_changes_the_fed_back_state(target):
    """Same weights, norm_output toggled: step-1 logits agree, fed-back state and step-2 logits differ."""
    d31 = make_drafter("eagle3.1")
    d_raw = Eagle3Drafter(dataclasses.replace(d31.config, norm_output=False))
    d_raw.load_state_dict(d31.state_dict())
    tokens, x_in, pos = step_inputs(seed=4, T=1)
    a, b = run_step(d31, target.embed_weight, tokens, x_in, pos), run_step(d_raw, target.embed_weight, tokens, x_in, pos)
    torch.testing.assert_close(a.logits, b.logits, rtol=0, atol=0)
    assert not torch.allclose(a.next_hidden, b.next_hidden, atol=1e-3)
    a2 = run_step(d31, target.embed_weight, tokens, a.next_hidden, pos + 1)
    b2 = run_step(d_raw, target.embed_weight, tokens, b.next_hidden, pos + 1)
    assert not torch.allclose(a2.logits, b2.logits, atol=1e-4)


def test_fc_norm_only_changes_feature_projection(target):
    d31 = make_drafter("eagle3.1")
    cfg = dataclasses.replace(d31.config, fc_norm=False)
    d_plain = Eagle3Drafter(cfg)
    d_plain.load_state_dict({k: v for k, v in d31.state_dict().items() if not k.startswith("fc_norm")})
    assert cfg.variant == "eagle3.1"  # norm_output alone still makes it 3.1
    aux = torch.randn(1, 3, 3 * HIDDEN) * 4
    with torch.no_grad():
        assert not torch.allclose(d31.project_features(aux), d_plain.project_features(aux), atol=1e-4)
    tokens, x_in, pos = step_inputs(seed=5)
    torch.testing.assert_close(run_step(d31, target.embed_weight, tokens, x_in, pos).logits,
                               run_step(d_plain, target.embed_weight, tokens, x_in, pos).logits, rtol=0, atol=0)


def test_variant_from_flags():
    base = dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                vocab_size=96, draft_vocab_size=96, target_hidden_size=32)
    assert DrafterConfig(**base).variant == "eagle3"
    assert DrafterConfig(**base, fc_norm=True, norm_output=True).variant == "eagle3.1"
    assert init_drafter(llama_config(), "eagle3").config.variant == "eagle3"
    c = init_drafter(llama_config(), "eagle3.1").config
    assert (c.variant, c.fc_norm, c.norm_output) == ("eagle3.1", True, True)
    with pytest.raises(AnchorspecError, match="eagle4"):
        init_drafter(llama_config(), "eagle4")


# --------------------------------------------------------------------------------------------
# 2. checkpoint round trip (spec §3 key table)
# --------------------------------------------------------------------------------------------

MIDLAYER_KEYS = {f"midlayer.{k}.weight" for k in (
    "input_layernorm", "hidden_norm", "post_attention_layernorm",
    "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
    "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")}


@pytest.mark.parametrize("variant", VARIANTS)
def test_save_load_round_trip(variant, tmp_path, target):
    d = make_drafter(variant)
    save_drafter(d, tmp_path)
    loaded = load_drafter(tmp_path)
    assert_same_state(d, loaded)
    assert config_fields(loaded.config) == config_fields(d.config)
    assert loaded.config.variant == variant
    assert torch.equal(loaded.draft_to_target, d.draft_to_target)
    tokens, x_in, pos = step_inputs(seed=6)
    a, b = run_step(d, target.embed_weight, tokens, x_in, pos), run_step(loaded, target.embed_weight, tokens, x_in, pos)
    assert torch.equal(a.logits, b.logits) and torch.equal(a.next_hidden, b.next_hidden)
    # saving the loaded drafter again reproduces config.json exactly
    save_drafter(loaded, tmp_path / "again")
    assert json.loads((tmp_path / "again" / "config.json").read_text()) == json.loads((tmp_path / "config.json").read_text())


@pytest.mark.parametrize("variant", VARIANTS)
def test_config_json_fields(variant, tmp_path):
    save_drafter(make_drafter(variant), tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    is31 = variant == "eagle3.1"
    assert cfg["architectures"] == [ARCHITECTURE] == ["LlamaForCausalLMEagle3"]
    assert cfg["fc_norm"] is is31 and cfg["norm_output"] is is31
    assert cfg["draft_vocab_size"] == DRAFT_VOCAB and cfg["vocab_size"] == VOCAB
    assert cfg["target_hidden_size"] == HIDDEN and cfg["hidden_size"] == HIDDEN
    assert cfg["eagle_aux_hidden_state_layer_ids"] == DEFAULT_AUX
    assert cfg["rope_theta"] == 10000.0 and cfg["rope_scaling"] is None
    assert cfg["max_position_embeddings"] == 2048
    assert cfg["num_hidden_layers"] == 1 and cfg["tie_word_embeddings"] is False
    assert "rope_parameters" not in cfg


def test_rope_settings_follow_target_and_round_trip(tmp_path):
    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    d = init_drafter(llama_config(rope_parameters=rope, max_position_embeddings=16384), "eagle3.1")
    save_drafter(d, tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["rope_theta"] == 500000.0 and cfg["max_position_embeddings"] == 16384
    assert cfg["rope_scaling"] == {k: v for k, v in rope.items() if k != "rope_theta"}
    loaded = load_drafter(tmp_path)
    assert torch.equal(loaded._inv_freq, d._inv_freq)
    plain = init_drafter(llama_config(), "eagle3.1")
    assert not torch.allclose(d._inv_freq, plain._inv_freq)  # the scaling is really applied


@pytest.mark.parametrize("variant", VARIANTS)
def test_safetensors_keys_exactly(variant, tmp_path):
    save_drafter(make_drafter(variant), tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in keys}
    expected = {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"} | MIDLAYER_KEYS
    if variant == "eagle3.1":
        expected |= {"fc_norm.0.weight", "fc_norm.1.weight", "fc_norm.2.weight"}
    assert keys == expected
    assert not any("embed_tokens" in k or "inv_freq" in k for k in keys)
    assert shapes["fc.weight"] == (HIDDEN, 3 * HIDDEN)
    assert shapes["midlayer.self_attn.q_proj.weight"] == (4 * 8, 2 * HIDDEN)
    assert shapes["midlayer.self_attn.k_proj.weight"] == (2 * 8, 2 * HIDDEN)
    assert shapes["lm_head.weight"] == (DRAFT_VOCAB, HIDDEN)
    assert shapes["d2t"] == (DRAFT_VOCAB,) and shapes["t2d"] == (VOCAB,)
    raw = saved_state(tmp_path)
    assert raw["d2t"].dtype == torch.int64 and raw["t2d"].dtype == torch.bool


def test_save_in_bfloat16_loads(tmp_path):
    d = make_drafter("eagle3.1")
    save_drafter(d, tmp_path, dtype=torch.bfloat16)
    raw = saved_state(tmp_path)
    assert raw["fc.weight"].dtype == torch.bfloat16 and raw["d2t"].dtype == torch.int64
    assert json.loads((tmp_path / "config.json").read_text())["torch_dtype"] == "bfloat16"
    loaded = load_drafter(tmp_path)
    assert loaded.fc.weight.dtype == torch.float32
    assert torch.equal(loaded.fc.weight, d.fc.weight.to(torch.bfloat16).float())
    assert torch.equal(loaded.d2t, d.d2t)


# --------------------------------------------------------------------------------------------
# 3. other checkpoint layouts
# --------------------------------------------------------------------------------------------

def _rename(state, fn):
    return {fn(k): v for k, v in state.items()}


LAYOUTS = {
    "layers.0": lambda k: k.replace("midlayer.", "layers.0.", 1),
    "model.": lambda k: "model." + k,
    "model.layers.0": lambda k: "model." + k.replace("midlayer.", "layers.0.", 1),
    "vllm (model. except lm_head)": lambda k: k if k.startswith("lm_head") else "model." + k.replace("midlayer.", "layers.0.", 1),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("variant", VARIANTS)
def test_alternative_key_layouts_load(variant, layout, tmp_path):
    d = make_drafter(variant)
    save_drafter(d, tmp_path / "flat")
    state = _rename(saved_state(tmp_path / "flat"), LAYOUTS[layout])
    assert not any(k.startswith("midlayer.") for k in state) or layout == "model."
    config = json.loads((tmp_path / "flat" / "config.json").read_text())
    loaded = load_drafter(write_drafter(tmp_path / "alt", config, state))
    assert_same_state(d, loaded)


def old_eagle3_config() -> dict:
    """Shaped like yuhuili/EAGLE3-LLaMA3.1-Instruct-8B config.json (tiny sizes)."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "bias": False,
        "draft_vocab_size": DRAFT_VOCAB,
        "hidden_act": "silu",
        "hidden_size": HIDDEN,
        "intermediate_size": 64,
        "max_position_embeddings": 2048,
        "model_type": "llama",
        "num_attention_heads": 4,
        "num_hidden_layers": 1,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "vocab_size": VOCAB,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": DEFAULT_AUX, "use_aux_hidden_state": True},
    }


def test_old_plain_eagle3_checkpoint_loads(tmp_path, target):
    ref = make_drafter("eagle3")
    state = {k: v.clone() for k, v in ref.state_dict().items()}
    state["embed_tokens.weight"] = torch.randn(VOCAB, HIDDEN)  # present in old files; must be ignored
    loaded = load_drafter(write_drafter(tmp_path, old_eagle3_config(), state))
    c = loaded.config
    assert c.variant == "eagle3" and c.fc_norm is False and c.norm_output is False
    assert c.eagle_aux_hidden_state_layer_ids == DEFAULT_AUX
    assert (c.draft_vocab_size, c.vocab_size, c.target_hidden_size, c.rope_theta) == (DRAFT_VOCAB, VOCAB, HIDDEN, 10000.0)
    assert "embed_tokens.weight" not in loaded.state_dict()
    assert_same_state(ref, loaded)
    tokens, x_in, pos = step_inputs(seed=7)
    a, b = run_step(ref, target.embed_weight, tokens, x_in, pos), run_step(loaded, target.embed_weight, tokens, x_in, pos)
    assert torch.equal(a.logits, b.logits) and torch.equal(a.next_hidden, b.next_hidden)
    # attached to a target it uses the target's embedding and the ids from eagle_config
    attach_drafter(target, loaded)
    assert loaded.embed_weight is target.embed_weight
    assert list(target.aux_layer_ids) == DEFAULT_AUX


def test_full_draft_vocab_without_mapping_loads(tmp_path):
    d = make_drafter("eagle3", draft_vocab_size=None)
    assert d.config.draft_vocab_size == VOCAB
    save_drafter(d, tmp_path)
    state = saved_state(tmp_path)
    del state["d2t"], state["t2d"]
    cfg = json.loads((tmp_path / "config.json").read_text())
    loaded = load_drafter(write_drafter(tmp_path / "nomap", cfg, state))
    assert torch.equal(loaded.d2t, torch.zeros(VOCAB, dtype=torch.long))
    assert loaded.t2d.dtype == torch.bool and bool(loaded.t2d.all())
    assert torch.equal(loaded.draft_to_target, torch.arange(VOCAB))
    assert torch.equal(loaded.lm_head.weight, d.lm_head.weight)


def test_reduced_draft_vocab_without_mapping_is_rejected(tmp_path):
    d = make_drafter("eagle3")
    save_drafter(d, tmp_path)
    state = saved_state(tmp_path)
    del state["d2t"]
    cfg = json.loads((tmp_path / "config.json").read_text())
    with pytest.raises(AnchorspecError, match="d2t"):
        load_drafter(write_drafter(tmp_path / "nod2t", cfg, state))


# --------------------------------------------------------------------------------------------
# 4. d2t / t2d invariants (spec §4; peers item 21)
# --------------------------------------------------------------------------------------------

def test_vocab_mapping_invariants():
    d = init_drafter(llama_config(), "eagle3.1", draft_vocab_size=DRAFT_VOCAB)
    ids = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(11))[:DRAFT_VOCAB]  # unsorted
    d.set_vocab_mapping(ids)
    d2t_target = torch.arange(DRAFT_VOCAB) + d.d2t  # d2t is an offset, not an index
    assert d.d2t.dtype == torch.int64 and d.t2d.dtype == torch.bool
    assert bool(d.t2d[d2t_target].all())
    assert int(d.t2d.sum()) == DRAFT_VOCAB
    dt = d.draft_to_target
    assert torch.equal(dt, d2t_target)
    assert torch.equal(dt, torch.sort(ids).values)
    assert bool((dt[1:] > dt[:-1]).all())  # sorted and unique
    assert bool((d.d2t >= 0).all()) and bool((d.d2t[1:] >= d.d2t[:-1]).all())
    # deterministic: the same ids in another order give the same buffers
    d2 = init_drafter(llama_config(), "eagle3.1", draft_vocab_size=DRAFT_VOCAB)
    d2.set_vocab_mapping(ids.flip(0).tolist())
    assert torch.equal(d2.d2t, d.d2t) and torch.equal(d2.t2d, d.t2d)


def test_default_mapping_is_first_ids():
    d = init_drafter(llama_config(), "eagle3", draft_vocab_size=DRAFT_VOCAB)
    assert torch.equal(d.draft_to_target, torch.arange(DRAFT_VOCAB))
    assert int(d.t2d.sum()) == DRAFT_VOCAB and bool(d.t2d[:DRAFT_VOCAB].all())


@pytest.mark.parametrize("ids, pattern", [
    (list(range(DRAFT_VOCAB - 1)) + [0], r"unique, got 40 ids with 39 distinct"),               # a duplicate
    (list(range(DRAFT_VOCAB - 1)), r"needs 40 unique ids, got 39"),             # too few
    (list(range(DRAFT_VOCAB + 1)), r"needs 40 unique ids, got 41"),             # too many
    (list(range(DRAFT_VOCAB - 1)) + [VOCAB], r"0\.\.95"),                       # id == vocab
    ([-1] + list(range(1, DRAFT_VOCAB)), r"0\.\.95"),                           # negative id
])
def test_bad_vocab_mapping_rejected_and_state_kept(ids, pattern):
    d = make_drafter("eagle3.1")
    before = (d.d2t.clone(), d.t2d.clone())
    with pytest.raises(AnchorspecError, match=pattern):
        d.set_vocab_mapping(torch.tensor(ids))
    assert torch.equal(d.d2t, before[0]) and torch.equal(d.t2d, before[1])


def test_checkpoint_with_out_of_range_d2t_is_rejected(tmp_path):
    """A d2t whose target ids (arange(Vd) + d2t) leave the vocabulary must not load silently:
    it would later index past the target vocabulary inside the decoding loop."""
    d = make_drafter("eagle3")
    save_drafter(d, tmp_path)
    state = saved_state(tmp_path)
    state["d2t"] = state["d2t"] + VOCAB  # every target id now >= vocab_size
    cfg = json.loads((tmp_path / "config.json").read_text())
    with pytest.raises(AnchorspecError, match="d2t"):
        load_drafter(write_drafter(tmp_path / "bad", cfg, state))


# --------------------------------------------------------------------------------------------
# 5. bad inputs: AnchorspecError with the values in the message
# --------------------------------------------------------------------------------------------

@pytest.fixture
def saved31(tmp_path):
    path = tmp_path / "d31"
    save_drafter(make_drafter("eagle3.1"), path)
    return path


def test_missing_drafter_dir(tmp_path):
    with pytest.raises(AnchorspecError, match=r"nope.*does not exist"):
        load_drafter(tmp_path / "nope")


@pytest.mark.parametrize("name", ["config.json", "model.safetensors"])
def test_missing_drafter_file(saved31, name):
    (saved31 / name).unlink()
    with pytest.raises(AnchorspecError) as exc:
        load_drafter(saved31)
    assert name in str(exc.value) and str(saved31) in str(exc.value)


@pytest.mark.parametrize("garbage", [b"abc", b"this is not a safetensors file" * 10])
def test_corrupt_safetensors(saved31, garbage):
    (saved31 / "model.safetensors").write_bytes(garbage)
    with pytest.raises(AnchorspecError, match="corrupt or unreadable") as exc:
        load_drafter(saved31)
    assert str(saved31 / "model.safetensors") in str(exc.value)


def test_truncated_safetensors(saved31):
    f = saved31 / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    with pytest.raises(AnchorspecError, match="corrupt or unreadable"):
        load_drafter(saved31)


@pytest.mark.parametrize("text", ["{not json", "[1, 2]", '{"hidden_size": 32}'])
def test_bad_config_json(saved31, text):
    (saved31 / "config.json").write_text(text)
    with pytest.raises(AnchorspecError, match="config"):
        load_drafter(saved31)


def test_config_json_not_utf8(saved31):
    (saved31 / "config.json").write_bytes(b"\xff\xfe\x00 garbage")
    with pytest.raises(AnchorspecError, match="config"):
        load_drafter(saved31)


@pytest.mark.parametrize("key", ["midlayer.mlp.up_proj.weight", "fc_norm.1.weight", "lm_head.weight"])
def test_weights_missing_a_key(saved31, key):
    state = saved_state(saved31)
    del state[key]
    save_file(state, str(saved31 / "model.safetensors"))
    with pytest.raises(AnchorspecError, match="missing") as exc:
        load_drafter(saved31)
    assert key in str(exc.value) and "eagle3.1" in str(exc.value)


def test_eagle3_weights_under_eagle31_config(tmp_path):
    """fc_norm=true in config.json but no fc_norm.* tensors: a clear error naming the keys."""
    save_drafter(make_drafter("eagle3"), tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg.update(fc_norm=True, norm_output=True)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(AnchorspecError, match=r"fc_norm\.0\.weight"):
        load_drafter(tmp_path)


def test_unexpected_key(saved31):
    state = saved_state(saved31)
    state["midlayer.extra_thing.weight"] = torch.zeros(3)
    save_file(state, str(saved31 / "model.safetensors"))
    with pytest.raises(AnchorspecError, match=r"unexpected \['midlayer.extra_thing.weight'\]"):
        load_drafter(saved31)


def test_tensor_shape_mismatch(saved31):
    state = saved_state(saved31)
    state["lm_head.weight"] = torch.zeros(DRAFT_VOCAB + 1, HIDDEN)
    save_file(state, str(saved31 / "model.safetensors"))
    with pytest.raises(AnchorspecError) as exc:
        load_drafter(saved31)
    msg = str(exc.value)
    assert "lm_head.weight" in msg and "(41, 32)" in msg and "(40, 32)" in msg


def test_config_shape_mismatch(saved31):
    cfg = json.loads((saved31 / "config.json").read_text())
    cfg["intermediate_size"] = 48
    (saved31 / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(AnchorspecError, match=r"midlayer\.mlp\.\w+_proj\.weight.*(\(64, 32\)|\(32, 64\)).*48"):
        load_drafter(saved31)


def test_attach_hidden_size_mismatch():
    wide = Target(tiny_model(hidden_size=48))
    with pytest.raises(AnchorspecError) as exc:
        attach_drafter(wide, make_drafter("eagle3.1"))
    assert "target_hidden_size=32" in str(exc.value) and "48" in str(exc.value)
    with pytest.raises(AnchorspecError, match="48"):
        Engine(wide, make_drafter("eagle3"))


def test_attach_vocab_mismatch():
    big = Target(tiny_model(vocab_size=100))
    with pytest.raises(AnchorspecError) as exc:
        attach_drafter(big, make_drafter("eagle3.1"))
    assert "vocab_size=96" in str(exc.value) and "100" in str(exc.value)


def test_attach_drafter_hidden_differs_from_embedding(target):
    cfg = DrafterConfig(hidden_size=48, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                        vocab_size=VOCAB, draft_vocab_size=VOCAB, target_hidden_size=HIDDEN,
                        eagle_aux_hidden_state_layer_ids=DEFAULT_AUX)
    with pytest.raises(AnchorspecError, match=r"hidden_size=48.*32"):
        attach_drafter(target, Eagle3Drafter(cfg))


def test_attach_drafter_twice_is_a_no_op(target_model):
    """`load` attaches before compiling and Engine attaches again: the second must not redo the hooks."""
    t = Target(target_model)
    try:
        d = make_drafter("eagle3.1")
        attach_drafter(t, d)
        hooks = list(t._hooks)
        attach_drafter(t, d)
        assert t._hooks == hooks and d.embed_weight is t.embed_weight
        other = make_drafter("eagle3")
        other.config.eagle_aux_hidden_state_layer_ids = [1, 3, 6]
        attach_drafter(t, other)  # another drafter's layers are set
        assert t.aux_layer_ids == (1, 3, 6) and t._hooks != hooks
        bare = make_drafter("eagle3")
        bare.config.eagle_aux_hidden_state_layer_ids = None  # a config without ids gets the target's default
        attach_drafter(t, bare)
        assert list(t.aux_layer_ids) == DEFAULT_AUX
    finally:
        t.set_aux_layers([])  # drop this Target's hooks from the shared model


@pytest.mark.parametrize("ids", [[2, 4, 8], [-1, 4, 5], [2, 4, 100]])
def test_target_set_aux_layers_out_of_range(target_model, ids):
    t = Target(target_model)
    try:
        with pytest.raises(AnchorspecError) as exc:
            t.set_aux_layers(ids)
        assert str(ids) in str(exc.value) and "8 layers" in str(exc.value) and "0..7" in str(exc.value)
        assert list(t.aux_layer_ids) == DEFAULT_AUX  # unchanged after the failure
    finally:
        t.set_aux_layers([])  # drop this Target's hooks from the shared model
    with pytest.raises(AnchorspecError, match=r"\[2, 4, 8\]"):
        Target(target_model, aux_layer_ids=[2, 4, 8])


def test_aux_ids_out_of_range_via_drafter_config(tmp_path, target_model):
    d = make_drafter("eagle3.1")
    d.config.eagle_aux_hidden_state_layer_ids = [2, 4, 8]
    save_drafter(d, tmp_path)
    loaded = load_drafter(tmp_path)
    assert loaded.config.eagle_aux_hidden_state_layer_ids == [2, 4, 8]
    t = Target(target_model)
    try:
        with pytest.raises(AnchorspecError, match=r"\[2, 4, 8\].*8 layers"):
            attach_drafter(t, loaded)
        with pytest.raises(AnchorspecError, match=r"\[2, 4, 8\]"):
            Engine(t, loaded)
    finally:
        t.set_aux_layers([])


def test_aux_ids_from_drafter_config_are_used(target):
    d = make_drafter("eagle3")
    d.config.eagle_aux_hidden_state_layer_ids = [1, 3, 6]
    attach_drafter(target, d)
    try:
        assert list(target.aux_layer_ids) == [1, 3, 6]
        ids = torch.tensor([5, 6, 7, 8])
        out = target.forward(ids, torch.arange(4), target.new_cache(), capture_aux=True)
        with torch.no_grad():
            hs = target.model(ids[None], output_hidden_states=True).hidden_states
            torch.testing.assert_close(out.aux, torch.cat([hs[i][0] for i in (1, 3, 6)], -1), rtol=1e-5, atol=1e-5)
            assert d.project_features(out.aux).shape == (4, HIDDEN)
    finally:
        target.set_aux_layers(DEFAULT_AUX)


def test_unknown_target_alias():
    with pytest.raises(AnchorspecError) as exc:
        resolve_target("no-such-alias")
    assert "'no-such-alias'" in str(exc.value) and "smollm2-135m-instruct" in str(exc.value)


def test_target_path_errors(tmp_path):
    with pytest.raises(AnchorspecError, match="does not exist") as exc:
        resolve_target(str(tmp_path / "missing" / "model"))
    assert str(tmp_path / "missing" / "model") in str(exc.value)
    with pytest.raises(AnchorspecError, match="has no config.json"):
        resolve_target(str(tmp_path))
    (tmp_path / "file.bin").write_bytes(b"x")
    with pytest.raises(AnchorspecError, match="is a file"):
        resolve_target(str(tmp_path / "file.bin"))


# --------------------------------------------------------------------------------------------
# 6. CLI
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("variant", VARIANTS)
def test_cli_init_drafter_writes_loadable_drafter(variant, target_dir, tmp_path, capsys, target):
    out = tmp_path / "drafter"
    rc, stdout, err = run_cli(["init-drafter", "--target", target_dir, "--out", out, "--variant", variant,
                               "--draft-vocab-size", 40], capsys)
    assert rc == 0, err
    assert f"wrote {variant} drafter" in stdout
    d = load_drafter(out)
    c = d.config
    assert (c.variant, c.draft_vocab_size, c.vocab_size, c.target_hidden_size) == (variant, 40, VOCAB, HIDDEN)
    assert c.eagle_aux_hidden_state_layer_ids == DEFAULT_AUX
    assert c.fc_norm is c.norm_output is (variant == "eagle3.1")
    assert torch.equal(d.draft_to_target, torch.arange(40))
    attach_drafter(target, d)  # fits the target it was shaped after
    aux = target.forward(torch.tensor([3, 4, 5]), torch.arange(3), target.new_cache(), capture_aux=True).aux
    with torch.no_grad():
        step = d.step(torch.tensor([[4, 5, 6]]), d.project_features(aux)[None], torch.arange(3)[None], KVCache())
    assert step.logits.shape == (1, 3, 40) and torch.isfinite(step.logits).all()


def test_cli_init_drafter_custom_aux_layers(target_dir, tmp_path, capsys):
    out = tmp_path / "drafter"
    rc, stdout, err = run_cli(["init-drafter", "--target", target_dir, "--out", out, "--aux-layers", "1,3,7"], capsys)
    assert rc == 0, err
    d = load_drafter(out)
    assert d.config.eagle_aux_hidden_state_layer_ids == [1, 3, 7]
    assert d.config.draft_vocab_size == VOCAB and d.config.variant == "eagle3.1"


@pytest.mark.parametrize("aux, fragments", [
    ("1,3,8", ["[1, 3, 8]", "8 layers"]),
    ("-1,3,5", ["[-1, 3, 5]"]),
    ("a,b,c", ["aux"]),
    ("1,,3", ["aux"]),
])
def test_cli_init_drafter_bad_aux_layers(aux, fragments, target_dir, tmp_path, capsys):
    rc, _, err = run_cli(["init-drafter", "--target", target_dir, "--out", tmp_path / "d", f"--aux-layers={aux}"], capsys)
    assert_one_line_error(rc, err, *fragments)
    assert not (tmp_path / "d").exists()


@pytest.mark.parametrize("size", ["0", "97", "-5"])
def test_cli_init_drafter_bad_draft_vocab_size(size, target_dir, tmp_path, capsys):
    rc, _, err = run_cli(["init-drafter", "--target", target_dir, "--out", tmp_path / "d", "--draft-vocab-size", size],
                         capsys)
    assert_one_line_error(rc, err, "--draft-vocab-size", "1..96", size)
    assert not (tmp_path / "d").exists()


def test_cli_init_drafter_non_integer_draft_vocab_size(target_dir, tmp_path, capsys):
    rc, _, err = run_cli(["init-drafter", "--target", target_dir, "--out", tmp_path / "d", "--draft-vocab-size", "x"],
                         capsys)
    assert_one_line_error(rc, err, "--draft-vocab-size")


def test_cli_init_drafter_bad_target(tmp_path, capsys):
    rc, _, err = run_cli(["init-drafter", "--target", tmp_path / "missing" / "t", "--out", tmp_path / "d"], capsys)
    assert_one_line_error(rc, err, "does not exist")
    rc, _, err = run_cli(["init-drafter", "--target", "no-such-alias", "--out", tmp_path / "d"], capsys)
    assert_one_line_error(rc, err, "no-such-alias")


def test_cli_init_drafter_out_is_a_file(target_dir, tmp_path, capsys):
    (tmp_path / "taken").write_text("x")
    rc, _, err = run_cli(["init-drafter", "--target", target_dir, "--out", tmp_path / "taken"], capsys)
    assert_one_line_error(rc, err, "taken")


@pytest.fixture
def prompts_dir(tmp_path):
    (tmp_path / "bad.jsonl").write_text('{"prompt": "w1 w2"}\n{"prompt": oops}\n')
    (tmp_path / "nofield.jsonl").write_text('{"prompt": "w1"}\n\n{"text": "w2"}\n')
    (tmp_path / "empty.jsonl").write_text("\n\n")
    return tmp_path


def generate_error_cases(target_dir, prompts_dir):
    t = ["generate", "--target", target_dir]
    return {
        "both --no-spec and --drafter": (t + ["--no-spec", "--drafter", prompts_dir, "--prompt", "w1"], ["--no-spec", "--drafter"]),
        "neither": (t + ["--prompt", "w1"], ["--drafter", "--no-spec"]),
        "--tree 1,2": (t + ["--drafter", prompts_dir, "--prompt", "w1", "--tree", "1,2"], ["--tree", "'1,2'"]),
        "--tree a,b,c": (t + ["--drafter", prompts_dir, "--prompt", "w1", "--tree", "a,b,c"], ["--tree"]),
        "--tree with --no-spec": (t + ["--no-spec", "--prompt", "w1", "--tree", "2,2,4"], ["--tree", "--no-spec"]),
        "--chain 0": (t + ["--drafter", prompts_dir, "--prompt", "w1", "--chain", "0"], ["--chain", "0"]),
        "--system without --chat": (t + ["--no-spec", "--prompt", "w1", "--system", "be brief"], ["--system", "--chat"]),
        "missing prompts file": (t + ["--no-spec", "--prompts", prompts_dir / "nope.jsonl"], ["nope.jsonl", "does not exist"]),
        "malformed JSONL": (t + ["--no-spec", "--prompts", prompts_dir / "bad.jsonl"], ["bad.jsonl:2:", "not valid JSON"]),
        "row without prompt": (t + ["--no-spec", "--prompts", prompts_dir / "nofield.jsonl"], ["nofield.jsonl:3:"]),
        "empty prompts file": (t + ["--no-spec", "--prompts", prompts_dir / "empty.jsonl"], ["no prompts"]),
        "missing drafter dir": (t + ["--drafter", prompts_dir / "nodrafter", "--prompt", "w1"], ["nodrafter", "does not exist"]),
        "missing target dir": (["generate", "--target", prompts_dir / "t" / "x", "--no-spec", "--prompt", "w1"], ["does not exist"]),
    }


GENERATE_CASES = ["both --no-spec and --drafter", "neither", "--tree 1,2", "--tree a,b,c", "--tree with --no-spec",
                  "--chain 0", "--system without --chat", "missing prompts file", "malformed JSONL", "row without prompt", "empty prompts file",
                  "missing drafter dir", "missing target dir"]


@pytest.mark.parametrize("case", GENERATE_CASES)
def test_cli_generate_bad_input(case, target_dir, prompts_dir, capsys):
    argv, fragments = generate_error_cases(target_dir, prompts_dir)[case]
    rc, stdout, err = run_cli(argv, capsys)
    assert_one_line_error(rc, err, *fragments)
    assert stdout == ""


def test_cli_generate_drafter_with_bad_aux_ids(target_dir, tmp_path, capsys):
    """Error raised while loading (after the tokenizer and target load): still one line."""
    d = make_drafter("eagle3.1")
    d.config.eagle_aux_hidden_state_layer_ids = [2, 4, 9]
    save_drafter(d, tmp_path / "d")
    rc, _, err = run_cli(["generate", "--target", target_dir, "--drafter", tmp_path / "d", "--prompt", "w1 w2",
                          "--max-new-tokens", 2, "--threads", 1], capsys)
    assert_one_line_error(rc, err, "[2, 4, 9]", "8 layers", allow_progress_bars=True)


def test_cli_generate_with_initialised_drafter(target_dir, tmp_path, capsys):
    """End to end: init-drafter output drives `generate`; greedy speculative output == plain output."""
    rc, _, err = run_cli(["init-drafter", "--target", target_dir, "--out", tmp_path / "d", "--draft-vocab-size", 40],
                         capsys)
    assert rc == 0, err
    common = ["generate", "--target", target_dir, "--prompt", "w1 w2 w3", "--max-new-tokens", 5, "--json", "--threads", 1]
    rc, spec_out, err = run_cli(common + ["--drafter", tmp_path / "d", "--chain", 2], capsys)
    assert rc == 0, err
    rc, plain_out, err = run_cli(common + ["--no-spec"], capsys)
    assert rc == 0, err
    spec, plain = json.loads(spec_out), json.loads(plain_out)
    assert len(spec["token_ids"]) == 5
    assert spec["token_ids"] == plain["token_ids"]


def test_read_prompts_formats(tmp_path):
    mt = tmp_path / "mt_bench.jsonl"
    mt.write_text("\n".join(json.dumps(r) for r in [
        {"question_id": 81, "category": "writing", "turns": ["Compose a blog post.", "Rewrite it."]},
        {"question_id": 82, "category": "roleplay", "turns": ["Pretend to be Sheldon."]},
    ]) + "\n")
    assert cli.read_prompts(str(mt)) == ["Compose a blog post.", "Pretend to be Sheldon."]
    plain = tmp_path / "prompts.jsonl"
    plain.write_text('{"prompt": "Why is the sky blue?", "id": 1}\n\n{"prompt": "héllo \\"x\\""}\n'
                     '{"instruction": "List three fruits."}\n{"question": "2+2?"}\n"a bare JSON string"\n')
    assert cli.read_prompts(str(plain)) == ["Why is the sky blue?", 'héllo "x"', "List three fruits.", "2+2?",
                                            "a bare JSON string"]


@pytest.mark.parametrize("text, pattern", [
    ('{"turns": []}\n', r":1: expected a string, or an object with a 'prompt'.* or 'turns' field"),
    ('{"turns": [1, 2]}\n', r":1: expected a string, or an object"),
    ('{"prompt": "ok"}\n[1, 2]\n', r":2: expected a string, or an object"),
    ('{"prompt": "ok"}\n{"prompt": \n', r":2: not valid JSON"),
    ("", r"holds no prompts"),
])
def test_read_prompts_errors(tmp_path, text, pattern):
    f = tmp_path / "p.jsonl"
    f.write_text(text)
    with pytest.raises(AnchorspecError, match=pattern):
        cli.read_prompts(str(f))
    with pytest.raises(AnchorspecError, match="does not exist"):
        cli.read_prompts(str(tmp_path / "absent.jsonl"))


def test_bf16_drafter_keeps_fp32_rope_frequencies():
    """Casting the drafter to bf16 must not round its RoPE frequencies (positions up to 8k matter)."""
    from anchorspec.models.drafter import init_drafter, rope_inv_freq
    from helpers import tiny_config

    cfg = tiny_config("llama", rope_theta=100000.0)
    drafter = init_drafter(cfg, "eagle3.1").to(torch.bfloat16)
    assert drafter._inv_freq.dtype == torch.float32
    torch.testing.assert_close(drafter._inv_freq, rope_inv_freq(drafter.config).float(), rtol=0, atol=0)


@pytest.mark.parametrize("variant", ["eagle3", "eagle3.1"])
def test_first_pass_uses_sdpa_causal_and_matches_the_explicit_mask(variant):
    """A pass over a whole prompt (empty cache) skips the [T, T] mask tensor, and last_only skips all
    but the last position's logits; same outputs and cache."""
    from anchorspec.models.drafter import causal_mask
    from helpers import tiny_config

    drafter = init_drafter(tiny_config(), variant, seed=2).to(torch.float64)
    drafter.bind_target_embedding(torch.randn(96, 32, dtype=torch.float64))
    T = 23
    ids, pos = torch.randint(0, 96, (1, T)), torch.arange(T).view(1, -1)
    x = torch.randn(1, T, drafter.config.hidden_size, dtype=torch.float64)
    implicit, explicit = KVCache(), KVCache()
    a = drafter.step(ids, x, pos, implicit)
    b = drafter.step(ids, x, pos, explicit, causal_mask(T, 0, torch.float64, "cpu"))
    torch.testing.assert_close(a.logits, b.logits, rtol=0, atol=1e-10)
    torch.testing.assert_close(a.next_hidden, b.next_hidden, rtol=0, atol=1e-10)
    torch.testing.assert_close(implicit.k, explicit.k, rtol=0, atol=0)
    last = drafter.step(ids, x, pos, KVCache(), last_only=True)  # the proposer's prompt pass
    assert last.logits.shape[1] == 1
    torch.testing.assert_close(last.logits[:, 0], b.logits[:, -1], rtol=0, atol=1e-10)
    torch.testing.assert_close(last.next_hidden, b.next_hidden, rtol=0, atol=1e-10)
    # negative control: no causality at all gives other outputs
    c = drafter.step(ids, x, pos, KVCache(), torch.zeros(1, 1, T, T, dtype=torch.float64))
    assert (c.logits - b.logits).abs().max() > 1e-3


# --------------------------------------------------------------------------------------------
# averaging drafters (WiSE-FT: a round taken part of the way)
# --------------------------------------------------------------------------------------------

def _two_drafters(tmp_path, variant="eagle3.1"):
    a, b = make_drafter(variant, seed=0), make_drafter(variant, seed=5)
    b.set_vocab_mapping(a.draft_to_target)  # one draft vocabulary, different weights
    save_drafter(a, tmp_path / "a")
    save_drafter(b, tmp_path / "b", dtype=torch.bfloat16)  # a bf16 release averages with a float32 run
    return load_drafter(tmp_path / "a"), load_drafter(tmp_path / "b")


def test_average_is_the_weighted_mean_of_every_float_tensor(tmp_path):
    a, b = _two_drafters(tmp_path)
    mean = average_drafters([tmp_path / "a", tmp_path / "b"], [0.25, 0.75])
    sa, sb, sm = a.state_dict(), b.state_dict(), mean.state_dict()
    assert sorted(sm) == sorted(sa)
    moved = 0
    for k, v in sm.items():
        if v.is_floating_point():
            torch.testing.assert_close(v, 0.25 * sa[k] + 0.75 * sb[k], rtol=0, atol=1e-6)
            moved += not torch.equal(sa[k], sb[k])
        else:
            assert torch.equal(v, sa[k]), k  # d2t/t2d are copied, never averaged
    assert moved > 5  # the two drafters differ, so the test could fail
    # default weights are equal; a drafter averaged with itself is itself
    half = average_drafters([tmp_path / "a", tmp_path / "b"])
    torch.testing.assert_close(half.fc.weight, 0.5 * (a.fc.weight + b.fc.weight), rtol=0, atol=1e-6)
    assert_same_state(average_drafters([tmp_path / "a", tmp_path / "a"]), a)


def test_average_refuses_drafters_that_do_not_share_shape_or_vocabulary(tmp_path):
    _two_drafters(tmp_path)
    save_drafter(make_drafter("eagle3", seed=0), tmp_path / "v3")  # same shapes, other flags
    with pytest.raises(AnchorspecError, match="fc_norm"):
        average_drafters([tmp_path / "a", tmp_path / "v3"])
    save_drafter(make_drafter("eagle3.1", seed=9), tmp_path / "vocab")  # another draft vocabulary
    with pytest.raises(AnchorspecError, match="draft vocabulary"):
        average_drafters([tmp_path / "a", tmp_path / "vocab"])
    for weights, fragment in (([0.5], "1 weights for 2"), ([0.7, 0.7], "sum to 1"), ([1.5, -0.5], "non-negative")):
        with pytest.raises(AnchorspecError, match=fragment):
            average_drafters([tmp_path / "a", tmp_path / "b"], weights)
    with pytest.raises(AnchorspecError, match="at least two"):
        average_drafters([tmp_path / "a"])


def test_average_drafters_cli(tmp_path, capsys):
    a, b = _two_drafters(tmp_path)
    out = tmp_path / "mean"
    rc, stdout, _ = run_cli(["average-drafters", tmp_path / "a", tmp_path / "b", "--weights", "0.5", "0.5",
                             "--out", out, "--dtype", "bfloat16"], capsys)
    assert rc == 0 and "weights 0.5, 0.5" in stdout
    mean = load_drafter(out)
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    torch.testing.assert_close(mean.fc.weight, (0.5 * (a.fc.weight + b.fc.weight)).bfloat16().float(), rtol=0, atol=0)
    rc, _, err = run_cli(["average-drafters", tmp_path / "a", tmp_path / "b", "--out", tmp_path / "a"], capsys)
    assert_one_line_error(rc, err, "--out must differ")
    rc, _, err = run_cli(["average-drafters", tmp_path / "a", tmp_path / "nowhere", "--out", out], capsys)
    assert_one_line_error(rc, err, "does not exist")
