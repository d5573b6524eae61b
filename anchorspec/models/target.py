"""The target model: any decoder-only HF causal LM with `model.layers`.

We never copy modeling code. The target is driven through `position_ids`, a 4-D additive attention
mask (for tree verification) and a `DynamicCache`; the three auxiliary hidden states that feed an
EAGLE-3 drafter are captured by forward *pre*-hooks on the chosen decoder layers, so only those
three tensors are kept (no `output_hidden_states`).

Aux layer ids follow convention A of the spec: id i is the input of decoder layer i, i.e. HF's
`outputs.hidden_states[i]` (0 = embeddings). Default (2, L//2, L-3).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
from torch import nn

from ..errors import AnchorspecError
from .dtype import DTYPES, parse_dtype, resolve_target_dtype  # noqa: F401 (DTYPES, parse_dtype: re-exported)
from .hub import resolve_target


def default_aux_layer_ids(num_layers: int) -> tuple[int, int, int]:
    return (2, num_layers // 2, num_layers - 3)


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder layer list of a causal LM (`model.model.layers` for Llama, Qwen2, Mistral, ...)."""
    inner = model.get_decoder() if hasattr(model, "get_decoder") else getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise AnchorspecError(f"{type(model).__name__} has no `model.layers`; only decoder-only LMs are supported")
    return layers


@dataclass
class TargetOutput:
    logits: torch.Tensor  # [T_kept, V] float32 or the model dtype (float64 stays float64)
    aux: torch.Tensor | None  # [T, n_aux * H] raw residual stream inputs of the aux layers


class Target:
    """A loaded target model plus its tokenizer, with aux-state capture hooks."""

    def __init__(self, model: nn.Module, tokenizer=None, aux_layer_ids=None):
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.config = model.config
        self.layers = decoder_layers(model)
        self.num_layers = len(self.layers)
        self.hidden_size = int(self.config.hidden_size)
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])
        self._captured: dict[int, torch.Tensor] = {}
        self._capture = False
        self._hooks = []
        # transformers 5.x renames `past_key_values` to `cache` model by model (Llama first; the old name
        # is deprecated, to be removed in 5.40): pass the one this model's forward declares
        params = inspect.signature(model.forward).parameters
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"
        self.set_aux_layers(aux_layer_ids or default_aux_layer_ids(self.num_layers))

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    @property
    def embed_weight(self) -> torch.Tensor:
        return self.model.get_input_embeddings().weight

    def set_aux_layers(self, ids) -> None:
        ids = tuple(int(i) for i in ids)
        bad = [i for i in ids if not 0 <= i < self.num_layers]
        if bad:
            raise AnchorspecError(
                f"aux layer ids {list(ids)} out of range for a target with {self.num_layers} layers "
                f"(valid: 0..{self.num_layers - 1}, convention: HF hidden_states index)"
            )
        for h in self._hooks:
            h.remove()
        self.aux_layer_ids = ids
        self._hooks = [
            self.layers[i].register_forward_pre_hook(self._hook(i), with_kwargs=True) for i in sorted(set(ids))
        ]

    def _hook(self, idx: int):
        def capture(_module, args, kwargs):
            if self._capture:
                hidden = args[0] if args else kwargs["hidden_states"]
                self._captured[idx] = hidden

        return capture

    def new_cache(self):
        from transformers import DynamicCache

        return DynamicCache(config=self.config)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        cache,
        attention_mask: torch.Tensor | None = None,
        capture_aux: bool = False,
        last_only: bool = False,
    ) -> TargetOutput:
        """Run the target on `input_ids` [T] at `position_ids` [T], appending to `cache`.

        `attention_mask` is an additive 4-D mask [1, 1, T, past + T] (tree verification) or None
        (plain causal). `last_only` computes the LM head on the last position only.
        """
        self._capture = capture_aux
        self._captured = {}
        try:
            out = self.model(
                input_ids=input_ids.view(1, -1),
                position_ids=position_ids.view(1, -1),
                attention_mask=attention_mask,
                **{self._cache_kwarg: cache},
                use_cache=True,
                logits_to_keep=1 if last_only else 0,
            )
        finally:
            self._capture = False
        aux = self._take_aux()[0] if capture_aux else None
        return TargetOutput(logits=out.logits[0], aux=aux)

    @torch.inference_mode()
    def forward_rows(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        cache,
        attention_mask: torch.Tensor | None,
        keep: torch.Tensor,
        capture_aux: bool = False,
    ) -> TargetOutput:
        """One padded batch: `input_ids`, `position_ids` [B, T], additive `attention_mask` [B, 1, T, K],
        `cache` anything with the HF `update(keys, values, layer_idx)` method (a 4-D mask is used as
        given, so transformers asks the cache nothing else; with None it builds the causal mask from
        the cache's `get_query_offset` and `get_mask_sizes`).

        Returns logits [R, V] for the `keep` flat indices (b * T + t) only, so padding rows never
        pay for the LM head, and aux [B, T, n_aux * H] for every row."""
        rows = keep.to(self.embed_weight.device)

        def select(_module, args, kwargs):  # [B, T, H] -> [1, R, H] just before the LM head
            hidden = args[0] if args else kwargs["input"]
            picked = hidden.reshape(-1, hidden.shape[-1]).index_select(0, rows)[None]
            return ((picked, *args[1:]), kwargs) if args else (args, {**kwargs, "input": picked})

        hook = self.model.get_output_embeddings().register_forward_pre_hook(select, with_kwargs=True)
        self._capture = capture_aux
        self._captured = {}
        try:
            out = self.model(input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask,
                             **{self._cache_kwarg: cache}, use_cache=True)
        finally:
            self._capture = False
            hook.remove()
        return TargetOutput(logits=out.logits[0], aux=self._take_aux() if capture_aux else None)

    def _take_aux(self) -> torch.Tensor:
        aux = torch.cat([self._captured[i] for i in self.aux_layer_ids], dim=-1)
        self._captured = {}
        return aux

    @torch.no_grad()
    def features(self, input_ids: torch.Tensor, padding_mask: torch.Tensor | None = None) -> TargetOutput:
        """Training features for a right-padded batch [B, T]: logits [B, T, V] and aux [B, T, n_aux*H].

        Runs under no_grad, not inference_mode: the outputs feed the drafter's autograd graph.
        """
        self._capture = True
        self._captured = {}
        try:
            out = self.model(input_ids=input_ids, attention_mask=padding_mask, use_cache=False)
        finally:
            self._capture = False
        return TargetOutput(logits=out.logits, aux=self._take_aux())


def load_target(target: str, dtype: str | torch.dtype = "auto", aux_layer_ids=None, attn: str = "sdpa") -> Target:
    """Load a target by directory, alias or hub id; dtype "auto" is the fast one here (models/dtype.py)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch_dtype = resolve_target_dtype(dtype, target) if isinstance(dtype, str) else dtype
    path = resolve_target(target)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype, attn_implementation=attn)
    except (OSError, ValueError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise AnchorspecError(f"cannot load target {target!r} from {path}: {first}") from exc
    return Target(model, tokenizer, aux_layer_ids)
