"""benchmarks/fallback_sim.py: the offline replay of the fallback's policy adds up steps as generation takes
them, and its verdicts are the monitor's own (a drafter that never fits stays near plain speed; always
speculating with it does not: the negative control)."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import fallback_sim  # noqa: E402

from anchorspec.decode.fallback import StreamMonitor  # noqa: E402
from anchorspec.decode.tree import TreeShape  # noqa: E402

COSTS = {"plain": 1.0, "verify": {n: 1.0 + 0.1 * (n - 1) for n in (*range(2, 10), 16)},
         "draft": {d: 0.1 * d for d in range(1, 9)}, "tree_draft": 0.5}


def traces(reach: int, n: int = 4, tokens: int = 64) -> list[dict]:
    return [{"id": j, "new_tokens": tokens, "chain": [reach] * tokens, "tree": [reach] * tokens} for j in range(n)]


def test_a_chain_that_is_always_accepted_costs_its_steps_exactly():
    clock = fallback_sim.Clock(COSTS, catch_up=0.5)
    run = fallback_sim.run_stream(StreamMonitor(enabled=False), traces(8, n=1, tokens=64), clock, TreeShape.chain(3))[0]
    # the prefill's token, then 15 steps of 4 tokens (60), then 3 left: a chain of 2 accepted whole
    assert run["tokens"] == 64 and run["plain_tokens"] == 0
    chain3, chain2 = 0.3 + 1.3, 0.2 + 1.2
    assert run["seconds"] == pytest.approx(1.0 + 0.5 + 15 * chain3 + chain2)  # the first step catches up the prompt


def test_clock_interpolates_real_steps_between_measured_depths():
    steps = {"plain": 2.0, "shapes": {"1,1,2": 3.0, "1,3,4": 4.0, "4,4,16": 6.0}, "catch_up": 0.2}
    clock = fallback_sim.Clock(COSTS, catch_up=0.5, steps=steps)
    assert clock.plain == 2.0 and clock.tree == 6.0 and clock.catch_up == 0.2
    assert clock.step(TreeShape.chain(2), 2, False)[0] == pytest.approx(3.5)
    assert clock.step(TreeShape.chain(5), 5, False)[0] == pytest.approx(5.0)  # past the deepest: the last slope
    whole, draft = clock.step(TreeShape.chain(3), 3, True)
    assert whole == pytest.approx(4.2) and 0 < draft < whole


def test_a_drafter_that_never_fits_stays_near_plain_and_always_speculating_does_not():
    clock = fallback_sim.Clock(COSTS, catch_up=0.25)
    misses = traces(0, n=20, tokens=128)
    plain = sum(min(t["new_tokens"], 128) for t in misses) * clock.plain

    def speed(runs):
        return plain / sum(r["seconds"] for r in runs)

    assert speed(fallback_sim.run_stream(StreamMonitor(), misses, clock)) > 0.95
    assert speed(fallback_sim.run_stream(StreamMonitor(enabled=False), misses, clock, TreeShape.chain(3))) < 0.7
    hits = traces(8, n=20, tokens=128)  # and one that always fits speculates throughout
    runs = fallback_sim.run_stream(StreamMonitor(), hits, clock)
    assert sum(r["plain_tokens"] for r in runs) <= 2 * len(hits) and speed(runs) > 2.0
