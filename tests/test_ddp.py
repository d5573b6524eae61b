"""Data-parallel training on CPU (gloo): 2 ranks x grad-accum 1 must train exactly the drafter that
1 process x grad-accum 2 trains (same global batch, float64), and every rank must end with the same weights.

Tiny model (vocab 96, hidden 32), 24 two-turn conversations, 4 optimizer steps; one intra-op thread per process.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from anchorspec import cli

from helpers import save_tiny_chat_target, write_conversations_jsonl

STEPS = 4
COMMON = ["--max-steps", str(STEPS), "--dtype", "float64", "--variant", "eagle3.1", "--ttt-steps", "2",
          "--batch-tokens", "48", "--eval-prompts", "0", "--no-progress", "--threads", "1", "--log-every", "1",
          "--lr", "1e-2"]  # a large lr: trajectories that saw other batches end far apart (see the control)
DIST_ENV = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "LOCAL_WORLD_SIZE", "GROUP_RANK",
            "TORCHELASTIC_RUN_ID")


pytestmark = pytest.mark.usefixtures("one_thread")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def clean_env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in DIST_ENV}
    env["OMP_NUM_THREADS"] = "1"
    return env


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    root = tmp_path_factory.mktemp("ddp")
    save_tiny_chat_target(root / "target", dtype=torch.float64)
    write_conversations_jsonl(root / "data.jsonl", n=24)
    return root


def train_args(work: Path, out: Path, grad_accum: int) -> list[str]:
    return ["train", "--target", str(work / "target"), "--data", str(work / "data.jsonl"), "--out", str(out),
            "--grad-accum", str(grad_accum), *COMMON]


def single_process(work: Path, name: str, grad_accum: int) -> Path:
    out = work / name
    if not (out / "final" / "model.safetensors").is_file():
        saved = {k: os.environ.pop(k) for k in DIST_ENV if k in os.environ}
        try:
            assert cli.main(train_args(work, out, grad_accum)) == 0
        finally:
            os.environ.update(saved)
            torch.set_num_threads(1)
    return out


@pytest.fixture(scope="module")
def out1(work):
    """One process, grad-accum 2: micro-batches 2s and 2s+1 make step s."""
    return single_process(work, "out1", 2)


@pytest.fixture(scope="module")
def ddp_run(work):
    """Two ranks via torchrun, grad-accum 1: rank r takes micro-batch 2s+r at step s."""
    out = work / "out2"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
           "-m", "anchorspec", *train_args(work, out, 1)]
    proc = subprocess.run(cmd, cwd=work, env=clean_env(), capture_output=True, text=True, timeout=150)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out, proc


def weights(out: Path) -> dict[str, torch.Tensor]:
    return load_file(out / "final" / "model.safetensors")


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].double() - b[k].double()).abs().max()) if a[k].is_floating_point()
               else float((a[k] != b[k]).any()) for k in a)


def train_records(out: Path) -> list[dict]:
    return [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "loss" in r]


def test_two_ranks_equal_one_process_with_grad_accum(work, out1, ddp_run):
    out2, proc = ddp_run
    w1, w2 = weights(out1), weights(out2)
    assert w1["fc.weight"].dtype == torch.float64
    assert max_diff(w1, w2) < 1e-10

    # Control: a single process with grad-accum 1 sees half the data per step; its drafter differs by far
    # more than the tolerance, so the equality above is not vacuous.
    control = weights(single_process(work, "out0", 1))
    assert max_diff(w1, control) > 1e-4


def test_two_ranks_metrics_and_run_json(out1, ddp_run):
    out2, proc = ddp_run
    r1, r2 = train_records(out1), train_records(out2)
    assert [r["step"] for r in r1] == [r["step"] for r in r2] == list(range(1, STEPS + 1))
    for a, b in zip(r1, r2):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-10, abs=1e-12)
        assert b["loss_per_step"] == pytest.approx(a["loss_per_step"], rel=1e-10, abs=1e-12)
        assert b["acc_per_step"] == pytest.approx(a["acc_per_step"], abs=1e-12)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-8, abs=1e-12)
        assert b["lr"] == pytest.approx(a["lr"], rel=1e-12, abs=1e-15)
    assert len({r["loss"] for r in r1}) > 1  # the loss moved: the steps were not all the same batch

    run1, run2 = (json.loads((o / "run.json").read_text()) for o in (out1, out2))
    assert run1["world_size"] == 1 and run2["world_size"] == 2
    assert run1["total_steps"] == run2["total_steps"] == STEPS
    assert run1["summary"]["steps"] == run2["summary"]["steps"] == STEPS
    assert run2["config"]["grad_accum"] == 1 and run1["config"]["grad_accum"] == 2
    # Only rank 0 reports: one summary line on stdout, one eval line per evaluation in metrics.jsonl.
    summaries = [json.loads(x) for x in proc.stdout.splitlines() if x.startswith("{")]
    assert len(summaries) == 1 and summaries[0]["steps"] == STEPS
    evals = [r for r in map(json.loads, (out2 / "metrics.jsonl").read_text().splitlines()) if "eval" in r]
    assert len(evals) == 1


# --------------------------------------------------------------------------------------------
# every rank ends with the same drafter and optimizer state (in-process ranks, gloo)
# --------------------------------------------------------------------------------------------

def _rank_worker(rank: int, world: int, port: int, cfg: dict, dump: str) -> None:
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                       "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world), "OMP_NUM_THREADS": "1"})
    torch.set_num_threads(1)
    import torch.distributed as dist

    from anchorspec.train.trainer import TrainConfig, Trainer

    trainer = Trainer(TrainConfig(**cfg))
    trainer.run()
    opt = trainer.optimizer.state_dict()["state"]
    torch.save({"drafter": {k: v.detach().clone() for k, v in trainer.drafter.state_dict().items()},
                "exp_avg": [opt[i]["exp_avg"].clone() for i in sorted(opt)],
                "step": trainer.step, "world": trainer.dist.world, "rank": trainer.dist.rank},
               Path(dump) / f"rank{rank}.pt")
    dist.destroy_process_group()


def test_ranks_stay_in_sync(work, out1, tmp_path, monkeypatch):
    import torch.multiprocessing as mp

    for k in DIST_ENV:
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    cfg = dict(target=str(work / "target"), data=[str(work / "data.jsonl")], out=str(tmp_path / "run"),
               variant="eagle3.1", ttt_steps=2, max_steps=STEPS, lr=1e-2, batch_tokens=48, grad_accum=1,
               dtype="float64", eval_prompts=0, progress=False, log_every=1)
    mp.start_processes(_rank_worker, args=(2, free_port(), cfg, str(tmp_path)), nprocs=2, start_method="spawn")
    s0, s1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in (0, 1))
    assert (s0["rank"], s1["rank"], s0["world"], s1["world"]) == (0, 1, 2, 2)
    assert s0["step"] == s1["step"] == STEPS
    for k in s0["drafter"]:
        assert torch.equal(s0["drafter"][k], s1["drafter"][k]), k  # all-reduced grads: bit-identical
    assert all(torch.equal(a, b) for a, b in zip(s0["exp_avg"], s1["exp_avg"]))
    # ... and equal to the one-process, grad-accum-2 drafter (the saved keys of the final drafter).
    w1 = weights(out1)
    assert max_diff(w1, {k: s0["drafter"][k] for k in w1}) < 1e-10
