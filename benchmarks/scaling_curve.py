"""The drafters' scaling curve: MT-bench tau against training token-steps, one point per release round.

    python3 benchmarks/scaling_curve.py                      # reads and writes benchmarks/results/scaling/
    python3 benchmarks/scaling_curve.py --add 3 eagle3 1.2e6 1.1e6 1.61   # record a round's point

Prints a markdown table and a log-linear fit tau = a + b * log10(token-steps) per variant, and the
token-steps at which the fit would reach tau 3 (a straight-line guess from few points: it says how far
off the goal is in orders of magnitude, not when it will be met). Writes a PNG with the public points.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent / "results" / "scaling"
DEFAULT = HERE / "smollm2-135m-instruct.json"


def fit(points: list[dict]) -> tuple[float, float] | None:
    """Least squares tau = a + b * log10(tokens); None with fewer than two distinct token counts."""
    xs = [math.log10(p["tokens"]) for p in points]
    ys = [p["tau"] for p in points]
    if len(set(xs)) < 2:
        return None
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return my - b * mx, b


def table(data: dict) -> str:
    rows = ["| round | variant | token-steps (cumulative) | regenerated tokens seen | MT-bench tau |",
            "|---|---|---|---|---|"]
    for p in sorted(data["points"], key=lambda p: (p["round"], p["variant"])):
        rows.append(f"| {p['round']} | {p['variant']} | {p['tokens'] / 1e6:.2f}M | {p['regenerated'] / 1e6:.2f}M "
                    f"| {p['tau']:.2f} |")
    return "\n".join(rows)


def plot(data: dict, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for variant, color in (("eagle3", "tab:blue"), ("eagle3.1", "tab:orange")):
        pts = sorted((p for p in data["points"] if p["variant"] == variant), key=lambda p: p["tokens"])
        if not pts:
            continue
        ax.plot([p["tokens"] for p in pts], [p["tau"] for p in pts], "o-", color=color, label=variant)
        f = fit(pts)
        if f:
            xs = [pts[0]["tokens"], 1e8]
            ax.plot(xs, [f[0] + f[1] * math.log10(x) for x in xs], ":", color=color, alpha=0.6)
    for q in data.get("public", []):
        ax.plot([q["regenerated"]] * 2, [q["tau_lo"], q["tau_hi"]], color="gray", lw=4, alpha=0.5)
        ax.annotate(q["label"], (q["regenerated"], q["tau_hi"]), fontsize=7, color="gray", ha="right",
                    xytext=(-6, 2), textcoords="offset points")
    ax.axhline(3.0, color="green", lw=0.8, ls="--")
    ax.text(7e5, 3.03, "goal tau 3", fontsize=7, color="green")
    ax.set_xscale("log")
    ax.set_xlabel("training token-steps (ours) / regenerated tokens (public)")
    ax.set_ylabel("MT-bench tau (T=0, tree 4,4,16)")
    ax.set_title("SmolLM2-135M-Instruct drafters: tau against training data (dotted: log-linear fit)")
    ax.title.set_fontsize(9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)


def write_json(path: Path, data: dict) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps(data, indent=1) + "\n")
    os.replace(tmp, path)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", type=Path, default=DEFAULT, help="the points file (JSON)")
    ap.add_argument("--png", type=Path, help="plot path (default: next to --data)")
    ap.add_argument("--add", nargs=5, metavar=("ROUND", "VARIANT", "TOKENS", "REGENERATED", "TAU"),
                    help="record one point (replaces the same round and variant)")
    args = ap.parse_args(argv)
    data = json.loads(args.data.read_text())
    if args.add:
        r, variant, tokens, regen, tau = args.add
        if variant not in ("eagle3", "eagle3.1"):
            ap.error(f"variant must be eagle3 or eagle3.1, got {variant!r}")
        point = {"round": int(r), "variant": variant, "tokens": int(float(tokens)),
                 "regenerated": int(float(regen)), "tau": float(tau)}
        data["points"] = [p for p in data["points"] if (p["round"], p["variant"]) != (point["round"], variant)]
        data["points"].append(point)
        write_json(args.data, data)
    print(table(data))
    for variant in ("eagle3", "eagle3.1"):
        f = fit([p for p in data["points"] if p["variant"] == variant])
        if f and f[1] > 0:
            need = 10 ** ((3.0 - f[0]) / f[1])
            print(f"{variant}: tau = {f[0]:.2f} + {f[1]:.3f} * log10(token-steps); tau 3 at ~{need:.1e} token-steps "
                  f"if the line held")
        elif f:
            print(f"{variant}: tau = {f[0]:.2f} + {f[1]:.3f} * log10(token-steps): no upward trend to extrapolate")
    png = args.png or args.data.with_suffix(".png")
    plot(data, png)
    print(f"plot: {png}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
