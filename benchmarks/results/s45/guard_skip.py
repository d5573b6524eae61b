"""What dynamo's guard checks cost a compiled plain step ("TorchDynamo Cache Lookup", ~2.3 ms a token in
step-profile-compiled-unfused.txt): the compiled plain loop timed with guards evaluated as usual and under
torch.compiler.set_stance(skip_guard_eval_unsafe=True) (only the guards that tell cached graphs apart),
alternating, 5 rounds; median ms a token. bf16 (--dtype auto here), 2 threads, MT-bench's first prompt.

    python benchmarks/results/s45/guard_skip.py"""
import statistics, sys, time
from pathlib import Path
import torch
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # benchmarks/
from bench_core import DEFAULT_DATA, load_prompts  # noqa: E402
from anchorspec import load  # noqa: E402

e = load("smollm2-135m-instruct", dtype="auto", threads=2, compile=True)
ids = e.encode(load_prompts(DEFAULT_DATA, 1)[0]["text"], chat=True)
ref = e.generate(ids, max_new_tokens=128, speculative=False).token_ids
ms = {"guards": [], "skip": []}
for _ in range(5):
    for arm in ms:
        with torch.compiler.set_stance("default", skip_guard_eval_unsafe=arm == "skip"):
            t0 = time.perf_counter()
            out = e.generate(ids, max_new_tokens=128, speculative=False).token_ids
            ms[arm].append((time.perf_counter() - t0) / len(out) * 1e3)
        assert out == ref, arm
for arm, v in ms.items():
    print(f"{arm:7s} {statistics.median(v):.1f} ms a token (min {min(v):.1f}, max {max(v):.1f}); outputs equal: yes")
