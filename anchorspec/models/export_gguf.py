"""Export an EAGLE-3 drafter as a llama.cpp draft GGUF (`anchorspec export DIR --format gguf --out F.gguf`).

Every name, shape and key below was read from the llama.cpp tree that the llama-cpp-python 0.3.36
sdist vendors (vendor/llama.cpp): conversion/llama.py (the converter's EAGLE-3 branch),
src/models/eagle3.cpp (loader and graph), src/llama-arch.cpp, src/llama-model.cpp,
src/models/llama.cpp, common/speculative.cpp and gguf-py/gguf/constants.py.

- Architecture "eagle3"; the usual Llama hyper-parameters under "eagle3.*" (block_count 1,
  embedding_length, feed_forward_length, head counts, key/value length, rms epsilon, rope base and
  dimension count, context_length, vocab_size = the target's).
- "eagle3.target_layers" (int32 array, exactly 3; the loader's messages call it `extract_layers`):
  llama.cpp captures the *input* of target layer i (models/llama.cpp stores the residual stream
  before layer i's attn_norm), i.e. HF hidden_states[i], which is anchorspec's convention too, so
  the ids are written unchanged: no off-by-one. (An id equal to the layer count would read the
  target's final state instead; anchorspec never makes one, and ids past the target are refused.)
- "eagle3.target_hidden_size" (uint32); "eagle3.norm_before_residual" = false (the attention
  residual adds the raw feature, as in ours); "eagle3.norm_before_fc" = false (see EAGLE-3.1 below).
- Tensors, ggml dims = torch dims reversed: fc.weight {3*Ht, H}; blk.0.attn_norm
  (input_layernorm, on the token embedding), blk.0.attn_norm_2 (hidden_norm, on the feature),
  blk.0.attn_q/k/v {2H, .} (input = concat(embedding, feature), that order), blk.0.attn_output,
  blk.0.ffn_norm (post_attention_layernorm), blk.0.ffn_gate/up/down, output_norm, output {H, Vd}
  (lm_head), d2t (I64 {Vd}). No token_embd (the decoder takes the target's) and no t2d (unused).
- d2t holds ABSOLUTE target ids: the graph scatters the Vd draft logits into a full-vocabulary row
  at d2t (ggml_set_rows), and the converter adds arange to EAGLE's offsets. Ours are offsets.
- q/k rows: eagle3 uses LLAMA_ROPE_TYPE_NORM (rotates adjacent pairs) where our RoPE rotates the
  two halves of a head (HF), so each head's rows are reordered [0, d/2, 1, d/2+1, ...].
- Tokenizer: every model load reads a vocabulary, the d2t scatter needs its size, and the
  speculative code checks that draft and target vocabularies agree; the converter copies the
  target's tokenizer. We copy every tokenizer.* key of the target GGUF the user runs.
- Norms and rope factors are F32; 2-D weights F32, F16, BF16 ("auto": the checkpoint's own
  16-bit type, else F32, like the converter's auto) or Q8_0 (the converter's `--outtype q8_0`:
  every 2-D weight, lm_head and fc included, quantized by gguf-py in blocks of 32; a row length
  that is no multiple of 32 falls back to F16, as there). Q8_0 reads about half of F16's bytes a
  draft step, which matters beside a target that llama.cpp runs quantized (Q4_1 as shipped).

One decoder layer only: eagle3.cpp's decoder graph asserts n_layer == 1 and its loader builds every
layer with a 2H (embedding, feature) attention input, so multi-layer drafters are refused.

EAGLE-3.1 cannot be expressed: llama.cpp's norm_before_fc is ONE RMSNorm over the concatenated
features (ours, fc_norm, is one per captured state, with its own weights), and the decoder feeds the
pre-norm state to the next draft step (ours, norm_output, feeds the normed one). Dropping either
norm would run a different model, so such a drafter is refused, naming the flag.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from ..atomic import atomic_write
from ..errors import AnchorspecError
from .drafter import Eagle3Drafter, rope_inv_freq
from .hub import ALIASES, alias_gguf

ARCH = "eagle3"
OUTTYPES = ("auto", "f32", "f16", "bf16", "q8_0")
NUM_TARGET_LAYERS = 3  # eagle3.cpp: "EAGLE3 requires exactly 3 entries in 'extract_layers'"


def llamacpp_refusal(drafter: Eagle3Drafter) -> str | None:
    """Why llama.cpp cannot run this drafter as it is, or None."""
    c = drafter.config
    if c.fc_norm or c.norm_output:
        missing = []
        if c.fc_norm:
            missing.append("fc_norm (one RMSNorm per captured target state; llama.cpp has only norm_before_fc, "
                           "one RMSNorm over their concatenation)")
        if c.norm_output:
            missing.append("norm_output (the normed state fed to the next draft step; llama.cpp feeds the "
                           "pre-norm state)")
        return (f"llama.cpp cannot express this EAGLE-3.1 drafter's {' or '.join(missing)}; export it with "
                "--format vllm, or export an EAGLE-3 drafter to gguf")
    if c.num_hidden_layers != 1:
        # eagle3.cpp: GGML_ASSERT(n_layer == 1), and it loads every layer with a 2H attention input
        return f"llama.cpp's eagle3 runs one decoder layer; this drafter has {c.num_hidden_layers}: export it with --format vllm"
    if c.num_aux != NUM_TARGET_LAYERS:
        return f"llama.cpp's eagle3 takes exactly {NUM_TARGET_LAYERS} target layers; this drafter has {c.num_aux}"
    if drafter.fc.bias is not None or c.attention_bias:
        return "llama.cpp's eagle3 has no fc or attention biases; this drafter has some"
    return None


def resolve_target_gguf(value: str | None, drafter_dir: str | Path) -> Path:
    """The target GGUF whose tokenizer the draft copies: a path, a known alias, or (None) the alias
    the drafter was trained on, as its run.json records."""
    if value is None:
        run = Path(drafter_dir) / "run.json"
        try:
            value = json.loads(run.read_text())["config"]["target"]
        except (OSError, ValueError, KeyError, TypeError):
            value = None
        if not isinstance(value, str) or value.lower() not in ALIASES:
            raise AnchorspecError("--target-gguf is needed: the GGUF of the target you run llama.cpp with "
                                  "(its tokenizer is copied into the draft)")
    if value.lower() in ALIASES:
        return alias_gguf(value)
    path = Path(value).expanduser()
    if not path.is_file():
        raise AnchorspecError(f"target GGUF {path} " + ("is a directory, expected a .gguf file" if path.is_dir()
                                                        else "does not exist"))
    return path


def _read_gguf(path: Path):
    from gguf import GGUFReader

    try:
        return GGUFReader(str(path))
    except (ValueError, OSError) as exc:  # GGUFReader raises ValueError on a bad magic or truncation
        raise AnchorspecError(f"target GGUF {path} is not a readable GGUF file: {exc}") from None


def _scalar(reader, key: str):
    field = reader.fields.get(key)
    if field is None:
        return None
    return field.contents()


def _copied_value(field):
    """(value, type, sub_type) of a reader field, strings as raw bytes so tokens copy byte-exact."""
    from gguf import GGUFValueType

    kind = field.types[0]
    if kind == GGUFValueType.ARRAY:
        if len(field.types) != 2:
            raise AnchorspecError(f"target GGUF key {field.name} is a nested array; cannot copy it")
        sub = field.types[1]
        parts = [field.parts[i] for i in field.data]
        values = [bytes(p) if sub == GGUFValueType.STRING else p[0].item() for p in parts]
        return values, kind, sub
    part = field.parts[field.data[0]]
    return (bytes(part) if kind == GGUFValueType.STRING else part[0].item()), kind, None


def check_target(reader, drafter: Eagle3Drafter, path: Path) -> list:
    """Refuse a target GGUF the draft does not fit; returns its tokenizer fields to copy."""
    c = drafter.config
    arch = _scalar(reader, "general.architecture")
    if arch is None:
        raise AnchorspecError(f"target GGUF {path} has no general.architecture")
    width = _scalar(reader, f"{arch}.embedding_length")
    if width != c.target_hidden_size:
        raise AnchorspecError(f"target GGUF {path} has hidden size {width}, the drafter was trained on "
                              f"{c.target_hidden_size}")
    layers = _scalar(reader, f"{arch}.block_count")
    ids = list(c.eagle_aux_hidden_state_layer_ids or [])
    if layers is None or any(not 0 <= i < layers for i in ids):
        raise AnchorspecError(f"aux layer ids {ids} do not fit the target GGUF {path} ({layers} layers)")
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    if tokens is None:
        raise AnchorspecError(f"target GGUF {path} has no tokenizer (tokenizer.ggml.tokens)")
    if len(tokens.data) != c.vocab_size:
        raise AnchorspecError(f"target GGUF {path} has {len(tokens.data)} tokens, the drafter's vocabulary "
                              f"has {c.vocab_size}")
    return [f for name, f in reader.fields.items() if name.startswith("tokenizer.")]


def interleave_rope_rows(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Reorder each head's rows from half-split RoPE (pairs i, i + d/2) to adjacent pairs (2i, 2i+1)."""
    rows, cols = weight.shape
    head_dim = rows // n_heads
    halves = weight.reshape(n_heads, 2, head_dim // 2, cols)  # [head, which half, i, col]
    return halves.transpose(1, 2).reshape(rows, cols)  # row 2i <- first half i, row 2i+1 <- second half i


def _weight_type(drafter_dir: str | Path | None, outtype: str) -> str:
    if outtype != "auto":
        return outtype
    try:
        saved = json.loads((Path(drafter_dir) / "config.json").read_text()).get("torch_dtype")
    except (OSError, ValueError, TypeError):
        saved = None
    return {"bfloat16": "bf16", "float16": "f16"}.get(saved, "f32")


def _as_array(t: torch.Tensor, kind: str):
    """(numpy array, raw ggml type or None) for add_tensor; numpy has no bfloat16, so its bits go raw,
    and Q8_0 goes as its blocks' bytes (uint8 rows)."""
    from gguf import GGMLQuantizationType, QuantError, quants

    t = t.detach().cpu().contiguous()
    if kind == "q8_0":
        try:
            return quants.quantize(t.to(torch.float32).numpy(), GGMLQuantizationType.Q8_0), GGMLQuantizationType.Q8_0
        except QuantError:  # a row that is no multiple of the 32-value block: F16, as llama.cpp's converter does
            kind = "f16"
    if kind == "bf16":
        return t.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16), GGMLQuantizationType.BF16
    return t.to(torch.float16 if kind == "f16" else torch.float32).numpy(), None


def draft_tensors(drafter: Eagle3Drafter, weight_kind: str) -> dict[str, tuple[np.ndarray, object]]:
    """GGUF name -> (array, raw type) for every tensor of the draft GGUF."""
    from gguf import GGMLQuantizationType

    c = drafter.config
    layer = drafter.midlayer
    attn, mlp = layer.self_attn, layer.mlp
    norms = {  # always F32
        "blk.0.attn_norm.weight": layer.input_layernorm.weight,
        "blk.0.attn_norm_2.weight": layer.hidden_norm.weight,
        "blk.0.ffn_norm.weight": layer.post_attention_layernorm.weight,
        "output_norm.weight": drafter.norm.weight,
    }
    matrices = {
        "fc.weight": drafter.fc.weight,
        "blk.0.attn_q.weight": interleave_rope_rows(attn.q_proj.weight, c.num_attention_heads),
        "blk.0.attn_k.weight": interleave_rope_rows(attn.k_proj.weight, c.num_key_value_heads),
        "blk.0.attn_v.weight": attn.v_proj.weight,
        "blk.0.attn_output.weight": attn.o_proj.weight,
        "blk.0.ffn_gate.weight": mlp.gate_proj.weight,
        "blk.0.ffn_up.weight": mlp.up_proj.weight,
        "blk.0.ffn_down.weight": mlp.down_proj.weight,
        "output.weight": drafter.lm_head.weight,
    }
    out = {name: _as_array(w, "f32") for name, w in norms.items()}
    out.update({name: _as_array(w, weight_kind) for name, w in matrices.items()})
    scaled = rope_inv_freq(c)
    if c.rope_scaling:  # ggml divides each default frequency by its factor (the optional rope_freqs tensor)
        unscaled = rope_inv_freq(type(c)(**{**_fields(c), "rope_scaling": None}))
        out["rope_freqs.weight"] = (_as_array(unscaled / scaled, "f32")[0], None)
    d2t = drafter.draft_to_target.detach().cpu().to(torch.int64).numpy()
    out["d2t"] = (d2t, GGMLQuantizationType.I64)
    return out


def write_gguf(writer, out: Path) -> None:
    """Header, keys and tensors of a filled GGUFWriter into `out`, atomically."""
    def write(tmp: str) -> None:
        writer.write_header_to_file(Path(tmp))
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()

    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(out, write)


def _fields(cfg) -> dict:
    return {name: getattr(cfg, name) for name in cfg.__dataclass_fields__}


def export_gguf(drafter: Eagle3Drafter, out: str | Path, target_gguf: Path, outtype: str = "auto",
                drafter_dir: str | Path | None = None, name: str | None = None) -> dict:
    """Write the draft GGUF atomically; returns a summary (tensor count, weight type, target layers)."""
    from gguf import GGUFValueType, GGUFWriter, LlamaFileType

    if outtype not in OUTTYPES:
        raise AnchorspecError(f"unknown --outtype {outtype!r}; choose {', '.join(OUTTYPES)}")
    refusal = llamacpp_refusal(drafter)
    if refusal:
        raise AnchorspecError(refusal)
    reader = _read_gguf(target_gguf)
    tokenizer_fields = check_target(reader, drafter, target_gguf)
    kind = _weight_type(drafter_dir, outtype)
    c = drafter.config

    writer = GGUFWriter(path=None, arch=ARCH)
    writer.add_name(name or "anchorspec EAGLE-3 drafter")
    writer.add_file_type({"f32": LlamaFileType.ALL_F32, "f16": LlamaFileType.MOSTLY_F16,
                          "bf16": LlamaFileType.MOSTLY_BF16, "q8_0": LlamaFileType.MOSTLY_Q8_0}[kind])
    writer.add_quantization_version(2)  # GGML_QNT_VERSION
    writer.add_block_count(1)
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_key_length(c.head_dim)
    writer.add_value_length(c.head_dim)
    writer.add_rope_dimension_count(c.head_dim)
    writer.add_rope_freq_base(float(c.rope_theta))
    writer.add_layer_norm_rms_eps(float(c.rms_norm_eps))
    writer.add_vocab_size(c.vocab_size)
    # the EAGLE-3 keys (gguf-py's Keys.LLM.TARGET_* / NORM_BEFORE_*; older gguf packages lack the helpers)
    writer.add_key_value(f"{ARCH}.target_layers", [int(i) for i in c.eagle_aux_hidden_state_layer_ids],
                         GGUFValueType.ARRAY, GGUFValueType.INT32)
    writer.add_uint32(f"{ARCH}.target_hidden_size", c.target_hidden_size)
    writer.add_bool(f"{ARCH}.norm_before_residual", False)
    writer.add_bool(f"{ARCH}.norm_before_fc", False)
    for field in tokenizer_fields:
        value, vtype, sub = _copied_value(field)
        writer.add_key_value(field.name, value, vtype, sub)
    for tensor_name, (array, raw) in draft_tensors(drafter, kind).items():
        writer.add_tensor(tensor_name, array, raw_dtype=raw)
    write_gguf(writer, Path(out))
    return {"weights": kind, "target_layers": list(c.eagle_aux_hidden_state_layer_ids),
            "draft_vocab": c.draft_vocab_size, "tokenizer_from": str(target_gguf)}


def float32_copy(src: Path, dst: Path) -> Path:
    """A float32 copy of a GGUF model: every tensor dequantized, metadata kept (file type F32).

    The target alias is converted for PyTorch from the same file with the same dequantizer (gguf-py,
    through transformers), so llama.cpp runs on this copy with the PyTorch target's exact weights."""
    from gguf import GGMLQuantizationType, GGUFWriter, LlamaFileType, dequantize

    reader = _read_gguf(src)
    arch = _scalar(reader, "general.architecture")
    writer = GGUFWriter(path=None, arch=arch)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name in ("general.architecture", "general.file_type"):
            continue  # GGUF.* are the header, not keys; the writer adds the architecture itself
        value, vtype, sub = _copied_value(field)
        writer.add_key_value(name, value, vtype, sub)
    writer.add_file_type(LlamaFileType.ALL_F32)
    for t in reader.tensors:
        data = np.asarray(t.data)
        if t.tensor_type != GGMLQuantizationType.F32:
            data = dequantize(data, t.tensor_type)
        writer.add_tensor(t.name, np.ascontiguousarray(data, dtype=np.float32))
    write_gguf(writer, dst)
    return dst


def float32_alias_gguf(alias: str) -> Path:
    """The float32 copy of an alias's GGUF, made once under $ANCHORSPEC_HOME/models."""
    from .hub import cache_home

    src = alias_gguf(alias)
    dst = cache_home() / "models" / f"{alias.lower()}.f32.gguf"
    if not dst.is_file():
        float32_copy(src, dst)
    return dst
