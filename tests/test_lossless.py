"""Greedy speculative output == plain greedy output, token for token, in float64.

Random drafter (almost nothing accepted: the rollback path runs every step), oracle drafter
(everything accepted: tau = depth + 1), chains and trees, six model families, stop tokens inside
a draft and the max-new-tokens limit.
"""

import pytest
import torch

from anchorspec.decode.engine import GenerationConfig, generate_speculative, generate_vanilla
from anchorspec.decode.propose import EagleProposer
from anchorspec.decode.sampling import SamplingParams
from anchorspec.decode.tree import TreeShape
from helpers import FAMILIES, OracleProposer, prompts, random_drafter, tiny_target

SHAPES = [TreeShape.chain(1), TreeShape.chain(5), TreeShape(2, 3, 6), TreeShape(8, 6, 32)]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_random_drafter_matches_greedy_every_family(family):
    target = tiny_target(family)
    proposer = EagleProposer(random_drafter(target))
    cfg = GenerationConfig(max_new_tokens=24)
    for prompt in prompts():
        ref = generate_vanilla(target, prompt, cfg).token_ids
        for shape in SHAPES:
            res = generate_speculative(target, proposer, prompt, cfg, shape)
            assert res.token_ids == ref, (family, shape)
            assert res.stats.drafted_tokens > 0  # the drafter really ran
            assert res.stats.new_tokens == len(ref) == 24


@pytest.mark.parametrize("variant", ["eagle3", "eagle3.1"])
def test_random_drafter_rarely_accepted(variant):
    target = tiny_target("llama")
    proposer = EagleProposer(random_drafter(target, variant))
    res = generate_speculative(target, proposer, prompts()[0], GenerationConfig(max_new_tokens=40), TreeShape.chain(3))
    assert res.stats.accepted_tokens / res.stats.drafted_tokens < 0.2
    assert res.stats.verify_steps >= 30  # most steps emit a single token


@pytest.mark.parametrize("k", [1, 3, 7])
def test_oracle_chain_accepts_everything(k):
    target = tiny_target("llama")
    steps = 4
    cfg = GenerationConfig(max_new_tokens=1 + steps * (k + 1))  # every step drafts the full depth
    prompt = prompts()[0]
    ref = generate_vanilla(target, prompt, cfg).token_ids
    res = generate_speculative(target, OracleProposer(target), prompt, cfg, TreeShape.chain(k))
    assert res.token_ids == ref
    assert res.stats.tau == k + 1
    assert res.stats.verify_steps == steps
    assert res.stats.acceptance_per_depth == [1.0] * k
    assert res.stats.target_forwards == steps + 1


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("shape", [TreeShape(2, 3, 8), TreeShape(4, 5, 16), TreeShape(3, 4, 31)], ids=str)
def test_oracle_tree_accepts_full_depth(family, shape):
    target = tiny_target(family)
    cfg = GenerationConfig(max_new_tokens=1 + 3 * (shape.depth + 1))
    prompt = prompts()[1]
    ref = generate_vanilla(target, prompt, cfg).token_ids
    res = generate_speculative(target, OracleProposer(target), prompt, cfg, shape)
    assert res.token_ids == ref
    assert res.stats.tau == shape.depth + 1
    assert res.stats.drafted_tokens == 3 * min(shape.total_tokens - 1, shape.max_nodes)


@pytest.mark.parametrize("shape", [TreeShape.chain(4), TreeShape(3, 4, 12)], ids=str)
def test_stop_token_inside_accepted_draft(shape):
    """The oracle accepts whole drafts, so the stop token arrives in the middle of one."""
    target = tiny_target("llama")
    prompt = prompts()[0]
    free = generate_vanilla(target, prompt, GenerationConfig(max_new_tokens=30)).token_ids
    stop = free[6]
    first = free.index(stop)
    cfg = GenerationConfig(max_new_tokens=30, stop_token_ids=(stop,))
    ref = generate_vanilla(target, prompt, cfg)
    assert ref.token_ids == free[: first + 1] and ref.finish_reason == "stop"
    for proposer in (OracleProposer(target), EagleProposer(random_drafter(target))):
        res = generate_speculative(target, proposer, prompt, cfg, shape)
        assert res.token_ids == ref.token_ids
        assert res.finish_reason == "stop"


@pytest.mark.parametrize("max_new", [1, 2, 3, 4, 5, 9, 13])
def test_exact_max_new_tokens(max_new):
    target = tiny_target("llama")
    prompt = prompts()[0]
    cfg = GenerationConfig(max_new_tokens=max_new)
    ref = generate_vanilla(target, prompt, cfg)
    assert len(ref.token_ids) == max_new and ref.finish_reason == "length"
    for shape in (TreeShape.chain(4), TreeShape(3, 4, 12)):
        res = generate_speculative(target, OracleProposer(target), prompt, cfg, shape)
        assert res.token_ids == ref.token_ids
        assert res.finish_reason == "length"
        stats = res.stats
        if shape.is_chain:  # drafts are cut to the budget, and the oracle's are all accepted
            assert stats.accepted_tokens == stats.drafted_tokens
        assert stats.acceptance_per_depth == [1.0] * len(stats.acceptance_per_depth)


def test_vanilla_loop_matches_hf_generate():
    target = tiny_target("qwen2")
    prompt = prompts()[0]
    ours = generate_vanilla(target, prompt, GenerationConfig(max_new_tokens=20)).token_ids
    # an explicit mask: otherwise HF infers padding from any prompt token equal to pad_token_id
    device = target.embed_weight.device
    hf = target.model.generate(prompt[None].to(device), attention_mask=torch.ones(1, prompt.numel(), dtype=torch.long,
                                                                                 device=device),
                               max_new_tokens=20, do_sample=False, eos_token_id=None,
                               pad_token_id=0)[0, prompt.numel():].tolist()
    assert ours == hf


@pytest.mark.parametrize("shape", [TreeShape.chain(3), TreeShape(3, 3, 8)], ids=str)
def test_seeded_sampling_is_reproducible(shape):
    target = tiny_target("llama", peaked=1.0)
    proposer = EagleProposer(random_drafter(target))
    prompt = prompts()[0]

    def run(seed, speculative=True):
        cfg = GenerationConfig(max_new_tokens=20, sampling=SamplingParams(temperature=1.0, top_p=0.95), seed=seed)
        if speculative:
            return generate_speculative(target, proposer, prompt, cfg, shape).token_ids
        return generate_vanilla(target, prompt, cfg).token_ids

    assert run(7) == run(7)
    assert run(7, False) == run(7, False)
    assert len({tuple(run(s)) for s in range(4)}) > 1  # the seed matters



@pytest.mark.parametrize("shape", [TreeShape.chain(3), TreeShape(3, 4, 12)], ids=str)
def test_slot_cache_growing_mid_generation(shape, monkeypatch):
    """A solo sequence decodes on a preallocated one-slot BatchKV of its own; with no slack a
    verified tree overruns its capacity near the end, so it doubles mid-generation, and the output
    stays plain greedy's."""
    import anchorspec.decode.engine as engine_module
    from anchorspec.decode.batch import KVSlot
    from anchorspec.decode.engine import PlainDecoding

    monkeypatch.setattr(engine_module, "SLOT_SLACK", 0)
    target = tiny_target("llama")
    prompt = prompts()[0]
    cfg = GenerationConfig(max_new_tokens=16)
    plain = PlainDecoding(target, prompt, cfg)
    ref = plain.run().token_ids
    assert isinstance(plain.cache, KVSlot) and plain.cache.length == prompt.numel() + 15  # the last token is not fed
    assert plain.cache.kv.capacity == prompt.numel() + 15 and plain.cache.kv.num_slots == 1
    for proposer in (OracleProposer(target), EagleProposer(random_drafter(target))):
        dec = engine_module.SpeculativeDecoding(target, proposer, prompt, cfg, shape)
        assert dec.run().token_ids == ref
        assert isinstance(dec.cache, KVSlot) and dec.cache.length == prompt.numel() + 15
        # a chain capped to the budget fits exactly; a capped tree keeps its node count and overruns
        assert (dec.cache.kv.capacity > prompt.numel() + 15) == (not shape.is_chain)
