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
