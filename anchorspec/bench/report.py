"""Benchmark records -> per-cell figures, the drafter tau ratios, and a Markdown report.

A cell is (temperature, workload, method). Figures per cell: tau and acceptance per depth (stats
merged over its generations, so long answers weigh more, as in EAGLE's tau), median tokens/s, the
speedup over the baseline paired per prompt (median and mean), how many outputs equal the
baseline's token for token, and the peak memory. Groups (standard, templates, long) pool their
workloads the same way.
"""

from __future__ import annotations

import statistics
from collections import defaultdict

from ..metrics import GenerationStats
from .workloads import GROUPS, group_of


def _cell(records: list[dict]) -> dict:
    stats = None
    for r in records:
        if r["stats"] is not None:
            s = GenerationStats.from_dict(r["stats"])
            stats = s if stats is None else stats.merge(s)
    peaks = [r["peak_mib"] for r in records if r["peak_mib"] is not None]
    return {
        "generations": len(records),
        "mean_prompt_tokens": statistics.fmean(r["prompt_tokens"] for r in records),
        "new_tokens": sum(r["new_tokens"] for r in records),
        "tau": round(stats.tau, 4) if stats else None,
        "acceptance_per_depth": [round(a, 4) for a in stats.acceptance_per_depth] if stats else None,
        "median_tokens_per_s": round(statistics.median(r["tokens_per_s"] for r in records), 3),
        "median_speedup": round(statistics.median(r["speedup"] for r in records), 4),
        "mean_speedup": round(statistics.fmean(r["speedup"] for r in records), 4),
        "identical_to_baseline": sum(r["identical_to_baseline"] for r in records),
        "peak_mib": round(max(peaks), 1) if peaks else None,
    }


def summarize(records: list[dict]) -> dict:
    """{"temperatures": {T: {"workloads": {w: {m: cell}}, "groups": {g: {m: cell}}}}, "methods": [...]}."""
    by_cell: dict = defaultdict(list)
    by_group: dict = defaultdict(list)
    methods: list[str] = []
    kinds: dict[str, str] = {}
    for r in records:
        t = f"{r['temperature']:g}"
        by_cell[(t, r["workload"], r["method"])].append(r)
        by_group[(t, group_of(r["workload"]), r["method"])].append(r)
        if r["method"] not in methods:
            methods.append(r["method"])
            kinds[r["method"]] = r["kind"]
    out: dict = {"methods": methods, "kinds": kinds, "temperatures": {}}
    for (t, w, m), recs in by_cell.items():
        block = out["temperatures"].setdefault(t, {"workloads": {}, "groups": {}})
        block["workloads"].setdefault(w, {})[m] = _cell(recs)
    for (t, g, m), recs in by_group.items():
        out["temperatures"][t]["groups"].setdefault(g, {})[m] = _cell(recs)
    out["tau_ratios"] = tau_ratios(out)
    return out


def drafters(summary: dict) -> list[str]:
    return [m for m in summary["methods"] if summary["kinds"][m] == "drafter"]


def tau_ratios(summary: dict) -> dict:
    """tau of every later drafter over the first drafter's, per temperature, group and workload."""
    names = drafters(summary)
    if len(names) < 2:
        return {}
    ref = names[0]
    out: dict = {}
    for t, block in summary["temperatures"].items():
        for level in ("groups", "workloads"):
            for name, cells in block[level].items():
                if ref in cells and cells[ref]["tau"]:
                    for other in names[1:]:
                        if other in cells and cells[other]["tau"]:
                            out.setdefault(t, {}).setdefault(f"{other}/{ref}", {})[name] = round(
                                cells[other]["tau"] / cells[ref]["tau"], 4)
    return out


def ordered(names) -> list[str]:
    """Workload and group names in the order of GROUPS (unknown names last)."""
    ranked = [w for g in GROUPS.values() for w in g] + list(GROUPS)
    return sorted(names, key=lambda n: ranked.index(n) if n in ranked else len(ranked))


def markdown(summary: dict, environment: dict | None = None) -> str:
    lines = []
    if environment:
        lines.append(f"Target {environment.get('target')}, {environment.get('dtype')}, "
                     f"{environment.get('threads')} thread(s), {environment.get('device', 'cpu')}; "
                     f"{environment.get('max_new_tokens')} new tokens at most; baseline: {summary['methods'][0]}.")
        shapes = environment.get("drafter_shapes") or {}
        if shapes:
            lines.append("Draft shapes (top_k,depth,total): " + ", ".join(f"{n} {s}" for n, s in shapes.items()) + ".")
        lines.append("")
    for t, block in summary["temperatures"].items():
        lines.append(f"### Temperature {t}\n")
        lines.append("| workload | method | tau | acceptance per depth | tok/s (median) | speedup median / mean | "
                     "same tokens as baseline | prompt tokens | peak MiB |")
        lines.append("|---|---|---|---|---|---|---|---|---|")
        for level in ("workloads", "groups"):
            for w in ordered(block[level]):
                for m in summary["methods"]:
                    c = block[level][w].get(m)
                    if c is None:
                        continue
                    acc = " ".join(f"{a:.2f}" for a in c["acceptance_per_depth"]) if c["acceptance_per_depth"] else "-"
                    tau = f"{c['tau']:.2f}" if c["tau"] else "-"
                    peak = f"{c['peak_mib']:.0f}" if c["peak_mib"] else "-"
                    label = f"**{w} (all)**" if level == "groups" else w
                    lines.append(f"| {label} | {m} | {tau} | {acc} | {c['median_tokens_per_s']:.1f} | "
                                 f"{c['median_speedup']:.2f}x / {c['mean_speedup']:.2f}x | "
                                 f"{c['identical_to_baseline']}/{c['generations']} | "
                                 f"{c['mean_prompt_tokens']:.0f} | {peak} |")
        lines.append("")
        for pair, ratios in summary["tau_ratios"].get(t, {}).items():
            lines.append(f"tau ratio {pair} at T={t}: " + ", ".join(
                f"{name} {ratios[name]:.2f}" for name in ordered(ratios)) + "\n")
    return "\n".join(lines)
