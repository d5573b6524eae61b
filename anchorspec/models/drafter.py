"""EAGLE-3 / EAGLE-3.1 drafter: Llama-style decoder layers over (token embedding, feature).

Math (spec §3), per step:
    u      = concat(input_layernorm(embed(token)), hidden_norm(x_in))       # [2H]
    r1     = x_in + o_proj(attn(q_proj(u), k_proj(u), v_proj(u)))            # residual on UN-normed x_in
    h      = r1 + mlp(post_attention_layernorm(r1))
    logits = lm_head(norm(h))                                                # always normed
    x_next = norm(h) if norm_output (3.1) else h                             # fed to the next step
At context positions x_in = fc(concat(fc_norm_j(a_j))) (fc_norm only in 3.1, one norm per chunk).

With num_hidden_layers N > 1 the first layer is the one above (`midlayer`) and layers 1..N-1 are
plain pre-norm Llama layers on its output h (attention input H, no hidden_norm, no embedding):
    r = h + o_proj(attn(input_layernorm(h)));  h = r + mlp(post_attention_layernorm(r))
with the same RoPE positions; `norm`, lm_head and the fed-back state follow the last layer. This is
vLLM's multi-layer Eagle3 LlamaModel (llama_eagle3.py: layer_idx 0 concatenates, later layers take
hidden_states + residual through input_layernorm); checkpoints name the layers `layers.i.*`.

The token embedding is the target's (frozen, shared, never saved).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ..atomic import atomic_write
from ..errors import AnchorspecError
from .attention import graph_forms, grouped_attention
from .compiled import (aot_graph_key, frozen_compile, graphs_compiled, mark_dynamic, run_static, static_cache_dims,
                       static_example, step_graph, weights_digest)
from .masks import CAUSAL, additive_mask, causal_mask  # noqa: F401 (additive_mask: re-exported)
from .vocab_map import vocab_mapping

ARCHITECTURE = "LlamaForCausalLMEagle3"


@dataclass
class DrafterConfig:
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    draft_vocab_size: int
    target_hidden_size: int
    head_dim: int | None = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 2048
    attention_bias: bool = False
    fc_norm: bool = False
    norm_output: bool = False
    eagle_aux_hidden_state_layer_ids: list[int] | None = None
    num_hidden_layers: int = 1
    extra: dict = field(default_factory=dict)  # unknown config.json fields, written back unchanged

    def __post_init__(self):
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if not isinstance(self.num_hidden_layers, int) or self.num_hidden_layers < 1:
            raise AnchorspecError(f"drafter num_hidden_layers={self.num_hidden_layers!r}; give a whole number >= 1")
        if self.num_attention_heads % self.num_key_value_heads:
            raise AnchorspecError(
                f"drafter num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        ids = self.eagle_aux_hidden_state_layer_ids
        if ids is not None and len(ids) == 0:
            raise AnchorspecError("eagle_aux_hidden_state_layer_ids is empty; give at least one target layer id")
        if not 0 < self.draft_vocab_size <= self.vocab_size:
            raise AnchorspecError(f"draft_vocab_size={self.draft_vocab_size} must be in 1..vocab_size={self.vocab_size}")

    @property
    def variant(self) -> str:
        return "eagle3.1" if (self.fc_norm or self.norm_output) else "eagle3"

    @property
    def num_aux(self) -> int:
        ids = self.eagle_aux_hidden_state_layer_ids
        return len(ids) if ids else 3

    @classmethod
    def from_dict(cls, d: dict) -> "DrafterConfig":
        d = dict(d)
        # Old EAGLE-3 checkpoints put the aux ids under eagle_config; vLLM reads both places.
        if "eagle_aux_hidden_state_layer_ids" not in d and isinstance(d.get("eagle_config"), dict):
            ids = d["eagle_config"].get("eagle_aux_hidden_state_layer_ids")
            if ids is not None:
                d["eagle_aux_hidden_state_layer_ids"] = ids
        rope = d.get("rope_parameters") or {}
        if "rope_theta" not in d and "rope_theta" in rope:
            d["rope_theta"] = rope["rope_theta"]
        if d.get("rope_scaling") is None and rope.get("rope_type", "default") != "default":
            d["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
        d.setdefault("draft_vocab_size", d.get("vocab_size"))
        d.setdefault("target_hidden_size", d.get("hidden_size"))
        names = {f for f in cls.__dataclass_fields__ if f != "extra"}
        missing = [n for n in ("hidden_size", "intermediate_size", "num_attention_heads", "vocab_size") if d.get(n) is None]
        if missing:
            raise AnchorspecError(f"drafter config.json lacks {', '.join(missing)}")
        d.setdefault("num_key_value_heads", d["num_attention_heads"])
        kwargs = {k: v for k, v in d.items() if k in names and v is not None}
        extra = {k: v for k, v in d.items() if k not in names}
        return cls(**kwargs, extra=extra)

    def to_dict(self) -> dict:
        d = asdict(self)
        extra = d.pop("extra")
        out = {**extra, **d}
        out["architectures"] = [ARCHITECTURE]
        out.setdefault("model_type", "llama")
        out["hidden_act"] = "silu"
        out["tie_word_embeddings"] = False
        out.pop("rope_parameters", None)  # we write the flat rope_theta/rope_scaling form
        return out


class RMSNorm(nn.Module):
    """RMSNorm computed in float32 (spec §6.3), cast back to the input dtype."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.to(torch.float32) if dtype != torch.float64 else x
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


def rope_inv_freq(cfg: DrafterConfig) -> torch.Tensor:
    dim = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    scaling = cfg.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind in ("default", None):
        return inv
    if kind == "linear":
        return inv / float(scaling["factor"])
    if kind == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling.get("low_freq_factor", 1.0)), float(scaling.get("high_freq_factor", 4.0))
        old_len = float(scaling.get("original_max_position_embeddings", 8192))
        wavelen = 2 * math.pi / inv
        smooth = (old_len / wavelen - low) / (high - low)
        scaled = torch.where(wavelen > old_len / low, inv / factor, inv)
        mid = (1 - smooth) * inv / factor + smooth * inv
        is_mid = (wavelen <= old_len / low) & (wavelen >= old_len / high)
        return torch.where(is_mid, mid, scaled)
    raise AnchorspecError(f"drafter rope_scaling type {kind!r} is not supported (default, linear, llama3)")


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class KVCache:
    """The drafter's own KV cache, [B, n_kv, S, head_dim], grown in place, cropped on rollback.

    This object is the first layer's cache; a multi-layer drafter keeps layers 1.. in `layer(i)`
    (made on first use, cropped with this one), so callers hold one KVCache whatever the depth."""

    def __init__(self):
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None
        self._deeper: list[KVCache] = []

    def layer(self, i: int) -> "KVCache":
        if i == 0:
            return self
        while len(self._deeper) < i:
            self._deeper.append(KVCache())
        return self._deeper[i - 1]

    @property
    def length(self) -> int:
        return 0 if self.k is None else self.k.shape[2]

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.k = k if self.k is None else torch.cat([self.k, k], dim=2)
        self.v = v if self.v is None else torch.cat([self.v, v], dim=2)
        return self.k, self.v

    def crop(self, length: int) -> None:
        if self.k is not None:
            self.k, self.v = self.k[:, :, :length], self.v[:, :, :length]
        for deeper in self._deeper:
            deeper.crop(length)


class _LayerOfCache:
    """Layer i of an HF-style cache (`update(k, v, layer_idx)`, e.g. decode's batched drafter cache)
    seen through the one-layer `append` interface."""

    def __init__(self, cache, i: int):
        self.cache, self.i = cache, i

    @property
    def length(self) -> int:
        return self.cache.length

    def append(self, k, v):
        try:
            return self.cache.update(k, v, self.i)
        except IndexError as exc:  # its buffers were made from a one-layer drafter cache
            raise AnchorspecError(f"this drafter cache holds fewer layers than the drafter's {self.i + 1}+ "
                                  "(a batched cache must be given every layer's rows)") from exc


def layer_cache(cache, i: int):
    """Layer i's view of a drafter cache: KVCache, or anything with HF's `update(k, v, layer_idx)`."""
    if i == 0:
        return cache
    if isinstance(cache, KVCache):
        return cache.layer(i)
    if hasattr(cache, "update"):
        return _LayerOfCache(cache, i)
    raise AnchorspecError(f"drafter cache {type(cache).__name__} holds one layer; this drafter has more")


class DrafterAttention(nn.Module):
    def __init__(self, cfg: DrafterConfig, in_features: int):
        super().__init__()
        self.cfg = cfg
        nh, nkv, hd, H = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.hidden_size
        self.q_proj = nn.Linear(in_features, nh * hd, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(in_features, nkv * hd, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(in_features, nkv * hd, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(nh * hd, H, bias=False)

    def project(self, u, cos, sin):
        """(q, k, v) of u [B,T,in]: [B, heads or kv heads, T, head_dim], q and k rotated."""
        B, T, _ = u.shape
        c = self.cfg
        q = self.q_proj(u).view(B, T, c.num_attention_heads, c.head_dim).transpose(1, 2)
        k = self.k_proj(u).view(B, T, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        v = self.v_proj(u).view(B, T, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def forward(self, u, cos, sin, cache: KVCache, mask, want_probs: bool):
        B, T, _ = u.shape
        c = self.cfg
        q, k, v = self.project(u, cos, sin)
        k_all, v_all = cache.append(k, v)
        groups = c.num_attention_heads // c.num_key_value_heads
        probs = None
        if want_probs:
            k_all = k_all.repeat_interleave(groups, dim=1)
            v_all = v_all.repeat_interleave(groups, dim=1)
            scores = (q @ k_all.transpose(-1, -2)).float() / math.sqrt(c.head_dim)
            if mask is not None:
                scores = scores + mask.float()
            probs = scores.softmax(-1)
            out = probs.to(v_all.dtype) @ v_all
        else:
            causal = isinstance(mask, str)  # CAUSAL: no past, so SDPA's own causal mask is the right one
            out = grouped_attention(q, k_all, v_all, None if causal else mask, is_causal=causal)
        out = out.transpose(1, 2).reshape(B, T, -1)
        return self.o_proj(out), probs


class DrafterMLP(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DrafterLayer(nn.Module):
    """The `midlayer` (first=True): a Llama decoder layer whose attention reads the 2H (embedding,
    feature) concat. first=False: a plain pre-norm Llama layer on the previous layer's output."""

    def __init__(self, cfg: DrafterConfig, first: bool = True):
        super().__init__()
        H = cfg.hidden_size
        self.input_layernorm = RMSNorm(H, cfg.rms_norm_eps)
        if first:
            self.hidden_norm = RMSNorm(H, cfg.rms_norm_eps)
        self.first = first
        self.self_attn = DrafterAttention(cfg, 2 * H if first else H)
        self.post_attention_layernorm = RMSNorm(H, cfg.rms_norm_eps)
        self.mlp = DrafterMLP(cfg)

    def attn_input(self, emb, x_in):
        """What q/k/v read: concat(input_layernorm(emb), hidden_norm(x_in)) first, else input_layernorm(x_in)."""
        if self.first:
            return torch.cat([self.input_layernorm(emb), self.hidden_norm(x_in)], dim=-1)
        return self.input_layernorm(x_in)

    def finish(self, x_in, attn):
        """The residual adds and the MLP after attention (the residual is the UN-normed x_in)."""
        r1 = x_in + attn
        return r1 + self.mlp(self.post_attention_layernorm(r1))

    def forward(self, emb, x_in, cos, sin, cache, mask, want_probs):
        attn, probs = self.self_attn(self.attn_input(emb, x_in), cos, sin, cache, mask, want_probs)
        return self.finish(x_in, attn), probs


@dataclass
class DraftStep:
    logits: torch.Tensor  # [B, T, Vd] float32, over the draft vocabulary
    next_hidden: torch.Tensor  # [B, T, H] what the next speculative step receives as x_in
    attn_probs: torch.Tensor | None = None  # [B, heads, T, S] when asked for: the first layer's (drift diagnostics)
    state: torch.Tensor | None = None  # [B, T, H] the raw residual output h (its norm is the drift indicator)


class Eagle3Drafter(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.config = cfg
        n_aux, Ht, H = cfg.num_aux, cfg.target_hidden_size, cfg.hidden_size
        self.fc = nn.Linear(n_aux * Ht, H, bias=bool(cfg.extra.get("bias", False)))
        self.fc_norm = nn.ModuleList(RMSNorm(Ht, cfg.rms_norm_eps) for _ in range(n_aux)) if cfg.fc_norm else None
        self.midlayer = DrafterLayer(cfg)
        # layers 1..N-1 (none for the usual one-layer drafter, whose state dict is unchanged)
        self.deep_layers = nn.ModuleList(DrafterLayer(cfg, first=False) for _ in range(cfg.num_hidden_layers - 1))
        self.norm = RMSNorm(H, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(H, cfg.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.ones(cfg.vocab_size, dtype=torch.bool) if cfg.draft_vocab_size == cfg.vocab_size
                             else torch.zeros(cfg.vocab_size, dtype=torch.bool))
        # Not a buffer: `.to(bfloat16)` must not round the RoPE frequencies (the target keeps them in fp32).
        self._inv_freq = rope_inv_freq(cfg).float()
        self.embed_weight: torch.Tensor | None = None  # the target's, bound by bind_target_embedding
        self._compiled = None  # compile(aot=False): the torch-compiled forward_rows body
        self._aot = None  # compile(aot=True): "pending" until the first static pass builds or loads its graph
        self._batched = False  # compile(batched=True): a graph per attention form where they differ
        self._graph_file = None  # compile(aot=True): (path, key) of that graph, once computed
        self.compiles = 0  # graphs compiled during this drafter's compiled passes

    # --- wiring ---------------------------------------------------------------------------------
    def bind_target_embedding(self, weight: torch.Tensor) -> None:
        if tuple(weight.shape) != (self.config.vocab_size, self.config.hidden_size):
            raise AnchorspecError(
                f"drafter expects a target embedding of shape ({self.config.vocab_size}, {self.config.hidden_size}), "
                f"target has {tuple(weight.shape)} (vocabulary or hidden size mismatch)"
            )
        # Not registered as a parameter (a Parameter assigned to a module attribute would be): the
        # embedding is the target's, frozen, and never part of the drafter's checkpoint.
        self._parameters.pop("embed_weight", None)
        object.__setattr__(self, "embed_weight", weight)

    @property
    def draft_to_target(self) -> torch.Tensor:
        """Target token id of each draft id (d2t stores offsets, spec §4)."""
        return torch.arange(self.config.draft_vocab_size, device=self.d2t.device) + self.d2t

    def set_vocab_mapping(self, draft_token_ids: torch.Tensor) -> None:
        """Use the given target ids (any order, unique) as the draft vocabulary."""
        ids = torch.as_tensor(draft_token_ids, dtype=torch.long).view(-1)
        if ids.numel() != self.config.draft_vocab_size:
            raise AnchorspecError(f"draft vocabulary needs {self.config.draft_vocab_size} unique ids, got {ids.numel()}")
        d2t, t2d = vocab_mapping(ids, self.config.vocab_size)
        self.d2t.copy_(d2t)
        self.t2d.copy_(t2d)

    def resize_draft_vocab(self, size: int) -> None:
        """Make room for a draft vocabulary of `size` ids: a head of `size` rows and d2t of `size` offsets,
        both unset (follow with set_vocab_mapping and the head's rows)."""
        if not 1 <= size <= self.config.vocab_size:
            raise AnchorspecError(f"a draft vocabulary must have 1..{self.config.vocab_size} ids, got {size}")
        ref = self.lm_head.weight
        self.lm_head = nn.Linear(self.config.hidden_size, size, bias=False, device=ref.device, dtype=ref.dtype)
        self.d2t = torch.zeros(size, dtype=torch.long, device=self.d2t.device)  # replaces the registered buffer
        self.config.draft_vocab_size = size
        self._compiled = None

    # --- math -----------------------------------------------------------------------------------
    def project_features(self, aux: torch.Tensor) -> torch.Tensor:
        """fc(concat(fc_norm_j(a_j))) for aux [..., n_aux * Ht] (the raw target residual streams)."""
        if aux.shape[-1] != self.fc.in_features:
            raise AnchorspecError(
                f"target features have width {aux.shape[-1]}, drafter fc expects {self.fc.in_features} "
                f"({self.config.num_aux} x target_hidden_size {self.config.target_hidden_size})"
            )
        aux = aux.to(self.fc.weight.dtype)
        if self.fc_norm is not None:
            chunks = aux.split(self.config.target_hidden_size, dim=-1)
            aux = torch.cat([norm(c) for norm, c in zip(self.fc_norm, chunks)], dim=-1)
        return self.fc(aux)

    def rope(self, position_ids: torch.Tensor, dtype: torch.dtype):
        inv_freq = self._inv_freq.to(position_ids.device)  # a no-op once moved (float64: not a buffer)
        if not torch.compiler.is_compiling():  # kept moved; no attribute assigned while torch.export traces
            self._inv_freq = inv_freq
        freqs = position_ids[..., None].to(torch.float32) * inv_freq
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos()[:, None].to(dtype), emb.sin()[:, None].to(dtype)

    def step(self, token_ids, x_in, position_ids, cache: KVCache, mask=None, want_attn=False,
             last_only: bool = False) -> DraftStep:
        """One drafter pass over T positions. token_ids/position_ids [B,T]; x_in [B,T,H].

        `mask` is an additive [B or 1, 1, T, cache.length + T] mask, or None for causal over the cache.
        `last_only`: logits for the last position only (a prompt pass needs no more; at 8k positions
        the full [T, draft vocab] logits alone are hundreds of MB).
        """
        h, normed, probs = self.layer(token_ids, x_in, position_ids, cache, mask, want_attn)
        return DraftStep(logits=self.head(normed[:, -1:] if last_only else normed),
                         next_hidden=self.fed_back(h, normed), attn_probs=probs, state=h)

    @property
    def decoder_layers(self) -> list[DrafterLayer]:
        return [self.midlayer, *self.deep_layers]

    def layer(self, token_ids, x_in, position_ids, cache, mask=None, want_attn=False):
        """The decoder layers of `step`: (h, norm(h), the first layer's attention probs or None).
        `cache` is anything with `append(k, v) -> (all keys, all values)` and `length`: a KVCache, or
        the view of a batched drafter cache (decode/drafting.py) with an explicit mask; layers past
        the first use `layer_cache(cache, i)`."""
        if self.embed_weight is None:
            raise AnchorspecError("drafter has no token embedding: call bind_target_embedding(target embedding)")
        dtype = self.fc.weight.dtype
        emb = F.embedding(token_ids, self.embed_weight).to(dtype)
        if mask is None and token_ids.shape[1] > 1:
            # a first pass over a whole prompt needs no [T, T] mask tensor (8k tokens: ~200 MB)
            first = cache.length == 0 and not want_attn
            mask = CAUSAL if first else causal_mask(token_ids.shape[1], cache.length, dtype, emb.device)
        cos, sin = self.rope(position_ids, dtype)
        h, probs = self.midlayer(emb, x_in.to(dtype), cos, sin, cache, mask, want_attn)
        for i, deeper in enumerate(self.deep_layers, start=1):
            h, _ = deeper(emb, h, cos, sin, layer_cache(cache, i), mask, False)
        return h, self.norm(h), probs

    @property
    def compiled(self) -> bool:
        return self._compiled is not None or self._aot is not None

    @property
    def aot(self) -> bool:
        return self._aot is not None

    def compile(self, enabled: bool = True, aot: bool | None = None, batched: bool = False) -> None:
        """Run decode-time passes over a static cache (`forward_rows` with a ForwardCache that carries
        its mask: decode/drafting.py's passes after the prompt, on slots 0..B-1) through torch.compile,
        as Target.compile does for the target (models/compiled.py): 14-20 % less time per draft, bf16,
        1 thread (benchmarks/bench_drafter_compile.py). Compile it only for decoding: the weights are
        frozen into the graph, so training must not use a compiled drafter. `aot` (default: on a CPU):
        one graph compiled ahead of time and kept on disk, as the target's (`load_graph`); `batched` as there."""
        self._batched = batched
        if not enabled:
            self._compiled = self._aot = None
            return
        if aot is None:
            aot = self.fc.weight.device.type == "cpu"
        self._compiled, self._aot = (None, "pending") if aot else (frozen_compile(self._rows_body), None)
        self._graph_file = None  # its key is read from the weights once per compile (aot_path)

    def load_graph(self):
        """The ahead-of-time graph of a static forward_rows pass (models/compiled.py: aot_compile), built
        or loaded on first use; every size dynamic from 1 up, so one graph serves every pass past the
        prompt. None, after one line on stderr, where it cannot be compiled (then passes run eager)."""
        if self._aot is None:
            raise AnchorspecError("load_graph needs compile(aot=True) first")
        if self._aot == "pending":
            self.compiles += 1
            self._aot = step_graph(self, self._aot_body, self._aot_example,
                                   (("rows", "tokens"), ("rows", "tokens"), ("rows", "tokens"), ("kept",)),
                                   len(self.decoder_layers), self._graph_key(), "the drafter's pass graph",
                                   self._graph_forms())
        return self._aot

    def aot_path(self) -> Path:
        """Where this drafter's AOT graph is kept on this machine: its weights, the target embedding it
        reads, its config, the CPU and the library versions (read once per compile: decoding never
        changes the weights)."""
        return self._graph_key()[0]

    def _graph_key(self) -> tuple[Path, str]:
        if self.embed_weight is None:
            raise AnchorspecError("drafter has no token embedding: call bind_target_embedding(target embedding)")
        if self._graph_file is None:
            c, weight = self.config, self.fc.weight
            fields = {"weights": weights_digest(self, {"embedding": self.embed_weight}),
                      "config": json.dumps(asdict(c), sort_keys=True, default=str),
                      "attention": self._graph_forms()[0]}
            self._graph_file = aot_graph_key("drafter", fields)
        return self._graph_file

    def _graph_forms(self) -> tuple[str, str]:
        """Grouped attention's (one-row, few-row) forms in this drafter's graphs (models/attention.py: graph_forms)."""
        c, weight = self.config, self.fc.weight
        return graph_forms(weight.device, weight.dtype, c.num_key_value_heads,
                           c.num_attention_heads // c.num_key_value_heads, c.head_dim, self._batched)

    def _aot_body(self, token_ids, x_in, position_ids, rows, mask, cache):
        return rows_forward(self, token_ids, x_in, position_ids, cache, mask, rows)

    def _aot_example(self, rows: int, tokens: int, past: int, kept: int, slots: int, capacity: int) -> tuple:
        """Inputs of the AOT graph's shapes (models/compiled.py: static_example), x_in beside the token ids."""
        c, device, dtype = self.config, self.fc.weight.device, self.fc.weight.dtype
        (ids, positions, keep), *rest = static_example(rows, tokens, past, kept, slots, capacity, c.num_key_value_heads,
                                                       c.head_dim, len(self.decoder_layers), dtype, device)
        x_in = torch.zeros(rows, tokens, c.hidden_size, dtype=dtype, device=device)
        return ((ids, x_in, positions, keep), *rest)

    def forward_rows(self, token_ids, x_in, position_ids, cache, mask, rows: torch.Tensor):
        """The passes of one padded forward [B, T]: (draft logits, fed-back state, raw state h), each
        for the flat rows `rows` (b * T + t) only. Through the compiled graph when compiled and the
        cache is static (it then carries `mask` as its `static_mask`), else eager."""
        graph = self.load_graph() if self._aot is not None and getattr(cache, "static", False) else None
        if graph is not None:
            return tuple(run_static(graph, (token_ids, x_in, position_ids, rows), mask, cache))
        if self._compiled is not None and getattr(cache, "static", False):
            mark_dynamic([(mask, (0, 2, 3)), (token_ids, (0, 1)), (position_ids, (0, 1)), (x_in, (0, 1)), (rows, (0,)),
                          *static_cache_dims(cache)])
            graphs = graphs_compiled()
            out = self._compiled(token_ids, x_in, position_ids, cache, mask, rows)
            self.compiles += graphs_compiled() - graphs
            return out
        return self._rows_body(token_ids, x_in, position_ids, cache, mask, rows)

    def _rows_body(self, token_ids, x_in, position_ids, cache, mask, rows):
        return rows_forward(self, token_ids, x_in, position_ids, cache, mask, rows)

    def head(self, normed: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits (float32) of normed hidden states."""
        return self.lm_head(normed).float()

    def fed_back(self, h: torch.Tensor, normed: torch.Tensor) -> torch.Tensor:
        """What the next speculative step receives as x_in: norm(h) in 3.1 (norm_output), h in 3."""
        return normed if self.config.norm_output else h


def rows_forward(drafter, token_ids, x_in, position_ids, cache, mask, rows: torch.Tensor):
    """Eagle3Drafter.forward_rows' computation, eager, for anything with the drafter's `layer`, `head`
    and `fed_back` (the drift probe passes itself, to see each pass's attention)."""
    h, normed, _ = drafter.layer(token_ids, x_in, position_ids, cache, mask)
    h, normed = (t.reshape(-1, t.shape[-1]).index_select(0, rows) for t in (h, normed))
    return drafter.head(normed), drafter.fed_back(h, normed), h


# --- checkpoints --------------------------------------------------------------------------------

def _canonical_key(key: str) -> str:
    """A checkpoint key -> the module's: `model.` dropped, `layers.0.` -> `midlayer.`, `layers.i.` ->
    `deep_layers.{i-1}.` (EAGLE's one-layer checkpoints say midlayer, vLLM's layout says layers.i)."""
    if key.startswith("model."):
        key = key[len("model."):]
    if key.startswith("layers."):
        index, _, rest = key[len("layers."):].partition(".")
        if index.isdigit():
            i = int(index)
            key = f"midlayer.{rest}" if i == 0 else f"deep_layers.{i - 1}.{rest}"
    return key


def checkpoint_key(key: str, num_layers: int) -> str:
    """A module key -> the checkpoint's. One layer: unchanged (`midlayer.*`, EAGLE's own names, what
    every engine and the existing checkpoints use). N layers: `layers.i.*` for every layer (vLLM's
    names; its loader also renames midlayer. to layers.0.)."""
    if num_layers == 1:
        return key
    if key.startswith("midlayer."):
        return "layers.0." + key[len("midlayer."):]
    if key.startswith("deep_layers."):
        index, _, rest = key[len("deep_layers."):].partition(".")
        return f"layers.{int(index) + 1}.{rest}"
    return key


def checkpoint_state(drafter: "Eagle3Drafter") -> dict[str, torch.Tensor]:
    """The drafter's tensors under their checkpoint names (see `checkpoint_key`), detached."""
    n = drafter.config.num_hidden_layers
    return {checkpoint_key(k, n): v.detach().contiguous() for k, v in drafter.state_dict().items()}


def module_state(raw: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Checkpoint tensors under the module's names (the inverse of `checkpoint_state`)."""
    return {_canonical_key(k): v for k, v in raw.items()}


def load_drafter(path: str | os.PathLike, dtype: torch.dtype = torch.float32) -> Eagle3Drafter:
    """Load a drafter directory: config.json + model.safetensors (flat `midlayer.*`, `layers.i.*` or `model.*` keys)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(path)
    if not path.is_dir():
        raise AnchorspecError(f"drafter directory {path} does not exist")
    cfg_file, weights = path / "config.json", path / "model.safetensors"
    for f in (cfg_file, weights):
        if not f.is_file():
            raise AnchorspecError(f"drafter directory {path} has no {f.name}")
    try:
        cfg = DrafterConfig.from_dict(json.loads(cfg_file.read_text()))
    except (ValueError, TypeError) as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise AnchorspecError(f"drafter config {cfg_file} is not valid: {exc}") from exc
    try:
        raw = load_file(str(weights))
    except (SafetensorError, OSError, ValueError) as exc:
        raise AnchorspecError(f"drafter weights {weights} are corrupt or unreadable: {exc}") from exc
    state = module_state(raw)
    state.pop("embed_tokens.weight", None)  # shared with the target
    for k in [k for k in state if k.startswith("deep_layers.") and ".hidden_norm." in k]:
        del state[k]  # vLLM builds a hidden_norm in every layer; only the first one's is used
    drafter = Eagle3Drafter(cfg)
    expected = drafter.state_dict()
    if cfg.draft_vocab_size == cfg.vocab_size:  # EAGLE deletes the mapping when the vocabularies match
        state.setdefault("d2t", expected["d2t"])
        state.setdefault("t2d", expected["t2d"])
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise AnchorspecError(
            f"drafter weights {weights} do not match its config (variant {cfg.variant}): "
            f"missing {missing[:6]}{'...' if len(missing) > 6 else ''}, unexpected {unexpected[:6]}"
        )
    for k, v in state.items():
        if tuple(v.shape) != tuple(expected[k].shape):
            raise AnchorspecError(f"drafter tensor {k} has shape {tuple(v.shape)}, config implies {tuple(expected[k].shape)}")
    drafter.load_state_dict({k: v.to(expected[k].dtype) if k in ("d2t", "t2d") else v for k, v in state.items()})
    _check_vocab_mapping(drafter, weights)
    return drafter.to(dtype).eval()


def _check_vocab_mapping(drafter: Eagle3Drafter, source) -> None:
    """d2t must map the draft vocabulary onto distinct target ids, and t2d must mark exactly those."""
    ids = drafter.draft_to_target
    V = drafter.config.vocab_size
    if int(ids.min()) < 0 or int(ids.max()) >= V:
        raise AnchorspecError(f"{source}: d2t maps draft ids to target ids {int(ids.min())}..{int(ids.max())}, "
                              f"outside the vocabulary 0..{V - 1}")
    if ids.unique().numel() != ids.numel():
        raise AnchorspecError(f"{source}: d2t maps several draft ids to the same target id")
    marked = drafter.t2d.nonzero().view(-1)
    if marked.numel() != ids.numel() or not torch.equal(marked, ids.sort().values):
        raise AnchorspecError(f"{source}: t2d marks {marked.numel()} target ids that disagree with d2t "
                              f"({ids.numel()} draft ids)")


def save_drafter(drafter: Eagle3Drafter, path: str | os.PathLike, dtype: torch.dtype | None = None) -> None:
    """Write config.json + model.safetensors atomically (temp file + rename per file)."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    state = checkpoint_state(drafter)
    if dtype is not None:
        state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}
    cfg = drafter.config.to_dict()
    cfg["torch_dtype"] = str(dtype or drafter.fc.weight.dtype).removeprefix("torch.")
    atomic_write(path / "model.safetensors", lambda f: save_file(state, f, metadata={"format": "pt"}))
    atomic_write(path / "config.json", lambda f: Path(f).write_text(json.dumps(cfg, indent=2) + "\n"))


def average_weights(n: int, weights=None) -> list[float]:
    """The weights `average_drafters` uses for n drafters: equal by default, else one each, non-negative, summing to 1."""
    if n < 2:
        raise AnchorspecError("averaging needs at least two drafters")
    weights = [1.0 / n] * n if weights is None else [float(w) for w in weights]
    if len(weights) != n:
        raise AnchorspecError(f"{len(weights)} weights for {n} drafters")
    if any(w < 0 for w in weights) or abs(sum(weights) - 1.0) > 1e-6:
        raise AnchorspecError(f"weights must be non-negative and sum to 1, got {weights}")
    return weights


def average_drafters(paths, weights=None) -> Eagle3Drafter:
    """The weighted mean of drafters of one shape and one draft vocabulary (float32): a round and the drafter it
    started from averaged is that round taken part of the way (WiSE-FT). Weights: see `average_weights`; drafters
    whose configs or d2t/t2d differ are refused, since averaging them means nothing."""
    paths = [Path(p) for p in paths]
    weights = average_weights(len(paths), weights)
    drafters = [load_drafter(p, torch.float32) for p in paths]
    first = drafters[0]

    def config_of(d: Eagle3Drafter) -> dict:  # the storage dtype is not part of a drafter's shape
        return {k: v for k, v in d.config.to_dict().items() if k != "torch_dtype"}

    reference = config_of(first)
    for path, d in zip(paths[1:], drafters[1:]):
        config = config_of(d)
        if config != reference:
            differ = sorted(k for k in reference.keys() | config.keys() if reference.get(k) != config.get(k))
            raise AnchorspecError(f"{path}: its config differs from {paths[0]}'s in {differ}; only drafters of one "
                                  "shape average")
        if not (torch.equal(d.d2t, first.d2t) and torch.equal(d.t2d, first.t2d)):
            raise AnchorspecError(f"{path}: its draft vocabulary (d2t) differs from {paths[0]}'s")
    states = [d.state_dict() for d in drafters]
    first.load_state_dict({k: sum(w * s[k] for w, s in zip(weights, states)) if v.is_floating_point() else v
                           for k, v in states[0].items()})
    return first


def init_drafter(target_config, variant: str = "eagle3.1", draft_vocab_size: int | None = None,
                 aux_layer_ids=None, seed: int = 0, init_std: float = 0.02, num_layers: int = 1) -> Eagle3Drafter:
    """A randomly initialised drafter shaped after the target (the start point for training and tests)
    with `num_layers` decoder layers."""
    if variant not in ("eagle3", "eagle3.1"):
        raise AnchorspecError(f"unknown drafter variant {variant!r}; choose eagle3 or eagle3.1")
    tc = target_config
    L = int(tc.num_hidden_layers)
    vocab = int(tc.vocab_size)
    rope = getattr(tc, "rope_parameters", None) or {}
    theta = rope.get("rope_theta", getattr(tc, "rope_theta", 10000.0))
    scaling = {k: v for k, v in rope.items() if k != "rope_theta"} if rope.get("rope_type", "default") != "default" else None
    cfg = DrafterConfig(
        hidden_size=int(tc.hidden_size),
        intermediate_size=int(tc.intermediate_size),
        num_attention_heads=int(tc.num_attention_heads),
        num_key_value_heads=int(getattr(tc, "num_key_value_heads", None) or tc.num_attention_heads),
        head_dim=int(getattr(tc, "head_dim", None) or tc.hidden_size // tc.num_attention_heads),
        vocab_size=vocab,
        draft_vocab_size=int(vocab if draft_vocab_size is None else draft_vocab_size),
        target_hidden_size=int(tc.hidden_size),
        rms_norm_eps=float(getattr(tc, "rms_norm_eps", 1e-6)),
        rope_theta=float(theta),
        rope_scaling=scaling,
        max_position_embeddings=int(getattr(tc, "max_position_embeddings", 2048)),
        fc_norm=variant == "eagle3.1",
        norm_output=variant == "eagle3.1",
        eagle_aux_hidden_state_layer_ids=list((2, L // 2, L - 3) if aux_layer_ids is None else aux_layer_ids),
        num_hidden_layers=num_layers,
    )
    gen = torch.Generator().manual_seed(seed)
    drafter = Eagle3Drafter(cfg)
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=gen) * init_std)
            elif name.endswith("bias"):
                p.zero_()
    drafter.set_vocab_mapping(torch.arange(cfg.draft_vocab_size))
    return drafter.eval()


def layer_from_target(drafter: Eagle3Drafter, target_layer: nn.Module) -> None:
    """Start the drafter's first decoder layer as `target_layer` (a Llama-style decoder layer of the
    target: q/k/v/o_proj, gate/up/down_proj, input_layernorm, post_attention_layernorm), reading the
    highest captured state.

    q/k/v read concat(input_layernorm(emb), hidden_norm(x_in)): the target's projections go into the
    x_in half and `hidden_norm` takes the target's input norm, while the embedding half keeps its
    random start (the drafted token must still reach the layer). `fc` passes the last captured state
    through unchanged (identity block; the other blocks keep their random start), so with a zero
    embedding the layer computes exactly what the target's layer computes on that state.
    """
    H, Ht, n_aux = drafter.config.hidden_size, drafter.config.target_hidden_size, drafter.config.num_aux
    if H != Ht:
        raise AnchorspecError(f"--init-layer target needs the drafter's hidden size ({H}) to equal the target's ({Ht})")
    mid = drafter.midlayer
    t_attn, t_mlp = target_layer.self_attn, target_layer.mlp
    with torch.no_grad():
        for name in ("q_proj", "k_proj", "v_proj"):
            ours, theirs = getattr(mid.self_attn, name), getattr(t_attn, name)
            if ours.weight.shape[0] != theirs.weight.shape[0]:
                raise AnchorspecError(f"--init-layer target: the target layer's {name} has "
                                      f"{theirs.weight.shape[0]} outputs, the drafter's {ours.weight.shape[0]}")
            ours.weight[:, H:].copy_(theirs.weight)
            if ours.bias is not None and getattr(theirs, "bias", None) is not None:
                ours.bias.copy_(theirs.bias)
        mid.self_attn.o_proj.weight.copy_(t_attn.o_proj.weight)
        for name in ("gate_proj", "up_proj", "down_proj"):
            getattr(mid.mlp, name).weight.copy_(getattr(t_mlp, name).weight)
        mid.hidden_norm.weight.copy_(target_layer.input_layernorm.weight)
        mid.post_attention_layernorm.weight.copy_(target_layer.post_attention_layernorm.weight)
        drafter.fc.weight[:, (n_aux - 1) * Ht:].copy_(torch.eye(H, dtype=drafter.fc.weight.dtype))
        if drafter.fc.bias is not None:
            drafter.fc.bias.zero_()


def deepen(drafter: Eagle3Drafter, num_layers: int, seed: int = 0, init_std: float = 0.02) -> Eagle3Drafter:
    """`drafter` with decoder layers appended up to `num_layers`, computing exactly what it computed.

    Each new layer starts as the identity: its o_proj and down_proj are zero, so both residual
    branches add nothing, while its other weights are random (as in `init_drafter`) so that the
    branches have gradients once the zero projections move. Training a grown drafter from a trained
    one thus compares depth against more steps of the same drafter, not against a fresh start.
    """
    old = drafter.config.num_hidden_layers
    if num_layers < old:
        raise AnchorspecError(f"cannot deepen a drafter of {old} decoder layers to {num_layers}")
    grown = Eagle3Drafter(DrafterConfig.from_dict({**drafter.config.to_dict(), "num_hidden_layers": num_layers}))
    grown.to(drafter.fc.weight.dtype)
    missing, unexpected = grown.load_state_dict(drafter.state_dict(), strict=False)
    assert not unexpected and all(k.startswith("deep_layers.") for k in missing), (missing, unexpected)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in list(grown.deep_layers)[old - 1:]:
            for name, p in layer.named_parameters():
                if name in ("self_attn.o_proj.weight", "mlp.down_proj.weight"):
                    p.zero_()
                elif p.dim() == 2:
                    p.copy_(torch.randn(p.shape, generator=gen).to(p.dtype) * init_std)
    if drafter.embed_weight is not None:
        grown.bind_target_embedding(drafter.embed_weight)
    return grown.train(drafter.training)
