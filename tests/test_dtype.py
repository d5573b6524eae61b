"""`--dtype auto`: the decision, its per-machine cache, and that every command defaults to it (stubbed probe)."""

from __future__ import annotations

import json

import pytest
import torch

from anchorspec.errors import AnchorspecError
from anchorspec.models import dtype as dt


def stub_probe(fp32_s: float, bf16_s: float, calls: list, packed_s: float | None = None,
               packed32_s: float | None = None):
    def probe(hidden, intermediate):
        calls.append((hidden, intermediate, torch.get_num_threads()))
        out = {"float32": {"1": fp32_s, "16": 2 * fp32_s}, "bfloat16": {"1": bf16_s, "16": 2 * bf16_s}}
        if packed_s is not None:
            out["bfloat16_packed"] = {"1": packed_s, "16": 2 * packed_s}
        if packed32_s is not None:
            out["float32_packed"] = {"1": packed32_s, "16": 2 * packed32_s}
        return out
    return probe


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("ANCHORSPEC_HOME", str(tmp_path))
    monkeypatch.setattr(dt, "_announced", set())
    return tmp_path


def test_faster_bf16_is_chosen(home):
    calls = []
    assert dt.resolve_dtype("auto", "cpu", (64, 128), stub_probe(1.0, 0.5, calls)) == torch.bfloat16
    assert calls == [(64, 128, torch.get_num_threads())]


def test_slower_or_tied_bf16_gives_float32(home):
    assert dt.resolve_dtype("auto", "cpu", (64, 128), stub_probe(1.0, 20.0, [])) == torch.float32
    # within the margin: not worth bf16's rounding
    assert dt.resolve_dtype("auto", "cpu", (64, 256), stub_probe(1.0, 0.95, [])) == torch.float32


def test_cuda_is_bf16_without_probing(home):
    calls = []
    assert dt.resolve_dtype("auto", "cuda", (64, 128), stub_probe(1.0, 20.0, calls)) == torch.bfloat16
    assert dt.resolve_dtype("auto", "cuda:1", None, stub_probe(1.0, 20.0, calls)) == torch.bfloat16
    assert calls == []


def test_explicit_dtype_never_probes(home):
    calls = []
    for name, want in (("float32", torch.float32), ("bfloat16", torch.bfloat16), ("float64", torch.float64)):
        assert dt.resolve_dtype(name, "cpu", (64, 128), stub_probe(1.0, 0.1, calls)) == want
    assert calls == []
    with pytest.raises(AnchorspecError, match="unknown dtype 'fp16'"):
        dt.resolve_dtype("fp16")


def test_cache_hit_does_not_probe_again(home):
    calls = []
    assert dt.resolve_dtype("auto", "cpu", (64, 128), stub_probe(1.0, 0.5, calls)) == torch.bfloat16
    # a second probe would now say fp32: the cached verdict must win, and the probe must not run
    assert dt.resolve_dtype("auto", "cpu", (64, 128), stub_probe(1.0, 20.0, calls)) == torch.bfloat16
    assert len(calls) == 1
    files = list((home / "dtype").glob("*.json"))
    assert len(files) == 1 and json.loads(files[0].read_text())["choice"] == "bfloat16"


def test_cache_key_changes_with_threads_and_shapes(home):
    calls = []
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert dt.resolve_dtype("auto", "cpu", (64, 128), stub_probe(1.0, 0.5, calls)) == torch.bfloat16
        torch.set_num_threads(2)
        assert dt.resolve_dtype("auto", "cpu", (64, 128), stub_probe(1.0, 20.0, calls)) == torch.float32
    finally:
        torch.set_num_threads(old)
    assert [c[2] for c in calls] == [1, 2]
    dt.resolve_dtype("auto", "cpu", (32, 128), stub_probe(1.0, 0.5, calls))
    assert len(calls) == 3 and len(list((home / "dtype").glob("*.json"))) == 3


def test_damaged_cache_is_measured_again(home):
    calls = []
    dt.resolve_dtype("auto", "cpu", (64, 128), stub_probe(1.0, 0.5, calls))
    (cache,) = (home / "dtype").glob("*.json")
    cache.write_text("{not json")
    assert dt.resolve_dtype("auto", "cpu", (64, 128), stub_probe(1.0, 20.0, calls)) == torch.float32
    assert len(calls) == 2


def test_choice_is_announced_once(home, capsys):
    for _ in range(3):
        dt.resolve_dtype("auto", "cpu", (64, 128), stub_probe(1.0, 0.5, []))
    err = capsys.readouterr().err
    assert err.count("--dtype auto chose bfloat16") == 1, err
    assert "threads" in err or "thread;" in err


def test_real_probe_is_short_and_complete(one_thread):
    seconds = dt.probe_gemms(64, 256)
    packable = {f"{name}_packed" for name in ("float32", "bfloat16") if dt.packing_supported(dt.DTYPES[name], "cpu")}
    assert set(seconds) == {"float32", "bfloat16"} | packable
    assert all(set(v) == {"1", "2", "16"} and all(t > 0 for t in v.values()) for v in seconds.values())


def test_a_cpu_that_cannot_pack_bf16_is_probed_without_it(home, monkeypatch):
    """oneDNN's bf16 reorder raises on a CPU without avx512bw/vl/dq or avx_ne_convert (an AVX2-only
    Zen3: `--dtype auto` crashed there). packing_supported must say no, the probe must time the rest,
    and `--dtype auto` must still choose."""
    from anchorspec.models import packed

    real = torch.ops.mkldnn._reorder_linear_weight

    class Ops:  # torch.ops.mkldnn as such a CPU has it: bf16 refused, fp32 packed as usual
        @staticmethod
        def _reorder_linear_weight(weight, rows):
            if weight.dtype == torch.bfloat16:
                raise RuntimeError("mkldnn_reorder_linear_weight: bf16 path needs the cpu support avx_ne_convert "
                                   "or avx512bw, avx512vl and avx512dq")
            return real(weight, rows)

        _linear_pointwise = torch.ops.mkldnn._linear_pointwise

    monkeypatch.setattr(packed.torch.ops, "mkldnn", Ops)
    packed._cpu_packs.cache_clear()
    try:
        assert not dt.packing_supported(torch.bfloat16, "cpu")
        assert dt.packing_supported(torch.float32, "cpu")
        seconds = dt.probe_gemms(64, 256)
        assert set(seconds) == {"float32", "bfloat16", "float32_packed"}
        assert dt.resolve_dtype("auto", "cpu", (64, 256)) in (torch.float32, torch.bfloat16)
        assert dt.resolve_packing("on", torch.bfloat16, "cpu", (64, 256)) is False
    finally:
        packed._cpu_packs.cache_clear()
    assert dt.packing_supported(torch.float32, "cpu")


def test_packing_supported_says_what_packing_does_here():
    """No dtype is called packable that fails to pack on this CPU, and none refused that packs."""
    from anchorspec.models.packed import pack_weight, packed_linear

    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        try:
            packed_linear(torch.ones(2, 16, dtype=dtype), pack_weight(torch.ones(8, 16, dtype=dtype)), None, 8)
            works = True
        except RuntimeError:
            works = False
        assert dt.packing_supported(dtype, "cpu") is works, dtype


def test_concurrent_probes_settle_on_the_first_verdict(home):
    """Two processes (DDP ranks) probing at once must compute in the same dtype: the first verdict written wins."""
    def probe_while_another_process_writes(hidden, intermediate):
        other = {"key": dt._probe_key(hidden, intermediate), "choice": "float32",
                 "bf16_speedup": 0.5, "pack_bf16": False, "pack_fp32": False, "seconds": {}}
        path = dt.probe_cache_path(other["key"])
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(other))
        return {"float32": {"1": 1.0}, "bfloat16": {"1": 0.1}}  # this process alone would pick bf16

    assert dt.resolve_dtype("auto", "cpu", (64, 128), probe_while_another_process_writes) == torch.float32


def test_argmax_last_equals_argmax_with_ties_in_half_precision():
    from anchorspec.models.dtype import argmax_last

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 300, 517, generator=gen).bfloat16()
    x[0, 5, 10] = x[0, 5, 400] = 9.0  # a tie: the first index wins, as in torch.argmax
    for t in (x, x.half(), x.float(), x[0, 0]):
        for chunk_elements in (1, 64 * 517, 100 * 517 + 3, 1 << 30):  # one row, whole and ragged chunks, one chunk
            assert torch.equal(argmax_last(t, chunk_elements=chunk_elements), t.argmax(-1))
    assert argmax_last(x)[0, 5] == 10


# --- prepacked weights (models/packed.py): the decision rides on the same cached probe -------------

needs_onednn = pytest.mark.skipif(not dt.packing_supported(torch.bfloat16, "cpu"), reason="no oneDNN bf16 packing")


@needs_onednn
@pytest.mark.parametrize("packed_s, want", [(0.3, True), (0.49, False), (None, False)])
def test_packing_follows_the_probe(home, monkeypatch, packed_s, want):
    monkeypatch.delenv("ANCHORSPEC_PACK", raising=False)
    probe = stub_probe(1.0, 0.5, [], packed_s)
    assert dt.resolve_packing(None, torch.bfloat16, "cpu", (64, 128), probe) is want
    assert dt.resolve_packing("auto", torch.float32, "cpu", (64, 128), probe) is False  # fp32 packing not measured
    assert dt.resolve_packing("off", torch.bfloat16, "cpu", (64, 128), probe) is False
    assert dt.resolve_packing("on", torch.bfloat16, "cpu", (64, 128), probe) is True


@needs_onednn
def test_packed_speed_can_tip_auto_to_bf16(home):
    """Plain bf16 loses to fp32 (0.95 of its time: within the margin), packed bf16 clearly wins."""
    assert dt.resolve_dtype("auto", "cpu", (64, 128), stub_probe(1.0, 0.95, [])) == torch.float32
    assert dt.resolve_dtype("auto", "cpu", (64, 256), stub_probe(1.0, 0.95, [], 0.6)) == torch.bfloat16


@needs_onednn
def test_auto_dtype_ignores_packing_that_is_turned_off(home, monkeypatch):
    """Packed bf16 tips the verdict to bf16; with packing off the target runs plain bf16, which loses."""
    probe = stub_probe(1.0, 0.95, [], 0.6)
    monkeypatch.delenv("ANCHORSPEC_PACK", raising=False)
    assert dt.resolve_dtype("auto", "cpu", (64, 256), probe) == torch.bfloat16
    assert dt.resolve_dtype("auto", "cpu", (64, 256), probe, pack="off") == torch.float32
    monkeypatch.setenv("ANCHORSPEC_PACK", "off")
    assert dt.resolve_dtype("auto", "cpu", (64, 256), probe) == torch.float32
    assert dt.resolve_dtype("auto", "cpu", (64, 256), probe, pack="auto") == torch.bfloat16


def test_packing_never_on_cuda_or_fp64_and_env_is_checked(home, monkeypatch):
    calls = []
    assert dt.resolve_packing("on", torch.float64, "cpu", (64, 128), stub_probe(1.0, 0.5, calls, 0.1)) is False
    assert dt.resolve_packing("on", torch.bfloat16, "cuda", (64, 128), stub_probe(1.0, 0.5, calls, 0.1)) is False
    assert calls == []
    monkeypatch.setenv("ANCHORSPEC_PACK", "sometimes")
    with pytest.raises(AnchorspecError, match="ANCHORSPEC_PACK"):
        dt.resolve_packing(None, torch.bfloat16, "cpu", (64, 128), stub_probe(1.0, 0.5, calls, 0.1))


@needs_onednn
@pytest.mark.parametrize("packed32_s, pack32, choice", [(0.5, True, torch.float32), (0.97, False, torch.bfloat16)])
def test_float32_packing_follows_its_own_probe(home, monkeypatch, packed32_s, pack32, choice):
    """fp32 weights are packed where packed fp32 clearly beats plain fp32 (0.95); bf16 (packed: 0.6 of
    plain fp32's time) must then clearly beat the better fp32 form (0.9)."""
    monkeypatch.delenv("ANCHORSPEC_PACK", raising=False)
    probe = stub_probe(1.0, 0.7, [], packed_s=0.6, packed32_s=packed32_s)
    assert dt.resolve_packing(None, torch.float32, "cpu", (64, 128), probe) is pack32
    assert dt.resolve_packing(None, torch.bfloat16, "cpu", (64, 128), probe) is True
    assert dt.resolve_dtype("auto", "cpu", (64, 128), probe) == choice
    assert dt.resolve_dtype("auto", "cpu", (64, 256), probe, pack="off") == torch.bfloat16  # plain 0.7 vs 1.0
