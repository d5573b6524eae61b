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
from pathlib import Path

import torch
from torch import nn

from ..errors import AnchorspecError
from .attention import GQA, graph_forms, use_grouped_attention, uses_grouped_attention
from .compiled import (aot_graph_key, frozen_compile, graphs_compiled, mark_dynamic, run_static, static_cache_dims,
                       static_example, step_graph, weights_digest)
from .dtype import DTYPES, model_shapes, parse_dtype, resolve_device, resolve_packing, resolve_target_dtype  # noqa: F401 (DTYPES, parse_dtype: re-exported)
from .hub import resolve_target
from .packed import fuse_siblings, is_packed, pack_linears


def default_aux_layer_ids(num_layers: int) -> tuple[int, int, int]:
    return (2, num_layers // 2, num_layers - 3)


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder layer list of a causal LM (`model.model.layers` for Llama, Qwen2, Mistral, ...)."""
    inner = model.get_decoder() if hasattr(model, "get_decoder") else getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise AnchorspecError(f"{type(model).__name__} has no `model.layers`; only decoder-only LMs are supported")
    return layers


def _select_rows(head: nn.Module, args, kwargs):
    """LM head pre-hook: [B, T, H] -> [1, R, H], the flat rows `head.anchorspec_rows` (b * T + t)
    only, so padding and unwanted rows never pay for the LM head. Inactive while that is None.
    Registered once, not per call: torch.compile does not see a hook added after it traced."""
    rows = head.anchorspec_rows
    if rows is None:
        return None
    hidden = args[0] if args else kwargs["input"]
    picked = hidden.reshape(-1, hidden.shape[-1]).index_select(0, rows)[None]
    return ((picked, *args[1:]), kwargs) if args else (args, {**kwargs, "input": picked})


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
        self._compiled = None  # compile(): the inductor-compiled forward_rows body
        self._aot = None  # compile(aot=True): "pending" until the first static forward builds or loads the graph
        self._batched = False  # compile(batched=True): a graph per attention form where they differ
        self._weights_key = None  # compile(aot=True): (the stock weights' digest, fused), in the graph's name
        self._digest = None  # weights_digest of the weights as loaded, computed once (~0.3 s)
        self.compiles = 0  # graphs compiled during this target's compiled forwards (see forward_rows)

    @property
    def compiled(self) -> bool:
        return self._compiled is not None or self._aot is not None

    @property
    def aot(self) -> bool:
        """Compiled ahead of time (compile(aot=True)): one graph file per model and machine."""
        return self._aot is not None

    def compile(self, enabled: bool = True, fuse: bool = True, aot: bool | None = None, batched: bool = False) -> None:
        """Run decode and verify forwards (`forward_rows` with a static cache, see decode/batch.py)
        through an inductor graph with the weights frozen, so on CPU each linear layer uses oneDNN's
        prepacked kernels and the small ops between them fuse. Prefills stay eager.

        `aot` (default: on a CPU): one graph compiled ahead of time (`load_graph`, models/compiled.py),
        every size dynamic, kept on disk per model and machine: ~75-95 s to compile for SmolLM2-135M on 2
        cores the first time (twice, batched, where grouped attention takes two forms: models/attention.py), 2-3 s
        to load after (session 46: the plain loop 2.19x HF `generate` in bf16 on an AMX Xeon, against 1.72x with
        torch.compile). Otherwise (CUDA) torch.compile: batch size, new
        tokens per row, rows kept, key length and the cache's slots and capacity are dynamic, so a few
        graphs serve every step (a plain step, a verify, at batch 1 or more), ~60 s each, in every
        process (inductor's disk cache skips graphs with prepacked constants). `fuse`: q/k/v and gate/up
        first become one product each (models/packed.py, stock weights the frozen graph packs): inductor
        calls each linear layer on its own, 7 calls a layer where 4 do (session 45). `batched`: the steps will
        be rounds of several sequences (a server's), so a second graph where grouped attention's few-row form differs
        (models/attention.py: graph_forms)."""
        self._batched = batched
        if not enabled:
            self._compiled = self._aot = None
            return
        if is_packed(self.model):
            raise AnchorspecError("compile needs the stock weights (load the target with pack='off'): its frozen "
                                  "graph packs them itself")
        if aot is None:
            aot = self.embed_weight.device.type == "cpu"  # CUDA: torch.compile, until a GPU session verifies AOT there
        if aot:
            self._weights_key = (self._stock_digest(), fuse)  # read before fusing renames the weights
        if fuse:
            fuse_siblings(self.model, pack=False)
        self._compiled, self._aot = (None, "pending") if aot else (frozen_compile(self._rows_body), None)

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
        if getattr(self, "_aot", None) is not None and ids != self.aux_layer_ids:
            self._aot = "pending"  # the graph returns the aux states it was traced with
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
        device = self.embed_weight.device  # inputs built on the CPU (bookkeeping) move where the model is
        try:
            out = self.model(
                input_ids=input_ids.view(1, -1).to(device),
                position_ids=position_ids.view(1, -1).to(device),
                attention_mask=None if attention_mask is None else attention_mask.to(device),
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
        head = self._row_selecting_head()
        self._capture = capture_aux  # read by the aux capture hooks
        self._captured = {}
        try:
            graph = self.load_graph() if self._aot is not None and getattr(cache, "static", False) else None
            if graph is not None:  # a static cache carries a mask
                logits, *aux = run_static(graph, (input_ids, position_ids, rows), attention_mask, cache)
                aux = aux[0] if capture_aux else None  # the graph always returns them: one graph for every step
            elif self._compiled is not None and getattr(cache, "static", False):
                # dynamic from the first trace, else each new size costs one more ~40 s compile before dynamo
                # generalises it: the key length (grows every step), rows and new tokens per row (a chain,
                # a tree, a plain step; sizes 0 and 1 stay specialised), and the cache's slots and
                # capacity (they differ per request and grow)
                mark_dynamic([(attention_mask, (0, 2, 3)), (input_ids, (0, 1)), (position_ids, (0, 1)), (rows, (0,)),
                              *static_cache_dims(cache)])
                graphs = graphs_compiled()
                logits, aux = self._compiled(input_ids, position_ids, attention_mask, cache, rows, capture_aux)
                self.compiles += graphs_compiled() - graphs
            else:
                logits, aux = self._rows_body(input_ids, position_ids, attention_mask, cache, rows, capture_aux)
        finally:
            self._capture, self._captured, head.anchorspec_rows = False, {}, None
        return TargetOutput(logits=logits, aux=aux)

    def load_graph(self):
        """The ahead-of-time graph of a static forward_rows (models/compiled.py: aot_compile), built or
        loaded on first use. Every size is dynamic (rows, new tokens per row, kept rows, key length, the
        cache's slots and capacity, each from 1 up), so one graph serves plain steps, verifies and the
        fallback's steps, at any batch; it always captures the aux states (a concatenation of three
        [B, T, H] tensors: nothing beside a step's weight reads). None, after one line on stderr, where
        it cannot be compiled (no C++ compiler, say): the target then runs eager steps."""
        if self._aot is None:
            raise AnchorspecError("load_graph needs compile(aot=True) first")
        if self._aot == "pending":
            self.compiles += 1
            self._aot = step_graph(self.model, self._aot_body, self._aot_example,
                                   (("rows", "tokens"), ("rows", "tokens"), ("kept",)), self.num_layers,
                                   self._graph_key(), "the target's step graph", self._graph_forms())
        return self._aot

    def aot_path(self, fuse: bool = True) -> Path:
        """Where this target's AOT graph is kept on this machine (it may not exist yet): it depends on the
        weights (as loaded: compile() reads them before fusing), whether sibling projections are fused,
        the config, the aux layers it returns, the CPU and the library versions."""
        return self._graph_key(fuse)[0]

    def _graph_forms(self) -> tuple[str, str]:
        """Grouped attention's (one-row, few-row) forms in this target's graphs (models/attention.py: graph_forms)."""
        weight, (kv_heads, groups, head_dim) = self.embed_weight, self._attention_shape()
        return graph_forms(weight.device, weight.dtype, kv_heads, groups, head_dim, self._batched) \
            if uses_grouped_attention(self.model) else (GQA, GQA)

    def _graph_key(self, fuse: bool = True) -> tuple[Path, str]:
        """The key of the graph traced in the one-row form (the few-row form's, where it differs: compiled.form_key)."""
        attention = self._graph_forms()[0] if uses_grouped_attention(self.model) else "stock"
        fields = {"weights": self._weights_key or (self._stock_digest(), fuse), "config": self.config.to_json_string(),
                  "aux": list(self.aux_layer_ids), "model": type(self.model).__name__, "attention": attention}
        return aot_graph_key("target", fields)

    def _stock_digest(self) -> str:
        if self._digest is None:
            self._digest = weights_digest(self.model)
        return self._digest

    def _aot_body(self, input_ids, position_ids, rows, mask, cache):
        self._capture, self._captured = True, {}
        try:
            return self._rows_body(input_ids, position_ids, mask, cache, rows, True)
        finally:
            self._capture, self._captured = False, {}

    def _attention_shape(self) -> tuple[int, int, int]:
        """(key/value heads, query heads per key/value head, head size) from the config."""
        c = self.config
        kv_heads = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
        return kv_heads, c.num_attention_heads // kv_heads, getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads

    def _aot_example(self, rows: int, tokens: int, past: int, kept: int, slots: int, capacity: int) -> tuple:
        """Inputs of the AOT graph's shapes (models/compiled.py: static_example)."""
        kv_heads, _, head_dim = self._attention_shape()
        return static_example(rows, tokens, past, kept, slots, capacity, kv_heads, head_dim, self.num_layers,
                              self.dtype, self.embed_weight.device)

    def _row_selecting_head(self) -> nn.Module:
        """The LM head, with the row-selecting pre-hook registered once per module (looked up per call:
        packing may have replaced the head since this Target was made)."""
        head = self.model.get_output_embeddings()
        if not getattr(head, "anchorspec_row_hook", False):  # a flag of its own: anchorspec_rows is set per call
            head.anchorspec_rows, head.anchorspec_row_hook = None, True
            head.register_forward_pre_hook(_select_rows, with_kwargs=True)
        return head

    def _rows_body(self, input_ids, position_ids, attention_mask, cache, rows, capture_aux: bool):
        """forward_rows' computation, as one function that torch.compile can trace: the hooks it
        passes through are registered once (dynamo does not see a hook added after it traced), and
        `rows` reaches the LM head's hook through an attribute set here, so that dynamo sees it as
        this call's input rather than a constant."""
        head = self._row_selecting_head()  # registered before any trace (an AOT graph may be traced first)
        head.anchorspec_rows = rows
        out = self.model(input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask,
                         **{self._cache_kwarg: cache}, use_cache=True)
        head.anchorspec_rows = None
        return out.logits[0], (self._take_aux() if capture_aux else None)

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


def load_target(target: str, dtype: str | torch.dtype = "auto", aux_layer_ids=None, attn: str = "sdpa",
                pack: str | None = None, stock: bool = False, device: str | torch.device = "cpu") -> Target:
    """Load a target by directory, alias or hub id onto `device` ("auto": CUDA when present, models/dtype.py
    resolve_device); dtype "auto" is the fast one there (models/dtype.py);
    `pack` ("auto", "on", "off"; None: $ANCHORSPEC_PACK or auto): prepack the linear weights for
    oneDNN where that was measured faster, q/k/v and gate/up as one product each (models/packed.py);
    SDPA attention runs in the fastest grouped-query form per call (models/attention.py). `stock`: neither,
    transformers as users get it (a baseline)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    device = resolve_device(device)
    torch_dtype = resolve_target_dtype(dtype, target, device=str(device), pack=pack) if isinstance(dtype, str) else dtype
    path = resolve_target(target)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype, attn_implementation=attn)
    except (OSError, ValueError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise AnchorspecError(f"cannot load target {target!r} from {path}: {first}") from exc
    model.to(device)
    if stock:
        return Target(model, tokenizer, aux_layer_ids)
    if model.device.type == "cpu":
        use_grouped_attention(model)
    pack_if_faster(model, pack, torch_dtype)
    return Target(model, tokenizer, aux_layer_ids)


def pack_if_faster(model: nn.Module, pack: str | None, dtype: torch.dtype) -> None:
    """Prepack the target's linear layers (q/k/v and gate/up fused) where `pack` (resolve_packing: auto
    measures) says so."""
    if resolve_packing(pack, dtype, model.device, model_shapes(model.config)):
        pack_linears(model, fuse=True)


def stock_twin(target: Target, name: str, dtype: torch.dtype) -> Target:
    """`target` itself, or, when its weights are prepacked or its attention is the project's, the same model
    loaded again as transformers gives it: a Hugging Face baseline never runs the project's changes."""
    changed = is_packed(target.model) or uses_grouped_attention(target.model)
    return load_target(name, dtype, stock=True) if changed else target
