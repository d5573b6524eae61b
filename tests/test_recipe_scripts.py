"""benchmarks/recipe_ablations.py and endpoint_agreement.py: an arm changes exactly its own flags on
top of the base recipe, one arm is trained by one process at a time (a killed owner's lock is taken
over), and endpoint_agreement's agreed prefix counts the tokens before the first difference."""

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import endpoint_agreement  # noqa: E402
import recipe_ablations  # noqa: E402


def flag_values(argv: list[str]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for i, a in enumerate(argv):
        if a.startswith("--"):
            value = argv[i + 1] if i + 1 < len(argv) and not argv[i + 1].startswith("--") else ""
            out.setdefault(a, []).append(value)
    return out


def test_each_arm_differs_from_base_in_its_own_flags_only():
    args = recipe_ablations.parse_args([])
    base = flag_values(recipe_ablations.train_args("base", args))
    assert all(len(v) == 1 for v in base.values()), "a flag given twice would leave argparse to pick one"
    for arm, (_, extra) in recipe_ablations.ARMS.items():
        got = flag_values(recipe_ablations.train_args(arm, args))
        assert all(len(v) == 1 for v in got.values()), arm
        changed = {k for k in set(got) | set(base) if got.get(k) != base.get(k)}
        assert changed == set(extra[0::2]), (arm, changed)
        for flag, value in zip(extra[0::2], extra[1::2]):
            assert got[flag] == [value], (arm, flag)
    assert base["--max-steps"] == [str(args.steps)] and base["--data"] == [args.data]


def test_unknown_arms_are_refused(capsys):
    with pytest.raises(SystemExit):
        recipe_ablations.parse_args(["--arms", "base,nope"])
    assert "unknown arms ['nope']" in capsys.readouterr().err


def test_an_arm_is_claimed_once_and_a_dead_owners_lock_is_taken_over(tmp_path):
    run = tmp_path / "arm"
    assert recipe_ablations.claim(run)
    assert (run / "lock").read_text() == str(os.getpid())
    assert not recipe_ablations.claim(run)  # held by a live process (this one)
    (run / "lock").write_text("999999999")  # no such pid: a killed session's lock
    assert recipe_ablations.claim(run)


def test_agreed_prefix_counts_tokens_before_the_first_difference():
    assert endpoint_agreement.agreed_prefix([1, 2, 3, 4], [1, 2, 9, 4]) == 2
    assert endpoint_agreement.agreed_prefix([1, 2], [1, 2, 3]) == 2
    assert endpoint_agreement.agreed_prefix([], [1]) == 0
    assert endpoint_agreement.agreed_prefix([5], [1]) == 0
