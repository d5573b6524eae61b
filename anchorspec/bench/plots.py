"""Benchmark pictures, one PNG per temperature: tau per workload and drafter, speedup per workload
and method (the baseline's 1.0 drawn as a line), and acceptance against draft depth per group."""

from __future__ import annotations

from pathlib import Path

from .report import drafters, ordered


def plot_summary(summary: dict, out_dir: str | Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    names = drafters(summary)
    others = [m for m in summary["methods"][1:]]
    for t, block in summary["temperatures"].items():
        workloads = ordered(block["workloads"])
        fig, axes = plt.subplots(1, 3, figsize=(19, 5.2), gridspec_kw={"width_ratios": [2, 2, 1]})
        _bars(axes[0], workloads, names, lambda w, m: block["workloads"][w].get(m, {}).get("tau"))
        axes[0].set_title(f"tau (tokens per verification), T={t}")
        _bars(axes[1], workloads, others, lambda w, m: block["workloads"][w].get(m, {}).get("median_speedup"))
        axes[1].axhline(1.0, color="black", lw=0.8)
        axes[1].set_title(f"speedup over {summary['methods'][0]} (median, paired per prompt), T={t}")
        ax = axes[2]
        for m in names:
            for g in ordered(block["groups"]):
                acc = block["groups"][g].get(m, {}).get("acceptance_per_depth")
                if acc:
                    ax.plot(range(1, len(acc) + 1), acc, marker="o", label=f"{m} {g}")
        depth = max((len(c.get("acceptance_per_depth") or []) for g in block["groups"].values() for c in g.values()),
                    default=1)
        ax.set_xticks(range(1, depth + 1))
        ax.set_xlabel("draft depth")
        ax.set_ylabel("P(accepted | parent accepted)")
        ax.set_ylim(0, 1)
        ax.set_title("acceptance per depth")
        ax.legend(fontsize=7)
        fig.tight_layout()
        path = Path(out_dir) / f"bench-T{t}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


def _bars(ax, workloads, methods, value):
    width = 0.8 / max(len(methods), 1)
    for i, m in enumerate(methods):
        ys = [value(w, m) or 0.0 for w in workloads]
        ax.bar([x + i * width for x in range(len(workloads))], ys, width, label=m)
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(workloads))])
    ax.set_xticklabels(workloads, rotation=40, ha="right", fontsize=8)
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
