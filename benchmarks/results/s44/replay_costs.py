"""Replays paired_trace.py's steps through fresh StreamMonitors, costs kept as measured (session 43) and
at the stream's pace (session 44), and prints how each prices the explored shape against the stream's at
every prompt, beside the truth: each explored step's time over its neighbouring steps' (the median of
the PACE_WINDOW steps of the stream's shape before it), median over the run.

    python benchmarks/results/s44/replay_costs.py benchmarks/results/s44/paired-trace-1.json"""
import json, statistics, sys
from anchorspec.decode.fallback import PACE_WINDOW, StreamMonitor
from anchorspec.decode.tree import TreeShape

TREE, CHAIN = TreeShape(4, 4, 16), TreeShape.chain(4)
steps = json.load(open(sys.argv[1]))
report = {}
for pattern, (current, other) in {"chain-explores-tree": (CHAIN, TREE), "tree-explores-chain": (TREE, CHAIN)}.items():
    run = [s for s in steps if s["pattern"] == pattern]
    full = [s for s in run if s["kind"] == "speculative" and not s["catch_up"]]
    paired, recent = [], []
    for s in full:
        if s["shape"] == f"{current.top_k},{current.depth},{current.total_tokens}":
            recent = (recent + [s["step_s"]])[-PACE_WINDOW:]
        elif len(recent) == PACE_WINDOW:
            paired.append(s["step_s"] / statistics.median(recent))
    truth = statistics.median(paired)
    if current == TREE:
        truth = 1 / truth  # every ratio below: the tree's step over chain 4's
    row = {"truth": truth, "explored_steps": len(paired)}
    for name, follow in (("as measured", False), ("pace", True)):
        m = StreamMonitor()
        m.follow_pace, m.shape = follow, current
        m.verify.add(1, 0.05)  # a plain step: cancels in every ratio below
        estimates, prompt = [], None
        for s in run:
            if s["prompt"] != prompt:
                if prompt is not None and m.relative_step_cost(TREE) and m.relative_step_cost(CHAIN):
                    estimates.append(m.relative_step_cost(TREE) / m.relative_step_cost(CHAIN))
                prompt = s["prompt"]
            shape = TreeShape.parse(s["shape"]) if s["shape"] else None
            m.observe_step(s["kind"], s["tokens"], s["depth"], 0, s["step_s"], s["draft_s"], s["catch_up"],
                           top_ranked=None, shape=shape)
        errors = sorted(abs(e / truth - 1) for e in estimates[4:])  # from the 5th prompt: both measured
        row[name] = {"range": [min(estimates[4:]), max(estimates[4:])], "median_error": statistics.median(errors),
                     "worst_error": errors[-1], "estimates": estimates}
    report[pattern] = row
    print(f"{pattern}: truth (tree over chain 4) {truth:.3f} from {len(paired)} explored steps")
    for name in ("as measured", "pace"):
        r = row[name]
        print(f"  {name:12s} estimates {r['range'][0]:.3f}-{r['range'][1]:.3f}, median error {r['median_error']:.1%}, "
              f"worst {r['worst_error']:.1%}")
json.dump(report, open(sys.argv[1].replace(".json", "-replay.json"), "w"), indent=1)

import matplotlib  # noqa: E402
matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

fig, axes = plt.subplots(1, 2, figsize=(11, 3.8), sharey=True)
for ax, (pattern, row) in zip(axes, report.items()):
    for name, style in (("as measured", "o-"), ("pace", "s-")):
        ax.plot(range(1, len(row[name]["estimates"]) + 1), row[name]["estimates"], style, ms=3, label=name)
    ax.axhline(row["truth"], color="k", lw=1, ls="--", label="neighbour ratio (truth)")
    ax.set_title(pattern)
    ax.set_xlabel("prompt")
axes[0].set_ylabel("tree step cost / chain-4 step cost")
axes[0].legend(fontsize=8)
fig.tight_layout()
fig.savefig(sys.argv[1].replace(".json", "-replay.png"), dpi=110)
