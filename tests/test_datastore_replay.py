"""benchmarks/datastore_replay.py: the n-gram datastore's chain rules (longest order first, the majority
continuation while it keeps its share, the length limit), on a corpus small enough to check by hand."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from anchorspec.data.corpus import write_part

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from datastore_replay import Datastore, ngram_hashes  # noqa: E402


@pytest.fixture
def corpus(tmp_path):
    conversations = [
        [1, 2, 3, 4, 5, 6, 7],
        [9, 2, 3, 4, 5, 6, 8],
        [8, 2, 3, 4, 5, 9, 9],
        [7, 7, 3, 4, 11, 12, 13],
    ]
    write_part(tmp_path, [(c, [1] * len(c)) for c in conversations], vocab_size=32, provenance={})
    return str(tmp_path)


def test_hashes_name_each_ngram():
    tokens = np.array([5, 6, 7, 5, 6, 7, 5])
    h = ngram_hashes(tokens, 3)
    assert len(h) == 5
    assert h[0] == h[3] and h[0] != h[1]  # equal n-grams hash alike, others not (here)


def test_chain_follows_the_majority_while_it_keeps_its_share(corpus):
    store = Datastore(corpus, [2, 3])
    # [2, 3, 4] occurs three times, continued by 5 6 7, 5 6 8, 5 9 9
    assert store.propose([0, 2, 3, 4], limit=4, min_share=0.6, max_matches=256) == [5, 6]  # 6: 2 of 3; 7: 1 of 2
    assert store.propose([0, 2, 3, 4], limit=4, min_share=0.7, max_matches=256) == [5]
    assert store.propose([0, 2, 3, 4], limit=1, min_share=0.6, max_matches=256) == [5]  # the length limit
    # the first occurrence only, up to its conversation's end (the next conversation is not its continuation)
    assert store.propose([0, 2, 3, 4], limit=4, min_share=0.6, max_matches=1) == [5, 6, 7]
    # the 2-gram [3, 4] occurs 4 times (5, 5, 5, 11): 3 of 4 agree
    assert store.propose([3, 4], limit=2, min_share=0.9, max_matches=256) == []
    assert store.propose([3, 4], limit=2, min_share=0.7, max_matches=256) == [5]


def test_longest_order_wins_and_unknown_contexts_draft_nothing(corpus):
    store = Datastore(corpus, [2, 3])
    # 3-gram [7, 3, 4] occurs once (-> 11, 12); the 2-gram [3, 4] alone would say 5
    assert store.propose([7, 3, 4], limit=2, min_share=0.5, max_matches=256) == [11, 12]
    assert store.propose([30, 31], limit=2, min_share=0.5, max_matches=256) == []
    assert store.propose([4], limit=2, min_share=0.5, max_matches=256) == []  # shorter than every order


def test_retrieved_chain_is_walked_as_a_second_chain(tmp_path):
    """lookup_replay.walk with the datastore as its second chain source: a store holding the target's own answer
    wins tokens past the drafter and the lookup chain (counted, and in tau); a store that never matches changes
    nothing against no store at all."""
    import torch
    from datastore_replay import RetrievedChain
    from helpers import tiny_target
    from lookup_replay import walk

    from anchorspec.api import attach_drafter
    from anchorspec.decode.engine import GenerationConfig, generate_vanilla
    from anchorspec.decode.lookup import LookupSettings
    from anchorspec.decode.propose import EagleProposer
    from anchorspec.decode.shape import captured_states
    from anchorspec.decode.tree import TreeShape
    from anchorspec.models.drafter import init_drafter

    target = tiny_target("llama")
    drafter = init_drafter(target.config, "eagle3.1", draft_vocab_size=64, seed=1).to(torch.float64)
    attach_drafter(target, drafter)
    proposer = EagleProposer(drafter)
    prompt = torch.arange(1, 11)
    answer = generate_vanilla(target, prompt, GenerationConfig(max_new_tokens=40)).token_ids
    sequence = torch.cat([prompt, torch.tensor(answer)])
    aux = captured_states(target, sequence)
    shape = TreeShape(1, 2, 3)
    alone = walk(proposer, sequence, len(prompt), aux, shape, LookupSettings())
    write_part(tmp_path / "own", [(sequence.tolist(), [1] * len(sequence))], vocab_size=64, provenance={})
    write_part(tmp_path / "other", [([60, 61, 62, 63, 60, 61], [1] * 6)], vocab_size=64, provenance={})
    never = RetrievedChain(Datastore(str(tmp_path / "other"), [4]), 16, 0.5, 256)
    assert walk(proposer, sequence, len(prompt), aux, shape, LookupSettings(), never) == alone
    own = RetrievedChain(Datastore(str(tmp_path / "own"), [4]), 16, 0.5, 256)
    emitted, steps, rows, won = walk(proposer, sequence, len(prompt), aux, shape, LookupSettings(), own)
    assert won > 0 and abs(emitted - alone[0]) <= 2  # the same answer (up to where the last step lands), in fewer steps
    assert steps < alone[1] and emitted / steps > alone[0] / alone[1] and rows > alone[2] / alone[1] * steps
