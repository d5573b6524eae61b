"""SpeculativeDecoding.start_from(SharedPrefix): a sequence starts from a shared prefix's precomputed
rows (the prompt minus its last token) and feeds the last prompt token as its first plain step, alone
or in a batch round, and decodes exactly as a normal prefill does (float64: greedy tokens, seeded
sampling); what it cannot serve is refused with a one-line error."""

import pytest
import torch

from anchorspec.decode.batch import BatchKV, SharedPrefix
from anchorspec.decode.engine import GenerationConfig, PlainDecoding, SpeculativeDecoding, generate_vanilla
from anchorspec.decode.propose import EagleProposer
from anchorspec.decode.round import BatchDecoder
from anchorspec.decode.sampling import SamplingParams
from anchorspec.decode.tree import TreeShape
from anchorspec.errors import AnchorspecError
from helpers import random_drafter, tiny_target

PREFIX = torch.arange(5, 17)  # 12 tokens every prompt below starts with


def _prompt(last: int) -> torch.Tensor:
    return torch.cat([PREFIX, torch.tensor([last])])


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("sampling", [SamplingParams(), SamplingParams(1.0, 0.9)], ids=["greedy", "sampled"])
def test_solo_start_from_a_prefix_equals_a_prefill(family, sampling):
    target = tiny_target(family)
    prefix = SharedPrefix.build(target, PREFIX)
    for last in (3, 40):
        cfg = GenerationConfig(max_new_tokens=12, sampling=sampling, seed=11)
        ref = generate_vanilla(target, _prompt(last), cfg)
        dec = PlainDecoding(target, _prompt(last), cfg)
        dec.start_from(prefix)
        assert dec.run().token_ids == ref.token_ids


def test_batched_starts_from_a_prefix_equal_solo_prefills():
    target = tiny_target("llama")
    prefix = SharedPrefix.build(target, PREFIX)
    cfg = GenerationConfig(max_new_tokens=10, sampling=SamplingParams(1.0), seed=4)
    lasts = [3, 9, 27, 40]
    refs = [generate_vanilla(target, _prompt(last), cfg).token_ids for last in lasts]
    decoder = BatchDecoder(target)
    decs = []
    for last in lasts:
        dec = PlainDecoding(target, _prompt(last), cfg)
        dec.join(decoder.kv)
        dec.start_from(prefix)
        decs.append(dec)
    first = decoder.round([(dec, None) for dec in decs])
    assert first.prefills == 0 and first.rows == 4  # no prefill: all four ride one batched forward
    while any(not dec.finished for dec in decs):
        decoder.round([(dec, None) for dec in decs if not dec.finished])
    assert [dec.result().token_ids for dec in decs] == refs


def test_what_a_prefix_start_cannot_serve_is_refused():
    target = tiny_target("llama")
    prefix = SharedPrefix.build(target, PREFIX)
    cfg = GenerationConfig(max_new_tokens=4)
    with pytest.raises(AnchorspecError, match="prompt without its last token"):
        PlainDecoding(target, torch.cat([PREFIX, torch.tensor([3, 4])]), cfg).start_from(prefix)
    with pytest.raises(AnchorspecError, match="plain decoding only"):
        SpeculativeDecoding(target, EagleProposer(random_drafter(target)), _prompt(3), cfg,
                            TreeShape.chain(2)).start_from(prefix)
    started = PlainDecoding(target, _prompt(3), cfg)
    started.step()
    with pytest.raises(AnchorspecError, match="before the first step"):
        started.start_from(prefix)


def test_extend_appends_rows_after_a_slots_own():
    kv = BatchKV(slots=1, capacity=2)
    rows = [torch.arange(12.0).view(1, 1, 3, 4)]
    slot = kv.attach_rows(rows, [-rows[0]])
    kv.extend(slot, [rows[0] + 100], [-rows[0] - 100])
    assert slot.length == 6 and kv.capacity >= 6
    assert torch.equal(kv.keys[0][0, :, :6], torch.cat([rows[0], rows[0] + 100], dim=2)[0])
    assert torch.equal(kv.values[0][0, :, :6], -torch.cat([rows[0], rows[0] + 100], dim=2)[0])
    with pytest.raises(AnchorspecError, match="shape"):  # rows of another model (head_dim 8) do not fit
        kv.extend(slot, [torch.zeros(1, 1, 2, 8)], [torch.zeros(1, 1, 2, 8)])
