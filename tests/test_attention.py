"""The project's grouped-query attention (models/attention.py): both one-row forms and the masked form
compute what repeated keys and values give, a target running it gives transformers' own SDPA logits,
the one-row form is measured once per shape, and only SDPA models are switched."""

import pytest
import torch
import torch.nn.functional as F

from anchorspec.models import attention
from anchorspec.models.attention import GQA, ROWS, grouped_attention, use_grouped_attention, uses_grouped_attention
from helpers import FAMILIES, prompts, tiny_target


@pytest.fixture
def force_form(monkeypatch, tmp_path):
    """force_form(GQA or ROWS[, few]): every one-row call takes that form, every call of 2..FEW_ROWS rows `few` (the
    same form unless given); nothing read from a cached verdict."""
    def force(form, few=None):
        monkeypatch.setenv("ANCHORSPEC_HOME", str(tmp_path / "home"))
        monkeypatch.setattr(attention, "_one_row_form", {})
        monkeypatch.setattr(attention, "_few_rows_form", {})
        monkeypatch.setattr(attention, "_probe_one_row", lambda *a: form)
        monkeypatch.setattr(attention, "_probe_few_rows", lambda *a: few or form)
    return force


def reference(q, k, v, mask, is_causal=False):
    """Keys and values repeated per query head: plain multi-head SDPA."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal)


@pytest.mark.parametrize("form", [GQA, ROWS])
@pytest.mark.parametrize("rows,masked", [(1, False), (1, True), (3, True), (5, False)])
@pytest.mark.parametrize("batch", [1, 2])
def test_every_form_is_multi_head_attention_with_repeated_keys(force_form, form, rows, masked, batch):
    torch.manual_seed(0)
    q = torch.randn(batch, 6, rows, 8, dtype=torch.float64)
    k, v = torch.randn(batch, 2, 11, 8, dtype=torch.float64), torch.randn(batch, 2, 11, 8, dtype=torch.float64)
    mask = None
    if masked:  # the last key hidden from the first row; additive, broadcast over heads
        mask = torch.zeros(batch, 1, rows, 11, dtype=torch.float64)
        mask[:, :, 0, -1] = float("-inf")
    force_form(form)
    causal = rows > 1 and not masked
    got = grouped_attention(q, k[..., :rows, :] if causal else k, v[..., :rows, :] if causal else v, mask,
                            is_causal=causal)
    want = reference(q, k[..., :rows, :] if causal else k, v[..., :rows, :] if causal else v, mask, causal)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    if masked and rows == 1:  # the mask did something: without it the answer changes
        assert not torch.allclose(grouped_attention(q, k, v, None), got)


def test_the_one_row_form_is_measured_once_per_machine_and_shape(monkeypatch, tmp_path):
    """Probed once per shape, then read from $ANCHORSPEC_HOME by a fresh process (so processes on one
    machine choose alike); a damaged verdict file is measured again."""
    calls = []
    monkeypatch.setenv("ANCHORSPEC_HOME", str(tmp_path))
    monkeypatch.setattr(attention, "_one_row_form", {})
    monkeypatch.setattr(attention, "_probe_one_row", lambda *a: calls.append(a) or ROWS)
    q, k = torch.randn(1, 4, 1, 8), torch.randn(1, 2, 5, 8)
    for _ in range(3):
        grouped_attention(q, k, k, None)
    grouped_attention(torch.randn(1, 6, 1, 8), k, k, None)  # 3 groups: another shape, another probe
    assert len(calls) == 2
    assert attention._one_row_form[("cpu", torch.float32, 2, 2, 8, torch.get_num_threads())] == ROWS
    files = sorted((tmp_path / "attention").glob("*.json"))
    assert len(files) == 2
    monkeypatch.setattr(attention, "_one_row_form", {})  # a new process: the verdicts come from the files
    monkeypatch.setattr(attention, "_probe_one_row", lambda *a: calls.append(a) or GQA)
    grouped_attention(q, k, k, None)
    assert len(calls) == 2 and attention.one_row_form(q.device, q.dtype, 2, 2, 8) == ROWS
    for f in files:
        f.write_text("{")
    monkeypatch.setattr(attention, "_one_row_form", {})
    assert attention.one_row_form(q.device, q.dtype, 2, 2, 8) == GQA and len(calls) == 3


def test_the_probe_returns_a_form():
    assert attention._probe_one_row(torch.device("cpu"), torch.float32, 2, 3, 8) in (GQA, ROWS)


@pytest.mark.parametrize("form", [GQA, ROWS])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_target_on_grouped_attention_gives_the_stock_logits(force_form, family, form):
    """Prefill (causal, no mask), one-token steps (no mask) and a masked multi-token forward, float64."""
    force_form(form)
    ours, stock = tiny_target(family), tiny_target(family, stock=True)
    assert uses_grouped_attention(ours.model) and not uses_grouped_attention(stock.model)
    ids = prompts()[0]
    caches = ours.new_cache(), stock.new_cache()
    for t in (ours, stock):
        assert t.model.config._attn_implementation in ("sdpa", attention.IMPLEMENTATION)
    outs = [t.forward(ids[:6], torch.arange(6), c) for t, c in zip((ours, stock), caches)]
    torch.testing.assert_close(outs[0].logits, outs[1].logits, rtol=1e-10, atol=1e-10)
    for pos in (6, 7):
        outs = [t.forward(ids[pos:pos + 1], torch.tensor([pos]), c) for t, c in zip((ours, stock), caches)]
        torch.testing.assert_close(outs[0].logits, outs[1].logits, rtol=1e-10, atol=1e-10)
    mask = torch.zeros(1, 1, 2, 10, dtype=torch.float64)
    mask[0, 0, 0, 9] = float("-inf")  # a 2-node tree: siblings, each sees the past and itself only
    mask[0, 0, 1, 8] = float("-inf")
    outs = [t.forward(ids[8:10], torch.tensor([8, 8]), c, attention_mask=mask) for t, c in zip((ours, stock), caches)]
    torch.testing.assert_close(outs[0].logits, outs[1].logits, rtol=1e-10, atol=1e-10)


def test_only_sdpa_models_are_switched():
    eager = tiny_target(stock=True)
    eager.model.set_attn_implementation("eager")
    assert not use_grouped_attention(eager.model) and eager.model.config._attn_implementation == "eager"
    assert use_grouped_attention(tiny_target(stock=True).model)


def test_stock_twin_reloads_a_target_on_grouped_attention(tmp_path):
    from anchorspec.models.target import load_target, stock_twin
    from helpers import save_tiny_chat_target

    path = save_tiny_chat_target(tmp_path / "t", dtype=torch.float32)
    ours = load_target(str(path), "float32", pack="off")
    assert uses_grouped_attention(ours.model)
    twin = stock_twin(ours, str(path), torch.float32)
    assert twin is not ours and not uses_grouped_attention(twin.model)
    assert stock_twin(twin, str(path), torch.float32) is twin


@pytest.mark.parametrize("rows", [1, 4])
def test_masks_per_head_and_causal_prefills_are_left_to_transformers(force_form, rows):
    """A mask that differs per head, and a multi-row forward without a mask (a prefill: causal), take
    transformers' own SDPA function; both still give multi-head attention with repeated keys."""
    force_form(ROWS)
    use_grouped_attention(tiny_target(stock=True).model)  # registers hf_attention, binding transformers' function
    torch.manual_seed(1)
    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal = 3, True
    q = torch.randn(1, 6, rows, 8, dtype=torch.float64)
    k, v = torch.randn(1, 2, rows, 8, dtype=torch.float64), torch.randn(1, 2, rows, 8, dtype=torch.float64)
    per_head = torch.zeros(1, 6, rows, rows, dtype=torch.float64)
    per_head[:, ::2, :, 0] = float("-inf") if rows > 1 else 0.0  # even heads never see key 0 (but row 0 its own)
    per_head[:, ::2, 0, 0] = 0.0
    out, _ = attention.hf_attention(module, q, k, v, per_head, scaling=None)
    torch.testing.assert_close(out, reference(q, k, v, per_head).transpose(1, 2), rtol=1e-12, atol=1e-12)
    if rows > 1:
        out, _ = attention.hf_attention(module, q, k, v, None, scaling=None)
        torch.testing.assert_close(out, reference(q, k, v, None, is_causal=True).transpose(1, 2), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("form", [GQA, ROWS])
def test_an_exported_graph_takes_the_form_it_is_traced_in(form):
    """A step graph has one body for every T: traced with T symbolic (torch.export, as models/compiled.py
    does) inside traced_in(form), grouped attention takes that form at every row count (group-as-rows repeats the
    mask per group; enable_gqa is one SDPA call with the flag) and still computes multi-head attention with
    repeated keys at 1, 2, 5 and FEW_ROWS + 1 rows, masked (float64). Group-as-rows' reshapes once put an unprovable
    guard on T into the export, which failed."""
    from torch.export import Dim, export

    class Attend(torch.nn.Module):
        def forward(self, q, k, v, mask):
            return grouped_attention(q.transpose(1, 2), k, v, mask)  # a projection's [B, T, H, D], as in a layer

    rows, keys = Dim("rows", min=1, max=64), Dim("keys", min=2, max=256)
    torch.manual_seed(2)
    k, v = torch.randn(1, 2, 11, 8, dtype=torch.float64), torch.randn(1, 2, 11, 8, dtype=torch.float64)
    example = (torch.randn(1, 3, 6, 8, dtype=torch.float64), k, v, torch.zeros(1, 1, 3, 11, dtype=torch.float64))
    with attention.traced_in(form):
        program = export(Attend(), example, dynamic_shapes=({1: rows}, {2: keys}, {2: keys}, {2: rows, 3: keys}),
                         strict=False)
    calls = [n for n in program.graph.nodes if "scaled_dot_product" in str(n.target)]
    assert len(calls) == 1 and bool(calls[0].kwargs.get("enable_gqa")) == (form == GQA)
    graph = program.module()
    for t in (1, 2, 5, attention.FEW_ROWS + 1):
        q = torch.randn(1, t, 6, 8, dtype=torch.float64)
        mask = torch.zeros(1, 1, t, 11, dtype=torch.float64)
        mask[:, :, 0, -1] = float("-inf")
        torch.testing.assert_close(graph(q, k, v, mask), reference(q.transpose(1, 2), k, v, mask),
                                   rtol=1e-12, atol=1e-12)


def test_graph_forms_are_the_two_verdicts_on_a_cpu(force_form, monkeypatch):
    force_form(GQA, ROWS)
    monkeypatch.setenv("ANCHORSPEC_FEW_ROWS_GRAPH", "off")  # one graph per model: the one-row form throughout
    assert attention.graph_forms(torch.device("cpu"), torch.float64, 2, 3, 8, batched=True) == (GQA, GQA)
    monkeypatch.setenv("ANCHORSPEC_FEW_ROWS_GRAPH", "on")
    assert attention.graph_forms(torch.device("cpu"), torch.float64, 2, 3, 8, batched=True) == (GQA, ROWS)
    assert attention.graph_forms(torch.device("cpu"), torch.float64, 2, 3, 8) == (GQA, GQA)  # one stream: one graph
    assert attention.graph_forms(torch.device("cpu"), torch.float64, 2, 1, 8, batched=True) == (GQA, GQA)  # no groups


def test_eager_calls_take_the_form_of_their_row_count(force_form, monkeypatch):
    """One row: the one-row verdict; 2..FEW_ROWS rows: the few-row verdict; more: enable_gqa (session 87: group-as-rows
    lost at prefill lengths on the AMX Xeon in bf16)."""
    force_form(GQA, ROWS)
    grouped, group_rows = [], attention._group_rows
    monkeypatch.setattr(attention, "_group_rows", lambda *a: grouped.append(a[0].shape[2]) or group_rows(*a))
    k = torch.randn(1, 2, 30, 8, dtype=torch.float64)
    for t in (1, 2, attention.FEW_ROWS, attention.FEW_ROWS + 1):
        q, mask = torch.randn(1, 6, t, 8, dtype=torch.float64), torch.zeros(1, 1, t, 30, dtype=torch.float64)
        torch.testing.assert_close(grouped_attention(q, k, k, mask), reference(q, k, k, mask), rtol=1e-12, atol=1e-12)
    assert grouped == [2, attention.FEW_ROWS]
