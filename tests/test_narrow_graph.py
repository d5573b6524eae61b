"""The narrow-step graph (models/compiled.py): on a CPU, in float32/bf16/fp16, an AOT step has a twin compiled
with inductor's C++ GEMM template, which serves the steps of at most a measured number of new rows; the oneDNN
graph serves the rest. Decoding through the pair stays lossless (chains, trees, plain steps, batched rounds),
each graph serves the steps it should, and the crossover is measured once, cached, and read back."""

import json

import pytest
import torch

import anchorspec.models.compiled as compiled_module
from anchorspec.decode.engine import (GenerationConfig, PlainDecoding, SpeculativeDecoding, generate_speculative,
                                       generate_vanilla)
from anchorspec.decode.propose import EagleProposer
from anchorspec.decode.round import BatchDecoder
from anchorspec.decode.tree import TreeShape
from anchorspec.models.compiled import NarrowWide, narrow_key, narrow_up_to
from batch_world import run_batched
from helpers import prompts, random_drafter, tiny_target

UP_TO = 3  # the crossover the pair below is given: steps of 1-3 new rows narrow, 4 and more wide


@pytest.fixture(scope="module")
def narrow_pair():
    """A float32 tiny target whose step graph is a NarrowWide pair (crossover fixed at UP_TO), each graph's calls
    recorded as the number of new rows it was given."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ANCHORSPEC_NARROW_GRAPH", "on")
        mp.setattr(compiled_module, "narrow_up_to", lambda *args, **kwargs: UP_TO)
        mp.setattr(compiled_module, "read_narrow_verdict", lambda key: None)
        target = tiny_target("llama", dtype=torch.float32)
        target.compile()
        pair = target.load_graph()
    assert isinstance(pair, NarrowWide) and pair.up_to == UP_TO
    calls = {"narrow": [], "wide": []}
    for name in calls:
        graph = getattr(pair, name)
        setattr(pair, name, lambda args, *rest, graph=graph, name=name: calls[name].append(args[0].numel())
                or graph(args, *rest))
    return target, calls


def test_narrow_and_wide_graphs_decode_as_the_eager_target(narrow_pair):
    """Plain steps and 3-token chain verifies take the narrow graph, trees of 6 the wide one; the tokens are the
    eager float32 target's (the tiny target's logits are peaked, so float32 rounding flips no greedy choice), solo
    and in batched rounds (their rows x tokens decide)."""
    target, calls = narrow_pair
    eager = tiny_target("llama", dtype=torch.float32)
    drafter = random_drafter(target)  # float64, reading the float32 target's features
    cfg = GenerationConfig(max_new_tokens=16)
    for prompt in prompts():
        ref = generate_vanilla(eager, prompt, cfg).token_ids
        assert generate_vanilla(target, prompt, cfg).token_ids == ref
        for shape in (TreeShape.chain(2), TreeShape(2, 3, 6)):
            assert generate_speculative(target, EagleProposer(drafter), prompt, cfg, shape).token_ids == ref, shape
    assert set(calls["narrow"]) >= {1, 3} and max(calls["narrow"]) <= UP_TO
    assert min(calls["wide"]) > UP_TO and 6 in calls["wide"]
    calls["narrow"].clear(), calls["wide"].clear()
    decs, refs = [], []  # a 1-token chain beside two plain streams: rows of width 2 (wide), then two plain rows
    for n, prompt, proposer in zip((4, 12, 10), prompts(3), (EagleProposer(drafter), None, None)):
        cfg = GenerationConfig(max_new_tokens=n)
        refs.append(generate_vanilla(eager, prompt, cfg).token_ids)
        decs.append(PlainDecoding(target, prompt, cfg) if proposer is None
                    else SpeculativeDecoding(target, proposer, prompt, cfg, TreeShape.chain(1)))
    assert [r.token_ids for r in run_batched(BatchDecoder(target), decs, start=3)] == refs
    assert 2 in calls["narrow"] and 6 in calls["wide"]


def test_short_prompts_are_prefilled_through_the_graph(narrow_pair, monkeypatch):
    """An AOT-compiled target prefills a prompt of 2..GRAPH_PREFILL_TOKENS tokens through its step graph (one call of
    the prompt's length), a longer one eagerly (no graph call of that length); the tokens are the eager target's
    either way, plain and speculative, solo and in a batched round (each prefill alone in its slot, the second one in
    slot 1: the graph is given that slot's rows as a one-slot cache)."""
    import anchorspec.decode.batch as batch_module

    target, calls = narrow_pair
    eager = tiny_target("llama", dtype=torch.float32)
    drafter = random_drafter(target)
    cfg = GenerationConfig(max_new_tokens=6)
    short, long = prompts(1, length=10)[0], prompts(2, length=14, seed=3)[0]
    monkeypatch.setattr(batch_module, "GRAPH_PREFILL_TOKENS", 12)
    for prompt in (short, long):
        calls["narrow"].clear(), calls["wide"].clear()
        ref = generate_vanilla(eager, prompt, cfg).token_ids
        assert generate_vanilla(target, prompt, cfg).token_ids == ref
        assert generate_speculative(target, EagleProposer(drafter), prompt, cfg, TreeShape.chain(2)).token_ids == ref
        prefilled = calls["wide"].count(prompt.numel())
        assert prefilled == (2 if prompt.numel() <= 12 else 0), (prompt.numel(), calls["wide"])
    calls["wide"].clear()
    refs = [generate_vanilla(eager, p, cfg).token_ids for p in (short, long[:8])]
    assert [r.token_ids for r in run_batched(BatchDecoder(target), [PlainDecoding(target, p, cfg)
                                                                     for p in (short, long[:8])], start=2)] == refs
    assert {10, 8} <= set(calls["wide"]), calls["wide"]  # slot 0's prefill and slot 1's (the graph sees its rows)


def _sleeper(ms_at):
    import time

    def graph(args, *rest):
        time.sleep(ms_at(args[0].numel()) / 1e3)

    return graph


def _rows(n):  # the inputs narrow_up_to times a graph on: only the first tensor's size matters here
    return ((torch.zeros(1, n, dtype=torch.long),), None, None, None, None, None)


def test_the_crossover_is_measured_once_and_kept(tmp_path, monkeypatch, capsys):
    """narrow_up_to: the largest size at which, and at every smaller one, the narrow graph was faster; cached per
    key (a second call times nothing; a damaged file is measured again); a narrow graph slower at one row never
    serves."""
    monkeypatch.setenv("ANCHORSPEC_HOME", str(tmp_path))
    wide = _sleeper(lambda n: 2.0)
    narrow = _sleeper(lambda n: 0.3 if n <= 4 else 4.0)
    key = {"graph": "test", "verdict": 1}
    assert narrow_up_to(narrow, wide, _rows, key, sizes=(1, 2, 4, 8), repeats=1) == 4
    assert "steps of up to 4 new rows take the narrow-step graph" in capsys.readouterr().err
    assert compiled_module.read_narrow_verdict(key) == 4

    def untimed(*args):
        raise AssertionError("a cached crossover was measured again")

    assert narrow_up_to(untimed, untimed, _rows, key, sizes=(1, 2, 4, 8), repeats=1) == 4
    (cached,) = (tmp_path / "gemm").iterdir()
    cached.write_text("{not json")
    assert compiled_module.read_narrow_verdict(key) is None
    slow_at_one = _sleeper(lambda n: 4.0 if n == 1 else 0.3)  # faster at 2+, not at 1: never narrow
    assert narrow_up_to(slow_at_one, wide, _rows, key, sizes=(1, 2, 4), repeats=1) == 0
    assert json.loads(cached.read_text())["up_to"] == 0


def test_the_crossover_is_timed_at_every_default_tree_size():
    """The timing reaches the largest tree the shape chooser may pick (decode/shape.py: CANDIDATES), so that a machine
    whose template wins at every size (with AMX it did, up to 64 rows) gives it trees too, not only chains."""
    from anchorspec.decode.shape import CANDIDATES

    largest = max(shape.total_tokens for shape in CANDIDATES)
    assert max(compiled_module.NARROW_SIZES) >= largest, (compiled_module.NARROW_SIZES, largest)
    assert list(compiled_module.NARROW_SIZES) == sorted(set(compiled_module.NARROW_SIZES))


def _count_builds(monkeypatch, fail_cpp: bool = False):
    """aot_compile wrapped: records the GEMM kind of every graph built or loaded; `fail_cpp`: the template's raises."""
    builds, real = [], compiled_module.aot_compile

    def counting(*args, gemm="onednn", **kwargs):
        builds.append(gemm)
        if fail_cpp and gemm == "cpp":
            raise RuntimeError("no C++ GEMM template here")
        return real(*args, gemm=gemm, **kwargs)

    monkeypatch.setattr(compiled_module, "aot_compile", counting)
    return builds


def test_no_twin_where_it_does_not_apply_or_never_won(narrow_pair, monkeypatch, capsys):
    """float64 (no C++ template kernels), ANCHORSPEC_NARROW_GRAPH=off, and a machine whose cached crossover is 0 get
    the one graph and never build the twin; a twin that fails to compile costs one line, and the one graph serves
    every step with the same tokens."""
    builds = _count_builds(monkeypatch)
    for dtype, setting, verdict in ((torch.float64, "on", None), (torch.float32, "off", None),
                                    (torch.float32, "on", 0)):
        monkeypatch.setenv("ANCHORSPEC_NARROW_GRAPH", setting)
        monkeypatch.setattr(compiled_module, "read_narrow_verdict", lambda key, verdict=verdict: verdict)
        target = tiny_target("llama", dtype=dtype)
        target.compile()
        assert not isinstance(target.load_graph(), NarrowWide), (dtype, setting, verdict)
    assert builds == ["onednn"] * 3
    monkeypatch.setenv("ANCHORSPEC_NARROW_GRAPH", "on")
    monkeypatch.setattr(compiled_module, "read_narrow_verdict", lambda key: None)
    builds = _count_builds(monkeypatch, fail_cpp=True)
    target = tiny_target("llama", dtype=torch.float32)
    target.compile()
    cfg = GenerationConfig(max_new_tokens=8)
    assert generate_vanilla(target, prompts()[0], cfg).token_ids == \
        generate_vanilla(tiny_target("llama", dtype=torch.float32), prompts()[0], cfg).token_ids
    assert builds == ["onednn", "cpp"] and not isinstance(target.load_graph(), NarrowWide)
    assert "for narrow steps could not be compiled (RuntimeError: no C++ GEMM template here)" in capsys.readouterr().err


def test_the_twin_is_a_file_of_its_own(narrow_pair):
    """The twin's graph file is named after the wide one's key plus the GEMM kind and the thread count: another file,
    the same fields."""
    target, _ = narrow_pair
    path, text = target._graph_key()
    twin, twin_text = narrow_key((path, text))
    assert twin != path and twin.is_file() and path.is_file() and twin.name.startswith("target-")
    assert json.loads(twin_text) == {**json.loads(text), "gemm": "cpp", "threads": torch.get_num_threads()}


def test_the_twin_is_compiled_per_thread_count(narrow_pair):
    """The C++ template splits each product into as many parts as there were threads at its compile (a constant in
    its code: on a 2-core AVX2 EPYC a twin compiled for 1 thread ran its steps on one core of two), so each thread
    count has a twin of its own; the wide graph's key (oneDNN's kernels take the thread count at run time) has none."""
    target, _ = narrow_pair
    key = target._graph_key()
    threads = torch.get_num_threads()
    twins = {}
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            twins[n] = narrow_key(key)
    finally:
        torch.set_num_threads(threads)
    assert twins[1][0] != twins[2][0] and twins[1][0].name.startswith("target-")
    assert [json.loads(twins[n][1])["threads"] for n in (1, 2)] == [1, 2] and "threads" not in json.loads(key[1])
