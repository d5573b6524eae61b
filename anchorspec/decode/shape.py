"""Choosing the draft shape from this machine's measured costs and this drafter's measured acceptance.

Expected speed of a shape s (tokens per second of a speculative step):

    tokens/s(s) = tau(s) / (t_draft(s) + t_verify(N_s))

  tau(s)        mean accepted length (+1 bonus) per step at temperature 0, measured by *replay*: the
                target's greedy answers to calibration prompts are known, so a draft of shape s made at
                any point accepts exactly its longest root path that spells the answer's next tokens.
                The replay walks each answer as generation would (advance by the accepted length + 1),
                using the target's features of the answer (one forward per prompt), so it costs
                drafter passes only, not a verification per shape.
  t_draft(s)    measured during the replay (proposer update + propose).
  t_verify(N)   one tree-verification forward over N tokens after a context as long as the
                calibration's mean, timed on this machine (median of repeats).

Plain decoding runs at 1 / t_plain; a shape is worth using only if it beats that. The chosen shape
and the whole table go to a JSON profile keyed by target, drafter, dtype, threads and CPU, which
`generate` and `serve` use by default when it exists.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from ..atomic import atomic_write_text
from ..errors import AnchorspecError
from ..metrics import GenerationStats
from ..models.hub import cache_home
from ..models.target import Target
from .batch import BatchKV, batch_forward
from .propose import EagleProposer
from .sampling import SamplingParams
from .tree import DraftTree, TreeShape

CANDIDATES = (
    [TreeShape.chain(k) for k in range(1, 7)]
    + [TreeShape(*s) for s in ((2, 3, 6), (2, 4, 8), (2, 5, 12), (2, 6, 16), (4, 3, 8), (4, 4, 12), (4, 4, 16),
                               (4, 5, 24), (4, 6, 32), (8, 4, 16), (8, 5, 32), (8, 6, 48), (10, 7, 60))]
)
GREEDY = SamplingParams()


@dataclass
class ShapeEstimate:
    shape: tuple[int, int, int]  # (top_k, depth, total_tokens)
    tau: float
    acceptance_per_depth: list[float]
    draft_s: float
    verify_s: float

    @property
    def step_s(self) -> float:
        return self.draft_s + self.verify_s

    @property
    def tokens_per_s(self) -> float:
        return self.tau / self.step_s


def accepted_length(tree: DraftTree, answer: list[int]) -> int:
    """Greedy acceptance of `tree` against the known continuation `answer` (the tokens after the root):
    the depth of the deepest node whose root path spells answer[:depth]."""
    best, frontier = 0, [0]
    for depth, token in enumerate(answer, start=1):
        frontier = [c for node in frontier for c in tree.children[node] if int(tree.tokens[c]) == token]
        if not frontier:
            break
        best = depth
    return best


@torch.inference_mode()
def captured_states(target: Target, sequence: torch.Tensor) -> torch.Tensor:
    """The target's captured (aux) states over a whole sequence: what `replay` feeds the drafter."""
    return target.forward(sequence, torch.arange(sequence.numel()), target.new_cache(), capture_aux=True).aux


@torch.inference_mode()
def replay(target: Target, proposer: EagleProposer, sequence: torch.Tensor, prompt_len: int,
           shape: TreeShape, roots: list | None = None, aux: torch.Tensor | None = None) -> GenerationStats:
    """Walk one greedy answer with drafts of `shape`: the steps, drafted and accepted tokens that
    greedy speculation would record (draft_s = the drafting time; no verification is run). With
    `roots`, each step appends (root position, accepted length, the drafted tree) to it. `aux`: the
    sequence's `captured_states`, when a caller walks it with several drafters."""
    aux = captured_states(target, sequence) if aux is None else aux
    proposer.reset()
    stats = GenerationStats()
    pos, fed = prompt_len, 0  # pos: index of the pending (root) token; fed: features given to the proposer
    while pos < sequence.numel() - 2:  # as in generation, the last token comes from a plain step
        answer = sequence[pos + 1:].tolist()
        step = shape.capped(len(answer) - 1)  # as the engine: never draft into the bonus token's slot
        t0 = time.perf_counter()
        proposer.update(sequence[:pos + 1], aux[fed:pos])
        tree = proposer.propose(step, GREEDY, None)
        stats.draft_s += time.perf_counter() - t0
        fed = pos
        n = accepted_length(tree, answer)
        stats.record_step(tree.depth, tree.size - 1, n)
        if roots is not None:
            roots.append((pos, n, tree))
        pos += n + 1
    return stats


@torch.inference_mode()
def verify_cost(target: Target, context: int, sizes: list[int], repeats: int = 9) -> tuple[dict[int, float], float]:
    """Median seconds of one tree-verification forward over N tokens after `context` tokens, per N,
    and of one plain decode step (1 token, no mask, no aux), on a one-slot cache as a solo
    generation runs them. The sizes take turns within each repeat, so a slow patch of the machine
    hits all of them alike."""
    ids = torch.arange(context) % target.vocab_size
    slot = BatchKV(slots=1, capacity=context + max(sizes, default=1)).attach_target(target)
    batch_forward(target, [slot], [DraftTree.chain(ids)], capture_aux=False, last_only=True)
    slot.commit(0, list(range(context)))  # rows past the context are scratch: every call overwrites them
    root = DraftTree(torch.tensor([1]), [-1])
    calls = {0: lambda: batch_forward(target, [slot], [root], capture_aux=False)}  # 0: the plain step
    for n in sorted(set(sizes)):
        tree = DraftTree(torch.arange(n) % target.vocab_size, [-1] + [(i - 1) // 4 for i in range(1, n)])
        calls[n] = lambda t=tree: batch_forward(target, [slot], [t])
    samples: dict[int, list[float]] = {n: [] for n in calls}
    for r in range(repeats + 2):  # two warm-up rounds
        for n, call in calls.items():
            t0 = time.perf_counter()
            call()
            dt = time.perf_counter() - t0
            if r >= 2:
                samples[n].append(dt)
    plain = statistics.median(samples.pop(0))
    return {n: statistics.median(v) for n, v in samples.items()}, plain


def estimate_shapes(target: Target, proposer: EagleProposer, sequences: list[tuple[torch.Tensor, int]],
                    shapes=CANDIDATES, progress=None) -> tuple[list[ShapeEstimate], float, int]:
    """Estimates for every shape from replays of `sequences` ((prompt + greedy answer, prompt length)),
    best first; also the plain step's seconds and the verification context used."""
    if not sequences:
        raise AnchorspecError("shape estimation needs at least one calibration prompt")
    context = int(statistics.fmean(seq.numel() for seq, _ in sequences))
    verify, plain = verify_cost(target, context, [s.total_tokens for s in shapes])
    out = []
    for shape in shapes:
        stats = GenerationStats()
        for seq, prompt_len in sequences:
            stats = stats.merge(replay(target, proposer, seq, prompt_len, shape))
        steps = max(stats.verify_steps, 1)
        out.append(ShapeEstimate((shape.top_k, shape.depth, shape.total_tokens), stats.tau or 1.0,
                                 stats.acceptance_per_depth, stats.draft_s / steps, verify[shape.total_tokens]))
        if progress is not None:
            progress.update(1)
    out.sort(key=lambda e: e.tokens_per_s, reverse=True)
    return out, plain, context


def tune(engine, prompts: list[list[int]], new_tokens: int, shapes=CANDIDATES, progress: bool = False):
    """Greedy answers to `prompts` with plain decoding, then estimate_shapes on them."""
    from ..progress import progress_bar
    from .engine import GenerationConfig, generate_vanilla

    if engine.proposer is None:
        raise AnchorspecError("tuning the draft shape needs a drafter")
    cfg = GenerationConfig(max_new_tokens=new_tokens, stop_token_ids=engine.stop_token_ids())
    sequences = []
    for ids in progress_bar(prompts, desc="greedy answers", unit="prompt", disable=not progress):
        answer = generate_vanilla(engine.target, ids, cfg).token_ids
        sequences.append((torch.tensor(list(ids) + answer, dtype=torch.long), len(ids)))
    with progress_bar(total=len(shapes), desc="replay shapes", unit="shape", disable=not progress) as bar:
        return estimate_shapes(engine.target, engine.proposer, sequences, shapes, progress=bar)


# --- the profile on disk ----------------------------------------------------------------------------

def profile_key(target_dir: str, drafter_dir: str, dtype: torch.dtype) -> dict:
    """What a profile is specific to: target, drafter, dtype, threads and CPU (costs and acceptance depend on
    all of them). `tune` stores it in the profile, so `generate` can say why a profile did not match."""
    return {"target": str(Path(target_dir).resolve()), "drafter": str(Path(drafter_dir).resolve()),
            "dtype": str(dtype), "threads": torch.get_num_threads(), "machine": platform.machine(),
            "cpus": os.cpu_count(), "cpu_capability": torch.backends.cpu.get_cpu_capability()}


def profile_path(target_dir: str, drafter_dir: str, dtype: torch.dtype) -> Path:
    """One profile per profile_key."""
    key = "|".join(str(v) for v in profile_key(target_dir, drafter_dir, dtype).values())
    return cache_home() / "shapes" / (hashlib.sha1(key.encode()).hexdigest()[:16] + ".json")


def profile_miss_reason(target_dir: str, drafter_dir: str, dtype: torch.dtype) -> str:
    """Why no tuned profile applies: none for this target and drafter, or the settings the existing ones have."""
    want = profile_key(target_dir, drafter_dir, dtype)
    others = []
    for path in sorted((cache_home() / "shapes").glob("*.json")):
        try:
            key = json.loads(path.read_text())["meta"]["key"]
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if (key.get("target"), key.get("drafter")) == (want["target"], want["drafter"]):
            others.append(", ".join(f"{name} {str(key.get(name)).removeprefix('torch.')}" for name in want
                                    if name not in ("target", "drafter") and key.get(name) != want[name]))
    here = f"dtype {want['dtype'].removeprefix('torch.')}, threads {want['threads']} on this CPU"
    if not others:
        return f"no tuned profile for this target and drafter ({here}); `anchorspec tune` makes one"
    return f"no tuned profile for {here}; this drafter was tuned with: {'; '.join(others)}"


def save_profile(path: Path, estimates: list[ShapeEstimate], plain_s: float, context: int, meta: dict) -> None:
    best = estimates[0]
    body = {"best": list(best.shape), "speculate": best.tokens_per_s > 1 / plain_s, "plain_tokens_per_s": 1 / plain_s,
            "context": context, "meta": meta,
            "estimates": [dict(asdict(e), tokens_per_s=e.tokens_per_s) for e in estimates]}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(body, indent=1) + "\n")
    os.replace(tmp, path)


def _files_stamp(directory: str) -> list:
    """Names, sizes and modification times of a checkpoint's weight files: a retrained drafter in
    the same folder is a new drafter."""
    folder = Path(directory)
    files = sorted(folder.glob("*.safetensors")) + sorted(folder.glob("*.bin")) if folder.is_dir() else []
    return [[f.name, f.stat().st_size, f.stat().st_mtime_ns] for f in files]


def costs_path(target_dir: str, drafter_dir: str, dtype: torch.dtype, variant: str) -> Path:
    """Where `generate` keeps what it learned about this target, drafter, dtype, weight layout
    (`variant`: packed, compiled) and machine: the step costs and the drafter's acceptance per depth
    (StreamMonitor.state), so the next process starts from them instead of a short calibration."""
    key = {**profile_key(target_dir, drafter_dir, dtype), "variant": variant,
           "torch": torch.__version__, "drafter_files": _files_stamp(drafter_dir)}
    digest = hashlib.sha1(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return cache_home() / "costs" / f"{digest}.json"


def load_costs(path: Path) -> dict | None:
    """The saved StreamMonitor state at `path`, or None (none yet, or unreadable: then the costs are
    measured again, which is all a damaged file costs)."""
    try:
        state = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return state if isinstance(state, dict) else None


def save_costs(path: Path, state: dict) -> None:
    """Write the state atomically (a crash leaves the old file or the new one); a read-only home only
    means the next process measures again."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, json.dumps(state) + "\n")
    except OSError:
        pass


def load_profile_shape(target_dir: str, drafter_dir: str, dtype: torch.dtype) -> tuple[TreeShape, Path] | None:
    """The tuned shape for this target, drafter, dtype and machine, or None if never tuned."""
    path = profile_path(target_dir, drafter_dir, dtype)
    if not path.is_file():
        return None
    try:
        return TreeShape(*json.loads(path.read_text())["best"]), path
    except (ValueError, KeyError, TypeError, AnchorspecError):
        return None  # a damaged profile is ignored, not fatal: the default shape still works
