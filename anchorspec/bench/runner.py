"""The benchmark loop: every method on the same prompt, back to back, in an order that rotates per
prompt so machine noise (clock, caches, other processes) hits all methods alike.

One record per (workload, prompt, turn, temperature, method), appended to `records.jsonl` as soon
as the prompt's methods are done, so a killed run resumes where it stopped (`resume=True`); the
first line holds the settings, and a resume with other settings is refused. Multi-turn prompts
(MT-bench) continue with the baseline's answer, so every method sees the same history.
"""

from __future__ import annotations

import gc
import json
import os
import zlib
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from ..errors import AnchorspecError
from ..progress import progress_bar
from .methods import Method
from .workloads import Prompt, encode

WARMUP_TOKENS = 16


@contextmanager
def frozen_heap() -> Iterator[None]:
    """Inside, gc.collect() walks only the objects made since entering: the loop collects before every timed run
    (so that no collection lands inside one method's time), and a full collection of a process holding torch,
    transformers and a model took 0.2 s (120 of them were 24 of a tiny bench's 31 s; 2-core AMX Xeon)."""
    gc.collect()
    gc.freeze()  # what is alive now is never garbage of the runs: leave it out of their collections
    try:
        yield
    finally:
        gc.unfreeze()


def _key(workload: str, prompt_id: str, turn: int, temperature: float) -> str:
    return f"{workload}|{prompt_id}|{turn}|{temperature:g}"


def _read_records(path: Path, settings: dict) -> dict[str, list[dict]]:
    """Complete groups of an earlier run with the same settings; a half-written tail is dropped."""
    lines = path.read_text().splitlines()
    if not lines:
        return {}
    try:
        header = json.loads(lines[0])
    except json.JSONDecodeError as exc:
        raise AnchorspecError(f"{path}: unreadable first line; delete it to start over") from exc
    if header.get("settings") != settings:
        raise AnchorspecError(f"{path} was written with other settings ({header.get('settings')}); "
                              "use another --out or drop --resume")
    groups: dict[str, list[dict]] = {}
    for line in lines[1:]:
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            break  # a line cut by a crash: the group is redone
        groups.setdefault(rec["key"], []).append(rec)
    want = len(settings["methods"])
    return {k: v for k, v in groups.items() if len(v) == want}


def _write(path: Path, header: dict, groups: dict[str, list[dict]]) -> None:
    """Rewrite the records file with only complete groups (temp file + rename)."""
    tmp = path.with_suffix(".tmp")
    with open(tmp, "w") as f:
        f.write(json.dumps(header) + "\n")
        for recs in groups.values():
            for rec in recs:
                f.write(json.dumps(rec) + "\n")
    os.replace(tmp, path)


def run_benchmark(methods: Sequence[Method], prompts: Sequence[Prompt], tokenizer, *, temperatures: Sequence[float],
                  max_new_tokens: int, out_dir: str | Path, settings: dict, resume: bool = False,
                  progress: bool = True) -> list[dict]:
    if not methods or methods[0].kind != "baseline":
        raise AnchorspecError("the first method must be the baseline (HF generate)")
    names = [m.name for m in methods]
    if len(set(names)) != len(names):
        raise AnchorspecError(f"method names must be unique, got {names}")
    settings = dict(settings, methods=names, temperatures=[float(t) for t in temperatures],
                    max_new_tokens=max_new_tokens)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "records.jsonl"
    header = {"settings": settings}
    if path.exists() and not resume:
        raise AnchorspecError(f"{path} exists; pass --resume to continue it or choose another --out")
    done = _read_records(path, settings) if path.exists() else {}
    _write(path, header, done)

    baseline = methods[0]
    if len(done) < sum(len(p.turns) for p in prompts) * len(temperatures):
        for m in methods:  # warm-up: first-call allocations and kernel selection, untimed
            for t in temperatures:
                m.run(encode(tokenizer, prompts[0], []), WARMUP_TOKENS, t, seed=0)

    total = sum(len(p.turns) for p in prompts) * len(temperatures)
    bar = progress_bar(total=total, desc="bench", unit="gen", dynamic_ncols=True, disable=not progress)
    records: list[dict] = []
    rotation = 0
    with open(path, "a") as f, frozen_heap():
        for prompt in prompts:
            answers: list[str] = []
            for turn in range(len(prompt.turns)):
                ids = encode(tokenizer, prompt, answers)
                history_answer = None
                for temperature in temperatures:
                    key = _key(prompt.workload, prompt.id, turn, temperature)
                    group = done.get(key)
                    if group is None:
                        group = _run_group(methods, rotation, ids, max_new_tokens, temperature, key, prompt, turn)
                        for rec in group:
                            f.write(json.dumps(rec) + "\n")
                        f.flush()
                        os.fsync(f.fileno())
                    rotation += 1
                    records.extend(group)
                    if history_answer is None:  # the first temperature's baseline answer continues the chat
                        base = next(r for r in group if r["method"] == baseline.name)
                        history_answer = tokenizer.decode(base["tokens"], skip_special_tokens=True)
                    bar.update(1)
                    bar.set_postfix_str(prompt.workload)
                answers.append(history_answer)
    bar.close()
    return records


def _run_group(methods, rotation, ids, max_new, temperature, key, prompt: Prompt, turn: int) -> list[dict]:
    order = list(methods[rotation % len(methods):]) + list(methods[: rotation % len(methods)])
    seed = zlib.crc32(key.encode())  # the same seed for every method on this prompt
    runs = {}
    for m in order:
        gc.collect()
        runs[m.name] = m.run(ids, max_new, temperature, seed)
    base = runs[methods[0].name]
    recs = []
    for m in methods:
        r = runs[m.name]
        recs.append({
            "key": key, "workload": prompt.workload, "prompt_id": prompt.id, "turn": turn,
            "temperature": float(temperature), "method": m.name, "kind": m.kind, "prompt_tokens": len(ids),
            "new_tokens": len(r.tokens), "seconds": r.seconds, "tokens_per_s": len(r.tokens) / r.seconds,
            "speedup": (len(r.tokens) / r.seconds) / (len(base.tokens) / base.seconds),
            "identical_to_baseline": r.tokens == base.tokens, "peak_mib": r.peak_mib,
            "stats": r.stats.to_dict() if r.stats is not None else None, "tokens": r.tokens,
        })
    return recs
