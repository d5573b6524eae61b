"""benchmarks/replay_by_source.py names its rows from the corpus ids: each steered Magpie source gets the steer
that wrote it (the hash in its id is the system prompt's), and a source without a known steer keeps its old row."""

import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import replay_by_source  # noqa: E402

REPO = Path(__file__).resolve().parent.parent


def test_every_steered_corpus_source_is_named_by_its_steer():
    steers = replay_by_source.steer_names(REPO / "scripts" / "magpie_steers.sh")
    assert len(steers) == 7  # every steer but "plain", which has no system prompt
    packed = set()
    for meta in (REPO / "corpus" / "smollm2-135m-instruct").glob("part-*.json"):
        packed |= {s for s in json.loads(meta.read_text())["sources"] if re.match(r"magpie-[0-9a-f]{8}:", s)}
    assert packed  # the corpus holds steered parts
    names = {replay_by_source.source_name(s, steers) for s in packed}
    assert {"Magpie, writing steer", "Magpie, stem steer", "Magpie, humanities steer"} <= names
    assert all(n.endswith(" steer") for n in names), names


def test_unsteered_sources_keep_their_rows():
    steers = replay_by_source.steer_names(REPO / "scripts" / "magpie_steers.sh")
    assert replay_by_source.source_name("magpie:23", steers) == "Magpie (the target's own prompts)"
    assert replay_by_source.source_name("magpie-00000000:1", steers) == "Magpie (the target's own prompts)"
    assert replay_by_source.source_name("sharegpt", steers) == "ShareGPT first turns"
    assert replay_by_source.source_name("later", steers) == "ShareGPT later turns"
