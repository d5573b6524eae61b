"""Session 77: two rules of the server's monitor at sixteen rows, in process as probe_rounds.py measures rounds.
`--compare doublings`: forced probes every max_retry_after rounds (probe_doublings 0, the rule before) or with the
wait doubled by each futile one (PROBE_DOUBLINGS). `--compare evidence` (both with the doubling): the whole batch
turned speculative by one probe's lengths (whole_batch_evidence False, the rule before) or only on as many pooled
lengths as it has rows (not kept: run it with whole-batch-evidence.patch, beside this script, applied).

A drafter scheduler (round-24 release with its lookup chain, bf16 AOT, 1 thread) first serves WARM requests one at a
time (its global window then holds one-user steps, as a server's does after quiet hours), then REQUESTS MT-bench first
turns with 16 in flight (T=0, 128 tokens). The two rules alternate over REPEATS pairs; each run reports tok/s over the
16-row stretch and the rounds in which rows speculated.

    python benchmarks/results/s77/probe_backoff.py --out benchmarks/results/s77/probe-backoff.json
    python benchmarks/results/s77/probe_backoff.py --compare evidence --out benchmarks/results/s77/probe-evidence.json
"""
import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import probe_rounds  # noqa: E402
from probe_rounds import DATA, DRAFTER  # noqa: E402

from anchorspec.api import load  # noqa: E402
from anchorspec.decode.fallback import PROBE_DOUBLINGS, DriftMonitor  # noqa: E402


def run(engine, warm, prompts, rule, max_tokens: int) -> dict:
    """`rule`: ("doublings", n) or ("evidence", whole_batch_evidence)."""
    monitor = DriftMonitor()
    if rule[0] == "doublings":
        monitor.probe_doublings = rule[1]
    else:
        monitor.whole_batch_evidence = rule[1]
    rounds: list = []
    wall = probe_rounds.run(engine, prompts, True, max_tokens, rounds, monitor=monitor, warm=warm)
    spec = [r["seconds"] for r in rounds if r["speculating"]]
    return {rule[0]: rule[1], "tok_s": len(prompts) * max_tokens / wall, "wall_s": wall, "rounds": len(rounds),
            "speculating_rounds": len(spec), "speculating_s": sum(spec), "probes_skipped": monitor.probes_skipped,
            "global_tau": monitor.global_tau, "switches_on": monitor.switches_on}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--requests", type=int, default=128)
    p.add_argument("--warm", type=int, default=4)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--compare", choices=["doublings", "evidence"], default="doublings")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    torch.set_num_threads(1)
    engine = load("smollm2-135m-instruct", str(DRAFTER), "auto", threads=1, compile="auto")
    turns = [json.loads(line)["turns"][0] for line in DATA.read_text().splitlines()]
    ids = [engine.encode_chat([{"role": "user", "content": t}]) for t in turns]
    warm, prompts = ids[-args.warm:], [ids[i % (len(ids) - args.warm)] for i in range(args.requests)]
    runs = []
    old, new = (0, PROBE_DOUBLINGS) if args.compare == "doublings" else (False, True)
    for rep in range(args.repeats):
        for value in ((old, new) if rep % 2 == 0 else (new, old)):
            runs.append(run(engine, warm, prompts, (args.compare, value), args.max_tokens))
            print(json.dumps(runs[-1]), file=sys.stderr)
    by = {value: [r for r in runs if r[args.compare] == value] for value in (old, new)}
    summary = {str(value): {"tok_s_median": statistics.median(r["tok_s"] for r in rs),
                            "speculating_share": statistics.median(r["speculating_s"] / r["wall_s"] for r in rs)}
               for value, rs in by.items()}
    summary["ratio"] = summary[str(new)]["tok_s_median"] / summary[str(old)]["tok_s_median"]
    print(json.dumps(summary, indent=1))
    Path(args.out).write_text(json.dumps({"config": vars(args), "dtype": str(engine.target.dtype), "runs": runs,
                                          "summary": summary}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
