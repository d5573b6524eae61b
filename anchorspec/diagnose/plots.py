"""The attention-drift picture: one line per drafter over draft depth (EAGLE-3 vs EAGLE-3.1 side by side)."""

from __future__ import annotations

from pathlib import Path

PANELS = (  # (result key, title, y limits); None = log scale: EAGLE-3's raw state can grow by decades
    ("attn_sink", "attention on the first {sink} tokens (sink)", (0, 1)),
    ("attn_own", "attention on its own drafts", (0, 1)),
    ("hidden_rms", "RMS of the fed-back hidden state (dashed: raw h)", None),
    ("acceptance", "cumulative acceptance (drafts 1..d right)", (0, 1)),
)


def _y(values):
    return [float("nan") if v is None else v for v in values]  # None = no samples reached there


def plot_drift(results: dict, png_path) -> None:
    """results: drafter name -> measure_drift() result."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(PANELS), figsize=(4.2 * len(PANELS), 3.8))
    colors = plt.get_cmap("tab10")
    sink = next(iter(results.values()))["config"]["sink_tokens"] if results else "?"
    for i, (name, res) in enumerate(results.items()):
        color = colors(i % 10)
        label = f"{name} ({res['config']['variant']}, n={res['num_samples']})"
        for ax, (key, _title, _lim) in zip(axes, PANELS):
            ax.plot(res["depth"], _y(res[key]), "o-", color=color, label=label, markersize=4)
        axes[2].plot(res["depth"], _y(res["raw_hidden_rms"]), "--", color=color, alpha=0.6)
    for ax, (_key, title, lim) in zip(axes, PANELS):
        ax.set(title=title.format(sink=sink), xlabel="draft depth d")
        if lim:
            ax.set_ylim(*lim)
        else:
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
    axes[-1].legend(fontsize=8)
    fig.suptitle("attention drift along a greedy draft chain")
    fig.tight_layout()
    tmp = Path(png_path).with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    tmp.replace(png_path)
