"""Grouped-query attention through torch's SDPA in the form that is fastest for the call, on a CPU.

SDPA takes grouped-query attention (several query heads per key/value head) in three forms:
`enable_gqa=True`; keys and values repeated per query head (what transformers does on a CPU whenever
a mask is given and the query has more than one row); or, for one query row, the query heads of a group
laid out as rows of their key/value head (transformers' `pack_gqa`, which it uses only when a mask is
given). For SmolLM2-135M's shapes (3 key/value heads x 3 groups x 64) on an AVX-512-bf16 EPYC, 2
threads, 512 keys, µs per call (benchmarks/bench_attention.py, results in benchmarks/results/lean-step-s37/):

| query rows | dtype | enable_gqa | repeated k/v + mask | group as rows |
|---|---|---|---|---|
| 1 (a plain step) | bf16 | 294 | 332 | **62** |
| 1 | fp32 | **46** | 160 | 54 |
| 4 (a verify), mask | bf16 | **117** | 189 | 106 (mask repeated) |
| 16, mask | bf16 | **276** | 343 | 264 (mask repeated) |

transformers decodes one row with `enable_gqa` (no mask: 4.7x group-as-rows' time here in bf16) and
verifies with repeated keys and values. Here a call takes one of three forms by its query rows T (new tokens per
sequence): T = 1 (a plain step) and 2 <= T <= FEW_ROWS (a verify, a drafter's pass) each take whichever of
`enable_gqa` and group-as-rows a short probe at that kind of shape measures faster for the dtype (cached per machine,
as the dtype probe is); longer ones (prefills, catch-ups) take `enable_gqa`, which wins there. Session 87 (AMX Xeon,
bf16, 1 thread, µs per call): 16 sequences x 2 rows over 150 keys 650 (`enable_gqa`) against 418 (group-as-rows),
4 x 4 over 256 254 against 167, but 16 x 1 231 against 375 and 1 x 512 causal 2,326 against 2,570; in float32 every
shape was 6-25 % faster with `enable_gqa`. A compiled step graph has one body for every T and is traced in one form
(`traced_in`); where the two verdicts differ, a model compiled for batched rounds (a server's) keeps a graph per form
and steps of 2..FEW_ROWS rows take the few-row one (models/compiled.py: ByQueryRows): in the target's graphs at 16
sequences a 2-token verify took 53.6 ms in group-as-rows against 68.6 in `enable_gqa`, a plain step 47.7 against 43.0. (Both forms as `torch.cond` branches
of one graph computed wrong logits for T >= 2 in SmolLM2's bf16 graph, though not in small models'.) The forms
compute the same dot products and softmax per row; equality with the stock path is tested, and lossless decoding does
not depend on it (plain and speculative steps share this function)."""

from __future__ import annotations

import time
from contextlib import contextmanager

import torch
import torch.nn.functional as F

from .dtype import cached_verdict, machine_key, on_cpu

IMPLEMENTATION = "anchorspec_sdpa"  # the name the target's config carries once use_grouped_attention ran
GQA, ROWS = "enable_gqa", "rows"
PROBE_VERSION = 1  # bump when the probe changes, so old verdicts are not reused
FEW_ROWS = 16  # query rows up to which a call takes the few-row verdict: chains and 16-node trees, drafter passes
_one_row_form: dict[tuple, str] = {}
_few_rows_form: dict[tuple, str] = {}
_traced_form = GQA  # the form an exported graph is being traced in (traced_in)
_transformers_sdpa = None  # transformers' own SDPA function, bound when hf_attention is registered


def _faster_form(query: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor | None) -> str:
    """GQA or ROWS: the faster form for these inputs, median of 15 calls each (a few ms)."""
    cost = {}
    for form in (GQA, ROWS):
        times = []
        for _ in range(18):
            t0 = time.perf_counter()
            _attend(query, keys, keys, mask, None, form)
            times.append(time.perf_counter() - t0)
        cost[form] = sorted(times[3:])[len(times[3:]) // 2]
    return ROWS if cost[ROWS] < cost[GQA] else GQA


def _probe_one_row(device: torch.device, dtype: torch.dtype, kv_heads: int, groups: int, head_dim: int) -> str:
    """The faster form for one sequence's plain step over 256 keys (no mask)."""
    keys = torch.randn(1, kv_heads, 256, head_dim, device=device).to(dtype)
    return _faster_form(torch.randn(1, kv_heads * groups, 1, head_dim, device=device).to(dtype), keys, None)


def _probe_few_rows(device: torch.device, dtype: torch.dtype, kv_heads: int, groups: int, head_dim: int) -> str:
    """The faster form for a verify of 4 sequences x 4 new tokens over 256 keys, masked."""
    keys = torch.randn(4, kv_heads, 256, head_dim, device=device).to(dtype)
    query = torch.randn(4, kv_heads * groups, 4, head_dim, device=device).to(dtype)
    return _faster_form(query, keys, torch.zeros(4, 1, 4, 256, device=device, dtype=dtype))


def _memo(device: torch.device, dtype: torch.dtype, kv_heads: int, groups: int, head_dim: int) -> tuple:
    """The in-memory key of a form verdict (_one_row_form, _few_rows_form)."""
    return device.type, dtype, kv_heads, groups, head_dim, torch.get_num_threads()


def _form_verdict(forms: dict, probe, what: dict, device: torch.device, dtype: torch.dtype, kv_heads: int,
                  groups: int, head_dim: int) -> str:
    """GQA or ROWS from `probe`: measured once per machine and shapes (cached under $ANCHORSPEC_HOME/attention/, so
    every process on a machine rounds alike), then kept in `forms` (memory)."""
    memo = _memo(device, dtype, kv_heads, groups, head_dim)
    if memo not in forms:
        def measure() -> dict:
            with torch.inference_mode():
                return {"form": probe(device, dtype, kv_heads, groups, head_dim)}

        key = machine_key(device=device.type, dtype=str(dtype), kv_heads=kv_heads, groups=groups, head_dim=head_dim,
                          probe=PROBE_VERSION, **what)
        record, _ = cached_verdict("attention", key, measure, lambda r: r.get("form") in (GQA, ROWS))
        forms[memo] = record["form"]
    return forms[memo]


def one_row_form(device: torch.device, dtype: torch.dtype, kv_heads: int, groups: int, head_dim: int) -> str:
    """GQA or ROWS for one query row (a plain step)."""
    return _form_verdict(_one_row_form, _probe_one_row, {}, device, dtype, kv_heads, groups, head_dim)


def few_rows_form(device: torch.device, dtype: torch.dtype, kv_heads: int, groups: int, head_dim: int) -> str:
    """GQA or ROWS for 2..FEW_ROWS query rows (a verify, a drafter's pass)."""
    return _form_verdict(_few_rows_form, _probe_few_rows, {"query_rows": "few"}, device, dtype, kv_heads, groups,
                         head_dim)


def _attend(query, key, value, mask, scale, form: str) -> torch.Tensor:
    if form == GQA:
        return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scale, enable_gqa=True)
    return _group_rows(query, key, value, mask, scale)


def _group_rows(query, key, value, mask, scale) -> torch.Tensor:
    """Group-as-rows for T query rows: query head kv * groups + g, row t -> row g * T + t of key/value
    head kv, the [B or 1, 1, T, L] mask repeated per group (a one-row mask broadcasts as it is)."""
    B, H, T, D = query.shape
    groups = H // key.shape[1]
    # contiguous().view and unflatten/flatten, not reshape: reshape's view checks on the symbolic strides put a
    # guard on T (unprovable for T >= 1) into the export of the step graph, which then failed
    rows = query.contiguous().view(B, key.shape[1], groups * T, D)
    if mask is not None and mask.shape[2] != 1:
        mask = mask.repeat(1, 1, groups, 1)
    out = F.scaled_dot_product_attention(rows, key, value, attn_mask=mask, scale=scale)
    return out.unflatten(2, (groups, T)).flatten(1, 2)


def graph_forms(device: torch.device, dtype: torch.dtype, kv_heads: int, groups: int, head_dim: int,
                batched: bool = False) -> tuple[str, str]:
    """(one-row form, few-row form) of a model's step graphs: the verdicts on a CPU (probed now, before any tracing,
    which cannot time anything), else GQA for both. The few-row verdict only for a `batched` model (a server's:
    several sequences a round), else the one-row form for both: one graph per model. A second graph set doubled a
    new user's first demo (253 -> 519 s, 0.78 -> 1.6 GB of graphs) and bought one stream nothing measurable (1.27x
    and 1.36x plain without it, 1.23x and 1.24x with; AMX Xeon, bf16, 2 threads, session 88).
    ANCHORSPEC_FEW_ROWS_GRAPH=off: one graph per model even when batched."""
    from .hub import switched_on

    if groups < 2 or device.type != "cpu":
        return GQA, GQA
    one = one_row_form(device, dtype, kv_heads, groups, head_dim)
    if not batched or not switched_on("ANCHORSPEC_FEW_ROWS_GRAPH"):
        return one, one
    return one, few_rows_form(device, dtype, kv_heads, groups, head_dim)


@contextmanager
def traced_in(form: str):
    """Grouped attention in an exported graph takes `form` at every row count while this is open."""
    global _traced_form
    before, _traced_form = _traced_form, form
    try:
        yield
    finally:
        _traced_form = before


def grouped_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
                      scale: float | None = None, is_causal: bool = False) -> torch.Tensor:
    """SDPA of query [B, H, T, D] over key, value [B, KV, L, D] (H a multiple of KV) with an additive or
    boolean `mask` broadcast over heads ([B or 1, 1, T, L]) or None; returns [B, H, T, D]."""
    B, H, T, D = query.shape
    groups = H // key.shape[1]
    if groups > 1 and not is_causal and on_cpu(query) and (mask is None or mask.shape[1] == 1):
        if torch.compiler.is_compiling():
            # an exported step graph (AOT) has one body for every T: the form it is traced in (traced_in).
            # torch.compile keeps enable_gqa: its guards on the regrouped shapes recompiled as T varied
            # (and dynamo guarded on the memo dict it read, recompiling whenever a probe added to it)
            if torch.compiler.is_exporting() and _traced_form == ROWS:
                return _group_rows(query, key, value, mask, scale)
        elif T == 1:
            form = one_row_form(query.device, query.dtype, key.shape[1], groups, D)
            return _attend(query, key, value, mask, scale, form)
        elif T <= FEW_ROWS:
            form = few_rows_form(query.device, query.dtype, key.shape[1], groups, D)
            return _attend(query, key, value, mask, scale, form)
    return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scale, is_causal=is_causal,
                                          enable_gqa=groups > 1)


def hf_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling: float | None = None,
                 is_causal: bool | None = None, **kwargs):
    """transformers' attention-function signature (AttentionInterface): grouped_attention on a CPU for
    decode and verify forwards; transformers' own SDPA function for the rest (a prefill's causal form
    without a mask, dropout, position biases, another device)."""
    if (not on_cpu(query) or dropout or kwargs.get("position_bias") is not None
            or kwargs.get("s_aux") is not None or kwargs.get("softcap") is not None
            or (attention_mask is None and query.shape[2] > 1)
            or (attention_mask is not None and attention_mask.shape[1] != 1)):
        return _transformers_sdpa(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                  is_causal=is_causal, **kwargs)
    out = grouped_attention(query, key, value, attention_mask, scaling)
    return out.transpose(1, 2).contiguous(), None


def use_grouped_attention(model) -> bool:
    """Point an SDPA model's attention at hf_attention (registered with transformers once). Returns
    whether it did: models on another attention implementation keep theirs. transformers is imported
    here, not at module level (the drafter imports this module), and not per attention call."""
    global _transformers_sdpa
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    if getattr(model.config, "_attn_implementation", None) != "sdpa":
        return False
    _transformers_sdpa = sdpa_attention_forward
    AttentionInterface.register(IMPLEMENTATION, hf_attention)
    AttentionMaskInterface.register(IMPLEMENTATION, sdpa_mask)  # the same masks, and their skips, as "sdpa"
    model.set_attn_implementation(IMPLEMENTATION)
    return True


def uses_grouped_attention(model) -> bool:
    return getattr(model.config, "_attn_implementation", None) == IMPLEMENTATION
