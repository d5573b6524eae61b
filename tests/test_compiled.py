"""Target.compile(): decode and verify steps through an inductor graph with frozen weights (on a CPU
compiled ahead of time, one graph file per model and machine; torch.compile with aot=False, CUDA's
path) stay lossless: greedy speculative output on the compiled target == plain greedy on the eager one,
in float64, chains and trees, and the compiled graph really ran (one graph, or a few shapes, no
recompiling per step)."""

import pytest
import torch

from anchorspec.decode.engine import GenerationConfig, generate_speculative, generate_vanilla
from anchorspec.decode.propose import EagleProposer
from anchorspec.decode.tree import TreeShape
from helpers import prompts, random_drafter, tiny_target


@pytest.fixture(scope="module")
def compiled_llama():
    torch._dynamo.reset()
    target = tiny_target("llama")
    target.compile()
    assert target.aot  # a CPU's default
    calls, graph = [], target.load_graph

    def spy():
        run = graph()
        return lambda args, *rest: calls.append(args[0].shape) or run(args, *rest)

    target.load_graph = spy
    yield target, calls
    torch._dynamo.reset()


def assert_lossless(target, eager):
    """Greedy plain and speculative output (a random drafter's chain and tree) on `target` == plain greedy on `eager`."""
    proposer = EagleProposer(random_drafter(target))
    cfg = GenerationConfig(max_new_tokens=16)
    for prompt in prompts():
        ref = generate_vanilla(eager, prompt, cfg).token_ids
        assert generate_vanilla(target, prompt, cfg).token_ids == ref
        for shape in (TreeShape.chain(4), TreeShape(2, 3, 6)):
            assert generate_speculative(target, proposer, prompt, cfg, shape).token_ids == ref, shape


def test_compiled_target_decodes_losslessly(compiled_llama):
    target, calls = compiled_llama
    eager = tiny_target("llama")  # same seed: the same weights, never compiled
    assert_lossless(target, eager)
    assert {tuple(s) for s in calls} >= {(1, 1), (1, 5), (1, 6)}  # plain steps, chain and tree verifies
    assert target.compiles == 1  # one graph for all of them


def test_compile_fuses_sibling_projections_into_stock_products(compiled_llama):
    """Inductor calls each linear layer on its own: compile() first makes q/k/v and gate/up one product
    each, with stock weights (its frozen graph prepacks them; a packed target cannot be compiled)."""
    from anchorspec.models.packed import FusedSibling, is_packed

    target, _ = compiled_llama
    attn, mlp = target.layers[0].self_attn, target.layers[0].mlp
    assert attn.q_proj.product is attn.v_proj.product and mlp.gate_proj.product is mlp.up_proj.product
    fused = [m for m in target.model.modules() if isinstance(m, FusedSibling)]
    assert len(fused) == 5 * target.num_layers and not any(m.product.pack for m in fused)
    assert not is_packed(target.model)
    unfused = tiny_target("llama")
    unfused.compile(fuse=False)
    assert not any(isinstance(m, FusedSibling) for m in unfused.model.modules())


def test_compiled_target_in_batched_rounds_stays_lossless(compiled_llama):
    """A BatchDecoder round over slots 0..B-1 runs the compiled static forward with B > 1 (how
    `serve` and `regenerate` would run a compiled target): three sequences (an oracle chain, a random
    drafter's tree, plain decoding) joining and finishing at different rounds decode exactly as
    plain greedy on the eager target."""
    from anchorspec.decode.engine import PlainDecoding, SpeculativeDecoding
    from anchorspec.decode.round import BatchDecoder
    from helpers import OracleProposer
    from test_batch import run_batched

    target, calls = compiled_llama
    eager = tiny_target("llama")
    drafter = random_drafter(target)
    attach = [(OracleProposer(target), TreeShape.chain(4), 12), (EagleProposer(drafter), TreeShape(2, 3, 6), 8),
              (None, None, 6)]
    decs, refs = [], []
    for (proposer, shape, n), prompt in zip(attach, prompts(3)):
        cfg = GenerationConfig(max_new_tokens=n)
        refs.append(generate_vanilla(eager, prompt, cfg).token_ids)
        decs.append(PlainDecoding(target, prompt, cfg) if proposer is None
                    else SpeculativeDecoding(target, proposer, prompt, cfg, shape))
    results = run_batched(BatchDecoder(target), decs, start=3)
    assert [r.token_ids for r in results] == refs
    assert max(shape[0] for shape in calls) == 3  # the compiled graph ran with all three rows


def test_compiled_steps_do_not_recompile_as_the_cache_grows():
    """A new prompt length means a new slot capacity: the buffers' slot and capacity dimensions are
    dynamic from the first trace, so the second prompt reuses the first one's graph (before they
    were, this recompiled once per new capacity until dynamo made them dynamic itself)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    target = tiny_target("llama")
    target.compile(aot=False)  # torch.compile's graphs (an AOT graph has every size dynamic by construction)
    cfg = GenerationConfig(max_new_tokens=40)
    generate_vanilla(target, prompts()[0], cfg)  # warm: the plain step's graph exists
    graphs = counters["stats"]["unique_graphs"]
    generate_vanilla(target, torch.arange(3, 26), cfg)  # another prompt length, 40 more key lengths
    assert counters["stats"]["unique_graphs"] == graphs > 0
    torch._dynamo.reset()


def test_a_pass_that_fills_the_cache_exactly_adds_no_graph(monkeypatch):
    """A static forward slices the buffers to the mask's key length, and dynamo guards on whether that
    slice is the whole buffer (contiguous). A step whose keys filled the buffer exactly compiled a graph
    of its own mid-generation (seen as a drafter graph compiled while a benchmark was timed). With no
    slack, a solo slot holds prompt + budget - 1 rows, which the last plain step fills; a drafter cache
    of 16 rows doubles through 16 and 32 while a chain drafts 48 tokens. Each must still need one
    graph per shape family."""
    import anchorspec.decode.engine as engine_module
    from anchorspec.decode import propose

    monkeypatch.setattr(engine_module, "SLOT_SLACK", 0)
    monkeypatch.setattr(propose, "OWN_CAPACITY", 16)
    torch._dynamo.reset()
    target = tiny_target("llama")
    target.compile(aot=False)
    prompt = prompts()[0]
    ref = generate_vanilla(target, prompt, GenerationConfig(max_new_tokens=16))
    assert target.compiles == 1  # the plain step (prefills stay eager)
    drafter = random_drafter(target)
    drafter.compile()
    seen = _spy_rows(drafter)
    cfg = GenerationConfig(max_new_tokens=48)
    assert generate_speculative(target, EagleProposer(drafter), prompt, cfg, TreeShape.chain(3)).token_ids == \
        generate_vanilla(target, prompt, cfg).token_ids
    assert ref.token_ids == generate_vanilla(target, prompt, GenerationConfig(max_new_tokens=16)).token_ids
    families = {(ids[1] > 1, logits.shape[0] > 1) for ids, through_graph, logits, _ in seen if through_graph}
    assert families and drafter.compiles == (1 if drafter.aot else len(families))  # an AOT graph serves them all
    torch._dynamo.reset()


def test_compile_off_restores_eager():
    target = tiny_target("llama")
    target.compile()
    target.compile(False)
    assert not target.compiled


def test_aot_graph_is_kept_for_later_processes(compiled_llama, monkeypatch):
    """The graph file outlives its process: a target with the same weights loads it without tracing or
    compiling anything; other weights or other aux layers name another file; a damaged file is compiled
    again, not trusted and not fatal."""
    import anchorspec.models.compiled as compiled_module

    target, _ = compiled_llama
    generate_vanilla(target, prompts()[0], GenerationConfig(max_new_tokens=2))  # the fixture's graph exists
    path = target.aot_path()
    assert path.is_file()
    again = tiny_target("llama")
    again.compile()
    assert again.aot_path() == path and tiny_target("llama", seed=1).aot_path(fuse=True) != path

    def no_tracing(*args, **kwargs):
        raise AssertionError("the kept graph was compiled again")

    monkeypatch.setattr(torch.export, "export", no_tracing)
    cfg = GenerationConfig(max_new_tokens=12)
    assert generate_vanilla(again, prompts()[0], cfg).token_ids == generate_vanilla(tiny_target("llama"), prompts()[0], cfg).token_ids
    assert again.compiles == 1
    again.set_aux_layers((0, 1))  # the graph returns the aux states it was traced with: another graph
    assert again.aot_path() != path and again._aot == "pending"

    good = path.read_bytes()
    rebuilt = []

    def rebuild(owner, body, example, dynamic, key, what, gemm="onednn"):  # stands in for a real compile (~30 s)
        rebuilt.append(key[0])
        key[0].write_bytes(good)

    monkeypatch.setattr(compiled_module, "_aot_write", rebuild)
    path.write_bytes(b"not a graph")
    damaged = tiny_target("llama")
    damaged.compile()
    assert generate_vanilla(damaged, prompts()[0], cfg).token_ids == generate_vanilla(tiny_target("llama"), prompts()[0], cfg).token_ids
    assert rebuilt == [path] and damaged.compiles == 1


def test_a_graph_that_cannot_be_compiled_leaves_eager_steps(monkeypatch, capsys):
    """Compiling needs a C++ compiler, among other things: where it fails, one line says so and the
    generation goes on with eager steps, the same tokens."""
    import anchorspec.models.compiled as compiled_module

    def broken(*args, **kwargs):
        raise RuntimeError("no C++ compiler found")

    monkeypatch.setattr(compiled_module, "aot_compile", broken)
    target = tiny_target("llama")
    target.compile()
    cfg = GenerationConfig(max_new_tokens=12)
    assert generate_vanilla(target, prompts()[0], cfg).token_ids == generate_vanilla(tiny_target("llama"), prompts()[0], cfg).token_ids
    assert not target.compiled and "could not be compiled (RuntimeError: no C++ compiler found)" in capsys.readouterr().err


def test_load_with_compile_leaves_packing_to_the_compiler(tmp_path, capsys, monkeypatch):
    """compile=True: the target's stock weights go to the graph (which packs them); "auto" (the CLI's
    default) uses a graph already on disk and otherwise packs as without compiling. `anchorspec compile`
    writes the graph that auto then finds. On a machine with no graph yet, load's warm-up traces it
    before any forward ran: the LM head's row selection is in it all the same (a kept subset of rows
    comes back), and the eager prefill still selects its last row."""
    import anchorspec.api
    from anchorspec.api import load
    from anchorspec.cli import main
    from anchorspec.errors import AnchorspecError
    from anchorspec.models.dtype import dtype_name
    from anchorspec.models.packed import is_packed, pack_linears
    from helpers import save_tiny_chat_target
    from test_packed import PACK_DTYPE as dtype  # bf16 where oneDNN packs it here, else fp32

    name = dtype_name(dtype)
    monkeypatch.setenv("ANCHORSPEC_HOME", str(tmp_path / "home"))  # no graph on disk: load compiles it
    monkeypatch.setenv("ANCHORSPEC_NARROW_GRAPH", "off")  # one graph each (their twins: test_narrow_graph.py)
    path = save_tiny_chat_target(tmp_path / "t", dtype=dtype)
    engine = load(str(path), dtype=name, compile=True, pack="on")
    assert engine.target.compiled and not is_packed(engine.target.model)
    assert engine.target.aot and engine.target.aot_path().is_file()
    example = engine.target._aot_example(rows=2, tokens=3, past=5, kept=4, slots=2, capacity=9)
    assert engine.target.load_graph()(*example)[0].shape[0] == 4  # rows 0..3 of 2 x 3
    text = engine.generate("hello", max_new_tokens=4, speculative=False).token_ids
    assert text == load(str(path), dtype=name, pack="on").generate("hello", max_new_tokens=4, speculative=False).token_ids
    auto = load(str(path), dtype=name, compile="auto", pack="on")
    assert auto.target.aot and not is_packed(auto.target.model)
    assert main(["compile", "--target", str(path), "--dtype", name]) == 0
    assert str(auto.target.aot_path()) in capsys.readouterr().out
    from transformers import AutoConfig

    from anchorspec.models.drafter import init_drafter, save_drafter

    drafter = tmp_path / "d"
    save_drafter(init_drafter(AutoConfig.from_pretrained(path), "eagle3.1", draft_vocab_size=64, seed=1), drafter,
                 dtype=dtype)
    beside = load(str(path), str(drafter), dtype=name, compile="auto", pack="on")  # no drafter graph yet
    assert beside.target.aot and not beside.drafter.compiled and is_packed(beside.drafter)
    # generate's auto compiles what is missing (here the drafter's graph) once prompts x max tokens repay it
    monkeypatch.setattr(anchorspec.api, "COMPILE_PAYS_AT", 6)
    run = ["generate", "--target", str(path), "--drafter", str(drafter), "--dtype", name, "--prompt", "hello"]
    assert main(run + ["--max-new-tokens", "5"]) == 0 and not beside.drafter.aot_path().exists()
    assert main(run + ["--max-new-tokens", "6"]) == 0 and beside.drafter.aot_path().is_file()
    assert "6 new tokens asked for" not in capsys.readouterr().err  # the target's graph was there already
    assert main(["compile", "--target", str(path), "--drafter", str(drafter), "--dtype", name]) == 0
    assert "the pass graph of the drafter" in capsys.readouterr().out
    both = load(str(path), str(drafter), dtype=name, compile="auto", pack="on", fallback=False)
    assert both.target.aot and both.drafter.aot and not is_packed(both.drafter)
    assert both.generate("hello", max_new_tokens=6).stats.verify_steps > 0 and both.drafter.compiles == 1  # loaded
    other = save_tiny_chat_target(tmp_path / "other", dtype=dtype, seed=3)  # no graph on disk for it
    fresh = load(str(other), dtype=name, compile="auto", pack="on", expected_tokens=5)
    assert not fresh.target.compiled and is_packed(fresh.target.model)
    with pytest.raises(AnchorspecError, match="compile must be"):
        load(str(path), compile="yes")
    packed = tiny_target("llama", dtype=dtype)
    pack_linears(packed.model)
    with pytest.raises(AnchorspecError, match="stock weights"):
        packed.compile()



def _spy_rows(drafter):
    """Record each forward_rows call's input shape, whether it went through the compiled graph, its
    draft logits (float32 by design) and its fed-back state (the drafter's dtype)."""
    calls, forward_rows = [], drafter.forward_rows

    def spy(ids, x, pos, cache, mask, rows):
        out = forward_rows(ids, x, pos, cache, mask, rows)
        calls.append((tuple(ids.shape), drafter.compiled and cache.static, out[0].clone(), out[1].clone()))
        return out

    drafter.forward_rows = spy
    return calls


def test_compiled_drafter_drafts_what_the_eager_one_drafts():
    """Drafter.compile(): every drafter pass after the prompt runs through the compiled graph, its
    draft logits equal the eager drafter's pass for pass (float64), and decoding stays lossless,
    chains and trees, on a compiled target and on an eager one (each drafter reads that target's
    features: a compiled target's differ from an eager one's by rounding)."""
    torch._dynamo.reset()
    eager_target = tiny_target("llama")
    cfg = GenerationConfig(max_new_tokens=16)
    for compile_target in (True, False):
        target = tiny_target("llama")
        target.compile(compile_target)
        compiled, eager = random_drafter(target), random_drafter(target)  # same seed: same weights
        compiled.compile()
        seen, ref_seen = _spy_rows(compiled), _spy_rows(eager)
        for prompt in prompts():
            ref = generate_vanilla(eager_target, prompt, cfg).token_ids
            for shape in (TreeShape.chain(4), TreeShape(2, 3, 6)):
                res = generate_speculative(target, EagleProposer(compiled), prompt, cfg, shape)
                plain = generate_speculative(target, EagleProposer(eager), prompt, cfg, shape)  # same features
                assert res.token_ids == plain.token_ids == ref, shape
        assert [c[0] for c in seen] == [c[0] for c in ref_seen]  # the same passes, in the same order
        for (_, _, logits, fed), (_, _, want_logits, want_fed) in zip(seen, ref_seen):
            # RoPE angles are float32 (as the target's) and inductor's vectorised cos/sin differ from
            # eager's by an ulp (1e-7): that reaches the float64 state at ~1e-11; a wrong mask or
            # cache row would differ by ~1e-2
            torch.testing.assert_close(fed, want_fed, rtol=1e-9, atol=1e-9)
            torch.testing.assert_close(logits, want_logits, rtol=1e-6, atol=1e-6)  # float32 logits
        static = [shape for shape, through_graph, *_ in seen if through_graph]
        assert len(static) == len(seen)  # every pass, the prompts' too (none is longer than GRAPH_PREFILL_TOKENS)
        assert (1, 1) in static and any(width > 1 for _, width in static)  # chain steps and wider passes
        assert compiled.compiles > 0 and eager.compiles == 0
    torch._dynamo.reset()


def test_compiled_drafter_in_batched_rounds(monkeypatch):
    """One graph per shape family, and a request whose drafter cache has another capacity adds no
    drafter graph (the same drafts as the
    request before, so the same shape families: a new family, such as a first pass wider than one
    token, may compile, a new size may not). Sequences sharing a compiled drafter in BatchDecoder
    rounds draft in one static pass with B > 1 and still decode exactly as plain greedy."""
    from anchorspec.decode import propose
    from anchorspec.decode.engine import SpeculativeDecoding
    from anchorspec.decode.round import BatchDecoder
    from test_batch import run_batched

    torch._dynamo.reset()
    target = tiny_target("llama")
    drafter = random_drafter(target)
    drafter.compile()
    seen = _spy_rows(drafter)
    prompt, cfg = prompts()[0], GenerationConfig(max_new_tokens=24)
    for capacity in (256, 64):  # the same drafts in drafter caches of two capacities, first thing after a reset
        monkeypatch.setattr(propose, "OWN_CAPACITY", capacity)
        graphs = drafter.compiles
        assert generate_speculative(target, EagleProposer(drafter), prompt, cfg, TreeShape.chain(3)).token_ids == \
            generate_vanilla(target, prompt, cfg).token_ids
        if capacity == 256:  # one AOT graph for every family (sizes 1 or more), the prompt's pass included
            families = {(ids[1] > 1, logits.shape[0] > 1) for ids, through_graph, logits, _ in seen if through_graph}
            assert drafter.aot and drafter.compiles == 1 and len(families) >= 2
            assert seen[0][1] and seen[0][0][1] == len(prompt)  # the prompt's features: through the graph
    assert drafter.compiles == graphs
    decs, refs = [], []
    for shape, n, prompt in zip((TreeShape.chain(3), TreeShape(2, 3, 6), TreeShape.chain(2)), (12, 8, 10), prompts(3)):
        cfg = GenerationConfig(max_new_tokens=n)
        refs.append(generate_vanilla(target, prompt, cfg).token_ids)
        decs.append(SpeculativeDecoding(target, EagleProposer(drafter), prompt, cfg, shape))
    assert [r.token_ids for r in run_batched(BatchDecoder(target), decs, start=3)] == refs
    assert max(shape[0] for shape, through_graph, *_ in seen if through_graph) == 3
    torch._dynamo.reset()


def test_a_catch_up_runs_through_the_drafter_graph_in_one_forward():
    """After plain rounds every row's drafter reads the positions it missed, its prompt included: with a compiled
    drafter those passes, when they fill slots 0..B-1 and padding them to the widest at most doubles them, are one
    static forward through the graph (they ran eager by size class: session 86); passes that padding would more than
    double still split. Either way the rounds decode exactly as plain greedy (float64)."""
    from anchorspec.decode.engine import SpeculativeDecoding
    from anchorspec.decode.round import BatchDecoder

    torch._dynamo.reset()
    target = tiny_target("llama")
    drafter = random_drafter(target)
    drafter.compile()
    seen = _spy_rows(drafter)
    for stretch, lengths in ((3, (9, 12, 14)), (4, (60, 6, 7))):
        decoder, cfg = BatchDecoder(target), GenerationConfig(max_new_tokens=stretch + 8)
        heads = [(torch.arange(n) * 7 + 1) % target.vocab_size for n in lengths]
        decs = [SpeculativeDecoding(target, EagleProposer(drafter), p, cfg, TreeShape.chain(2)) for p in heads]
        refs = [generate_vanilla(target, p, cfg).token_ids for p in heads]
        decoder.round([(d, True) for d in decs])  # the prefills: the drafters read nothing yet
        for _ in range(stretch):
            decoder.round([(d, False) for d in decs])
        seen.clear()
        decoder.round([(d, True) for d in decs])
        reads = sorted(call[0] for call in seen if call[0][1] > 1)  # (rows, padded width) of the catch-up forwards
        sizes = [n + stretch for n in lengths]  # each prompt's features and the plain stretch's
        if max(sizes) * len(sizes) <= 2 * sum(sizes):  # one forward over all rows, through the graph
            assert reads == [(3, max(sizes))] and all(call[1] for call in seen if call[0] == reads[0])
        else:  # the long one would more than double the padded tokens: it goes apart, by size class
            assert reads == [(1, max(sizes)), (2, sorted(sizes)[1])], reads
            # the long one alone in slot 0 through the graph; the two in slots 1 and 2 (not 0..B-1, not one) eager
            assert [call[1] for call in seen if call[0][1] > 1] == [True, False]
        while not all(d.finished for d in decs):
            decoder.round([(d, True) for d in decs if not d.finished])
        assert [d.result().token_ids for d in decs] == refs
    torch._dynamo.reset()


def test_warm_up_compiles_every_graph_a_generation_meets():
    """load(compile=True) warms every graph family up front (Engine.warm_up), torch.compile's (CUDA's path;
    ahead of time there are two graphs, the target's and the drafter's, built or loaded). With only plain decoding
    and a speculative generation warmed (the control, what a benchmark's warm-up ran in session 44), a
    generation whose fallback switches to plain steps and back, exploring a tree, still compiled a graph
    mid-run; after warm_up it compiles none."""
    from anchorspec.api import Engine
    from anchorspec.models.compiled import graphs_compiled
    from test_fallback import price_tree, switching

    def engine(aot=False):
        torch._dynamo.reset()
        target = tiny_target("llama")
        target.compile(aot=aot)
        drafter = random_drafter(target)
        drafter.compile(aot=aot)
        e = Engine(target, drafter)
        e.monitor = switching(plain=1.0, verify_per_token=0.5)  # speculation does not pay: plain steps, retries
        price_tree(e.monitor, 0.1)
        return e

    def compiled_during(e) -> int:
        before = graphs_compiled()
        e.generate(prompts()[1].tolist(), max_new_tokens=24)
        assert "plain" in e.monitor.kinds and "speculative" in e.monitor.kinds
        return graphs_compiled() - before

    control = engine()
    control.monitor.enabled = False  # the warm-up generations speculate at every step
    control.generate(prompts()[0].tolist(), max_new_tokens=24, speculative=False)
    control.generate(prompts()[0].tolist(), max_new_tokens=24, shape=TreeShape.chain(2))
    control.generate(prompts()[0].tolist(), max_new_tokens=24, shape=TreeShape(4, 4, 16))
    control.monitor.enabled = True
    assert compiled_during(control) > 0
    warmed = engine()
    assert warmed.warm_up() > 0
    assert compiled_during(warmed) == 0
    ahead = engine(aot=True)  # a CPU's default: one graph each, the warm-up builds or loads both
    assert ahead.warm_up() == 2 and ahead.target.compiles == ahead.drafter.compiles == 1
    assert compiled_during(ahead) == 0
    torch._dynamo.reset()


def test_a_graph_per_attention_form_stays_lossless(monkeypatch, tmp_path):
    """Where the one-row and few-row attention verdicts differ, the target keeps a graph traced in each
    (models/compiled.py: ByQueryRows): plain steps and prefills take the one-row graph, chains and trees of up to
    FEW_ROWS tokens the other, and greedy output, plain and speculative, equals plain greedy on the eager target
    (float64)."""
    from anchorspec.models import attention
    from anchorspec.models.compiled import ByQueryRows

    monkeypatch.setenv("ANCHORSPEC_HOME", str(tmp_path))
    monkeypatch.setenv("ANCHORSPEC_FEW_ROWS_GRAPH", "on")  # conftest keeps one graph per model elsewhere
    for memo in ("_one_row_form", "_few_rows_form"):
        monkeypatch.setattr(attention, memo, {})
    monkeypatch.setattr(attention, "_probe_one_row", lambda *a: attention.GQA)
    monkeypatch.setattr(attention, "_probe_few_rows", lambda *a: attention.ROWS)
    torch._dynamo.reset()
    target, eager = tiny_target("llama"), tiny_target("llama")
    target.compile(batched=True)
    graph = target.load_graph()
    assert isinstance(graph, ByQueryRows) and graph.path.is_file() and target.aot_path().is_file()
    solo = tiny_target("llama")  # compiled for one stream: the one-row graph alone (loaded from disk, not compiled)
    solo.compile()
    assert not isinstance(solo.load_graph(), ByQueryRows) and solo.aot_path() == target.aot_path()
    widths = {"one": [], "few": []}
    for name in widths:
        run = getattr(graph, name)
        setattr(graph, name, lambda args, mask, *rest, run=run, seen=widths[name]: seen.append(mask.shape[2])
                or run(args, mask, *rest))
    assert_lossless(target, eager)
    assert 1 in widths["one"] and all(w == 1 or w > attention.FEW_ROWS for w in widths["one"])
    assert {5, 6} <= set(widths["few"]) and all(1 < w <= attention.FEW_ROWS for w in widths["few"])
    torch._dynamo.reset()
