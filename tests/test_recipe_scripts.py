"""benchmarks/recipe_ablations.py and endpoint_agreement.py: an arm changes exactly its own flags on
top of the base recipe, one arm is trained by one process at a time (a killed owner's lock is taken
over), endpoint_agreement's agreed prefix counts the tokens before the first difference, and cpu_round.sh
trains with flags the CLI accepts and refuses a round that is not there."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import endpoint_agreement  # noqa: E402
import recipe_ablations  # noqa: E402
from bench_core import named_drafters  # noqa: E402


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


def test_acceptance_vs_confidence_scores_only_the_levels_the_verifier_reaches():
    import acceptance_vs_confidence as avc
    import torch

    from anchorspec.decode.tree import DraftTree

    chain3 = DraftTree(torch.tensor([0, 5, 6, 7]), [-1, 0, 1, 2])  # depth 3
    conf = torch.tensor([0.1, 0.2, 0.35, 0.6, 0.8, 0.95, 0.99, 0.5])
    inside = avc.inside_word(["<s>", " Wa", "ime", "a", " Canyon", ",", " and", "\n"])
    assert inside == [False, False, True, True, False, False, False, False]
    # a step at root 2 accepting 1 token: depth 1 (accepted) and depth 2 (rejected) are scored, depth 3 is not
    # a step at root 4 accepting all 3: depths 1-3 scored and accepted
    in_vocab = [True, True, True, False, True, True, True, True]
    got = avc.level_records([(2, 1, chain3), (4, 3, chain3)], conf, inside, in_vocab)
    assert got == [(1, pytest.approx(0.35), True, True, False), (2, pytest.approx(0.6), False, False, True),
                   (1, pytest.approx(0.8), True, False, True), (2, pytest.approx(0.95), True, False, True),
                   (3, pytest.approx(0.99), True, False, True)]
    # the pooled curve predicts a category from its own positions: alone, expected equals actual
    records = [(1, 0.2, False, True, True), (1, 0.25, True, False, True), (1, 0.95, True, False, True),
               (1, 0.98, False, True, False), (1, 0.99, True, True, True), (2, 0.99, False, False, False)]
    curve = {avc.bin_of(0.2): 0.5, avc.bin_of(0.95): 2 / 3, avc.bin_of(0.98): 2 / 3}
    row = avc.summarise(records, curve)
    assert row["first_level_acceptance"] == pytest.approx(0.6) == row["first_level_expected"]
    assert row["first_level_steps"] == 5 and row["inside_word_share"] == 0.6
    assert row["first_level_inside_word"] == pytest.approx(1 / 3) and row["first_level_word_start"] == 1.0
    assert row["outside_vocab_share"] == 0.2 and row["first_level_in_vocab"] == 0.75
    assert (row["sure_misses"], row["sure_misses_outside_vocab"]) == (1, 1)  # depth 2 is not a first-level miss
    answers = [{"category": "a", "answer": [1, 2, 3, 4]}, {"category": "b", "answer": [4, 4]}]
    in_vocab = [True, True, True, True, False]
    assert avc.outside_share(answers, in_vocab, "a") == 0.25 and avc.outside_share(answers, in_vocab, None) == 0.5
    assert avc.confidence_profile([0.2, 0.25, 0.95, 0.98])["share_below_0.5"] == 0.5
    assert avc.bin_of(0.97) != avc.bin_of(0.969) and avc.bin_of(1.0) == len(avc.BINS) - 2


def test_drafter_specs_are_named_or_take_their_folders_name():
    specs = ["r11=checkpoints/a-eagle3.1", "runs/r13/final", "odd=dir=with=equals"]
    assert named_drafters(specs) == [("r11", "checkpoints/a-eagle3.1"), ("final", "runs/r13/final"),
                                     ("odd", "dir=with=equals")]


CPU_ROUND = Path(__file__).resolve().parent.parent / "benchmarks" / "cpu_round.sh"


def test_cpu_round_trains_with_flags_the_cli_accepts(tmp_path):
    """The script's train command, echoed instead of run, parses with anchorspec's own parser: a renamed
    or removed flag fails here, not an hour into a session."""
    from anchorspec import cli

    shim = tmp_path / "bin"
    shim.mkdir()
    (shim / "anchorspec").write_text('#!/usr/bin/env bash\nprintf "%s\\n" "$@"\n')
    (shim / "anchorspec").chmod(0o755)
    env = {**os.environ, "PATH": f"{shim}:{os.environ['PATH']}", "ANCHORSPEC_HOME": str(tmp_path / "home")}
    out = subprocess.run(["bash", str(CPU_ROUND), "train", "12", "--resume"], env=env,
                         capture_output=True, text=True, check=True).stdout.splitlines()
    args = cli.build_parser().parse_args(out)
    assert out[0] == "train" and args.order_seed == 12 and args.resume
    assert args.out == str(tmp_path / "home" / "runs" / "smollm2-135m-instruct" / "eagle3-r12")
    assert args.init_from == "checkpoints/smollm2-135m-instruct-eagle3"  # the release, unless INIT says otherwise
    out = subprocess.run(["bash", str(CPU_ROUND), "train", "12"], env={**env, "INIT": str(tmp_path / "fold")},
                         capture_output=True, text=True, check=True).stdout.splitlines()
    assert cli.build_parser().parse_args(out).init_from == str(tmp_path / "fold")
    # VARIANT picks the release a round continues and the run's name (session 57: an EAGLE-3.1 round)
    out = subprocess.run(["bash", str(CPU_ROUND), "train", "19"], env={**env, "VARIANT": "eagle3.1"},
                         capture_output=True, text=True, check=True).stdout.splitlines()
    args = cli.build_parser().parse_args(out)
    assert args.variant == "eagle3.1" and args.init_from == "checkpoints/smollm2-135m-instruct-eagle3.1"
    assert args.out == str(tmp_path / "home" / "runs" / "smollm2-135m-instruct" / "eagle3.1-r19")
    # LR sets the peak learning rate (session 59: a quieter round), the default unchanged without it
    assert args.lr == 3e-4
    out = subprocess.run(["bash", str(CPU_ROUND), "train", "17"], env={**env, "LR": "1e-4"},
                         capture_output=True, text=True, check=True).stdout.splitlines()
    assert cli.build_parser().parse_args(out).lr == 1e-4


def test_cpu_round_refuses_an_unknown_variant_in_one_line(tmp_path):
    env = {**os.environ, "ANCHORSPEC_HOME": str(tmp_path), "VARIANT": "eagle4"}
    got = subprocess.run(["bash", str(CPU_ROUND), "train", "7"], env=env, capture_output=True, text=True)
    assert got.returncode == 2 and got.stdout == ""
    assert got.stderr.count("\n") == 1 and "eagle4" in got.stderr


@pytest.mark.parametrize("mode, needs", [("eval", "train round 7 first"), ("release", "run eval 7 first")])
def test_cpu_round_refuses_a_missing_round_in_one_line(tmp_path, mode, needs):
    env = {**os.environ, "ANCHORSPEC_HOME": str(tmp_path), "TAU": "2.0"}
    got = subprocess.run(["bash", str(CPU_ROUND), mode, "7"], env=env, capture_output=True, text=True)
    assert got.returncode == 2 and got.stdout == ""
    assert got.stderr.count("\n") == 1 and needs in got.stderr
