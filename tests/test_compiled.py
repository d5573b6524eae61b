"""Target.compile(): decode and verify steps through torch.compile (inductor, frozen weights) stay
lossless: greedy speculative output on the compiled target == plain greedy on the eager one, in
float64, chains and trees, and the compiled graph really ran (a few shapes, no recompiling per step)."""

import pytest
import torch

from anchorspec.decode.engine import GenerationConfig, generate_speculative, generate_vanilla
from anchorspec.decode.propose import EagleProposer
from anchorspec.decode.tree import TreeShape
from helpers import tiny_target
from test_lossless import prompts, random_drafter


@pytest.fixture(scope="module")
def compiled_llama():
    torch._dynamo.reset()
    target = tiny_target("llama")
    target.compile()
    calls = []
    run = target._compiled
    target._compiled = lambda *args: calls.append(args[0].shape) or run(*args)
    yield target, calls
    torch._dynamo.reset()


def test_compiled_target_decodes_losslessly(compiled_llama):
    target, calls = compiled_llama
    eager = tiny_target("llama")  # same seed: the same weights, never compiled
    proposer = EagleProposer(random_drafter(target))
    cfg = GenerationConfig(max_new_tokens=16)
    for prompt in prompts():
        ref = generate_vanilla(eager, prompt, cfg).token_ids
        assert generate_vanilla(target, prompt, cfg).token_ids == ref
        for shape in (TreeShape.chain(4), TreeShape(2, 3, 6)):
            assert generate_speculative(target, proposer, prompt, cfg, shape).token_ids == ref, shape
    assert {tuple(s) for s in calls} >= {(1, 1), (1, 5), (1, 6)}  # plain steps, chain and tree verifies


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
    target.compile()
    cfg = GenerationConfig(max_new_tokens=40)
    generate_vanilla(target, prompts()[0], cfg)  # warm: the plain step's graph exists
    graphs = counters["stats"]["unique_graphs"]
    generate_vanilla(target, torch.arange(3, 26), cfg)  # another prompt length, 40 more key lengths
    assert counters["stats"]["unique_graphs"] == graphs > 0
    torch._dynamo.reset()


def test_compile_off_restores_eager():
    target = tiny_target("llama")
    target.compile()
    target.compile(False)
    assert not target.compiled


def test_load_with_compile_leaves_packing_to_the_compiler(tmp_path):
    from anchorspec.api import load
    from anchorspec.errors import AnchorspecError
    from anchorspec.models.packed import is_packed, pack_linears
    from helpers import save_tiny_chat_target

    path = save_tiny_chat_target(tmp_path / "t", dtype=torch.bfloat16)
    engine = load(str(path), dtype="bfloat16", compile=True, pack="on")
    assert engine.target.compiled and not is_packed(engine.target.model)
    packed = tiny_target("llama", dtype=torch.bfloat16)
    pack_linears(packed.model)
    with pytest.raises(AnchorspecError, match="stock weights"):
        packed.compile()

