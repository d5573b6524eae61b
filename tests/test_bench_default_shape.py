"""benchmarks/bench_default_shape.py end to end on a tiny float64 target: every method it times, the tree
the default path may choose and the fallback's switches included, writes the plain loop's tokens (the
float64 losslessness the figures rest on), and the summary names each method."""

import json
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import bench_default_shape  # noqa: E402

from anchorspec.models.drafter import init_drafter, save_drafter  # noqa: E402
from helpers import CHAT_WORDS, save_tiny_chat_target  # noqa: E402


def test_every_method_runs_and_matches_the_plain_loop(tmp_path, monkeypatch):
    monkeypatch.setenv("ANCHORSPEC_HOME", str(tmp_path / "home"))
    target = save_tiny_chat_target(tmp_path / "target", dtype=torch.float64)
    drafters = []
    for seed in (1, 2):
        path = tmp_path / f"drafter{seed}"
        save_drafter(init_drafter(AutoConfig.from_pretrained(target), "eagle3.1", draft_vocab_size=64, seed=seed), path)
        drafters.append(str(path))
    data = tmp_path / "q.jsonl"
    data.write_text("".join(json.dumps({"question_id": i, "turns": [" ".join(CHAT_WORDS[i:i + 5])]}) + "\n"
                            for i in range(3)))
    out = tmp_path / "r.json"
    assert bench_default_shape.main(["--target", str(target), "--drafter", drafters[0], "--random-drafter", drafters[1],
                                     "--dtype", "float64", "--data", str(data), "--every", "1", "--limit", "3",
                                     "--max-new-tokens", "12", "--shape", "2,2,4", "--plain-twice", "--chains-only", "--lookup", "8",
                                     "--no-lookup", "--out", str(out)]) == 0
    body = json.loads(out.read_text())
    methods = {"hf", "plain", "plain again", "default", "no-fallback", "chains-only", "2,2,4", "random", "lookup8",
               "no-lookup"}
    assert set(body["rows"]) == methods and methods <= set(body["summary"])
    plain = [row["tokens"] for row in body["rows"]["plain"]]
    assert len(plain) == 3 and all(plain)
    for name in methods - {"hf", "plain"}:
        assert [row["tokens"] for row in body["rows"][name]] == plain, name
    assert all(row["shape"] is None for row in body["rows"]["plain again"])
    assert all(row["shape"] == "2,2,4" for row in body["rows"]["2,2,4"])
    assert all(row["shape"].startswith("1,") for row in body["rows"]["chains-only"])
    for row in body["rows"]["default"]:  # the realised costs, and the estimates the shape was chosen on
        seconds = row["seconds"]
        assert seconds["total"] >= seconds["draft"] + seconds["verify"] > 0
        if row["shape"] is not None:
            assert row["shape"] in row["estimates"] and row["estimates"][row["shape"]]["rank"] > 0
        trace = row["trace"]  # every step after the prefill, as the monitor saw it
        # "lookup": a switched-off step that verified a copied chain with no drafter pass
        assert trace and {step["kind"] for step in trace} <= {"plain", "speculative", "lookup"}
        assert sum(step["accepted"] + 1 for step in trace) >= len(row["tokens"]) - 1
    assert all("trace" not in row for row in body["rows"]["2,2,4"])
    assert all(row["lookup_rows"] >= row["lookup_tokens"] >= 0 for row in body["rows"]["lookup8"])
    assert all(row["lookup_rows"] == 0 for row in body["rows"]["no-lookup"])
    realised = body["summary"]["default_monitor"]["realised"]  # per shape drafted, against the plain loop's step
    drafted = {step["shape"] for row in body["rows"]["default"] for step in row["trace"] if step["kind"] == "speculative"}
    assert realised and set(realised) <= drafted
    assert all(r["cost"] > 0 and r["speedup"] == pytest.approx(r["tau"] / r["cost"]) for r in realised.values())
    # the plain step the estimates divide by, beside the plain loop's: what tells a cost model off by its denominator
    steps = body["summary"]["default_monitor"]["plain_step_ms"]
    assert steps["estimated"] > 0 and steps["plain_loop"] > 0
    assert all(row["plain_estimate_s"] > 0 for row in body["rows"]["default"] if row["estimates"])


def test_realised_shapes_carry_what_their_prompts_estimated():
    def step(shape, accepted, step_s=0.02, catch_up=False):
        return {"kind": "speculative", "shape": shape, "accepted": accepted, "step_s": step_s, "draft_s": 0.005,
                "catch_up": catch_up}

    plain = [{"seconds": {"total": 1.1, "prefill": 0.1}, "tokens": list(range(101))}]  # 10 ms a token
    rows = [  # prompt A: one counted step of 1,2,3 (a catch-up step is not counted); prompt B: three
        {"trace": [step("1,2,3", 1), step("1,2,3", 2, catch_up=True)],
         "estimates": {"1,2,3": {"tau": 2.0, "cost": 1.0, "speedup": 2.0}}},
        {"trace": [step("1,2,3", 2)] * 3 + [step("1,1,2", 1)],
         "estimates": {"1,2,3": {"tau": 3.0, "cost": 1.5, "speedup": 2.0}}},  # no estimate of 1,1,2 here
    ]
    got = bench_default_shape.realised_by_shape(rows, plain)
    assert got["1,2,3"]["steps"] == 4 and got["1,2,3"]["tau"] == pytest.approx((2 + 3 * 3) / 4)
    assert got["1,2,3"]["cost"] == pytest.approx(2.0)  # 20 ms against the plain loop's 10
    assert got["1,2,3"]["estimated"] == pytest.approx({"tau": (2.0 + 3 * 3.0) / 4, "cost": (1.0 + 3 * 1.5) / 4,
                                                       "speedup": 2.0})
    assert "estimated" not in got["1,1,2"]  # no prompt estimated it
