"""The training picture: loss and learning rate, per-step accuracy and tau over optimizer steps (from metrics.jsonl)."""

from __future__ import annotations

import json
from pathlib import Path


def read_metrics(path) -> tuple[list[dict], list[dict]]:
    """(training records, evaluation records) from a metrics.jsonl; unreadable lines are skipped."""
    train, evals = [], []
    for line in Path(path).read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        (evals if "eval" in rec else train).append(rec)
    return train, evals


def plot_training(metrics_path, png_path, title: str = "TTT training") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train, evals = read_metrics(metrics_path)
    if not train:
        return
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    steps = [r["step"] for r in train]
    if "expected_accept_len" in train[-1]:  # --stage accept: the loss is -E, plot E itself
        axes[0].plot(steps, [r["expected_accept_len"] for r in train])
        axes[0].set(title="expected accepted length of own chains (train)", xlabel="step")
    else:
        axes[0].plot(steps, [r["loss"] for r in train])
        axes[0].set(title="train loss (sum of 0.8^k-weighted steps)", xlabel="step", yscale="log")
    if "lr" in train[-1]:  # a re-warmed learning rate shows as a dip in accuracy: draw the schedule beside it
        lr_axis = axes[0].twinx()
        lr_axis.plot(steps, [r["lr"] for r in train], color="tab:gray", linestyle="--", linewidth=1)
        lr_axis.set_ylabel("learning rate (dashed)", color="tab:gray")
        lr_axis.set_ylim(bottom=0)
    K = len(train[-1]["acc_per_step"])
    cmap = plt.get_cmap("viridis")
    for k in range(K):
        axes[1].plot(steps, [r["acc_per_step"][k] for r in train], color=cmap(k / max(1, K - 1)), label=f"step {k}")
    if evals:
        for k in range(K):
            axes[1].plot([e["step"] for e in evals], [e["eval"]["heldout_acc"][k] for e in evals], "o",
                         color=cmap(k / max(1, K - 1)), markersize=4)
    # zoomed to the figures: a round continuing a good drafter moves them by a point or two, invisible on 0..1
    shown = [a for r in train for a in r["acc_per_step"]] + [a for e in evals for a in e["eval"]["heldout_acc"]]
    low, high = min(shown), max(shown)
    pad = max(0.02, 0.1 * (high - low))
    axes[1].set(title="accuracy per TTT step (lines: train, dots: held-out)", xlabel="step",
                ylim=(max(0.0, low - pad), min(1.0, high + pad)))
    axes[1].legend(fontsize=7, ncol=2)
    axes[2].plot(steps, [r["train_sim_tau"] for r in train], alpha=0.5, label="simulated tau (train)")
    if evals:
        es = [e["step"] for e in evals]
        axes[2].plot(es, [e["eval"]["sim_tau"] for e in evals], "o-", label="simulated tau (held-out)")
        if "gen_tau" in evals[0]["eval"]:
            axes[2].plot(es, [e["eval"]["gen_tau"] for e in evals], "s-", label="generate tau (tree, held-out prompts)")
        if "replay_tau" in evals[0]["eval"]:
            axes[2].plot(es, [e["eval"]["replay_tau"] for e in evals], "^-", label="replay tau (tree, held-out answers)")
    axes[2].set(title="acceptance length tau", xlabel="step")
    axes[2].legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    tmp = Path(png_path).with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    tmp.replace(png_path)
