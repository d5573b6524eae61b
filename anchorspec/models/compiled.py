"""Compiled decode-time forwards (the target's and the drafter's), written once.

Both compile one plain function over a static cache (decode/batch.py's ForwardCache with a mask):
inductor with the weights frozen, so on CPU each linear layer uses oneDNN's prepacked kernels and
the small ops between them fuse. Two ways:
- torch.compile (`frozen_compile`): sizes that change from step to step are marked dynamic from the
  first trace; otherwise each new size costs one more compile (tens of seconds) before dynamo
  generalises it. Every process compiles again.
- ahead of time (`aot_compile`, a CPU target's default): torch.export with every size symbolic, then
  AOTInductor; one file per model and machine under $ANCHORSPEC_HOME/compiled/, loaded in seconds by
  every later process. The graph reads its cache through a StaticCache (`write_and_read`, the same
  writes and reads ForwardCache makes in a static forward).

A CPU step of one or a few new rows is a read of every weight; oneDNN's prepacked kernels read bf16 weights at
~16 GB/s on 2 threads of an AVX-512-bf16 EPYC, while inductor's C++ GEMM template (max_autotune, backend CPP)
streamed them at ~29 GB/s, near that host's copy bandwidth: the target's plain step 19.3 -> 10.7 ms. At 8 rows
and more the template ran 2-3x slower than oneDNN (session 79). So an AOT step has two graphs where the
template applies (`NarrowWide`): the template's for steps of up to a measured number of new rows (cached per
machine and thread count, `narrow_up_to`), oneDNN's for the rest.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Callable, Iterable

import torch

from ..errors import AnchorspecError
from .attention import FEW_ROWS, traced_in

# api.load(compile="auto") compiles the step graphs when a run asks for at least this many new tokens. Compiling
# took 72-95 s (target) plus 13 s (drafter) on 2 cores; the graphs saved 1/37.3 - 1/61.8 s a plain token
# (bf16, AMD EPYC, session 47: break-even ~7k tokens) and 1/45.9 - 1/62.7 s a speculative one (bf16, AMX
# Xeon, session 46: ~18k). A run this long loses nothing by compiling with a drafter and gains without one.
COMPILE_PAYS_AT = 16384

# A prompt of 2..this many tokens is prefilled through the AOT step graph (the narrow twin up to its crossover), a
# longer one eagerly: the graph attends through an additive mask, so its cost grows with the square of the prompt,
# and SDPA's causal kernel wins on long prompts. Measured (prefill plus one step, bf16, 2 threads, 2-core AMX Xeon,
# session 80): 16 tokens 34 vs 70 ms eager, 128: 63 vs 109, 384: 151 vs 185, 512: 209 vs 216; above that eager
# varied (768: 368 vs 544, but prompts of 611-769 tokens prefilled level in a longer run; 2000: 998 vs 718).
GRAPH_PREFILL_TOKENS = 512


def graphs_compiled() -> int:
    """Graphs dynamo has compiled in this process. A step during which it grew took tens of seconds
    and is no sample of what a step costs (decode/engine.py, decode/round.py)."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"] + _aot_built


def frozen_compile(fn: Callable) -> Callable:
    """`fn` through torch.compile with inductor's freezing on (the weights become constants)."""
    import torch._dynamo
    import torch._inductor.config

    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    compiled = torch.compile(fn, dynamic=None)

    def run(*args):  # freezing as a config patch: torch.compile's `options` do not reach it (torch 2.13)
        with torch._inductor.config.patch(freezing=True):
            return compiled(*args)

    return run


def mark_dynamic(dims: Iterable[tuple[torch.Tensor, tuple[int, ...]]]) -> None:
    """Mark (tensor, its dimensions) dynamic for the next compiled call. Sizes 0 and 1 stay
    specialised, so a shape family (a plain step, a verify, at batch 1 or more) gets a graph each."""
    for tensor, tensor_dims in dims:
        for dim in tensor_dims:
            torch._dynamo.maybe_mark_dynamic(tensor, dim)


def static_cache_dims(cache) -> list[tuple[torch.Tensor, tuple[int, ...]]]:
    """A static ForwardCache's tensors: the buffers' slots (dim 0) and capacity (dim 2) differ per
    request and grow; the write indices have the batch's rows and new tokens per row (left static,
    they would pin those sizes to the first trace's: both are the mask's too)."""
    return [(cache.rows, (0,)), (cache.cols, (0, 1)), *((buf, (0, 2)) for buf in cache.kv.keys + cache.kv.values)]


# --- ahead of time: one graph per model and machine, compiled once and kept on disk ---------------

# inductor options of an AOT graph's GEMMs: "onednn" (freezing prepacks each weight for oneDNN's kernels) or "cpp"
# (inductor's C++ GEMM template alone: its micro-kernels at one or a few rows; the module docstring)
GEMM_OPTIONS = {"onednn": {}, "cpp": {"max_autotune": True, "max_autotune_gemm_backends": "CPP"}}
NARROW_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # the C++ template's (not float64: the tests')
# new rows per step at which the two graphs are timed: up to the largest default trees (the AVX-512 EPYC's template
# lost from 6 rows; with AMX it won at every size up to 64)
NARROW_SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
NARROW_VERDICT = 2  # bump when how the crossover is measured changes: cached verdicts are then measured again (2: up to 64 rows)

AOT_FORMAT = 3  # bump when what a graph computes or takes changes: older files are then never loaded (2: the LM head selects rows in every graph; 3: grouped attention in graph_form's form)
_aot_built = 0  # AOT graphs compiled or loaded in this process (graphs_compiled counts them)


class StaticCache:
    """The cache a step over the static slot cache sees (decode/batch.py's ForwardCache with a mask; an
    AOT graph's inputs): row b's new keys and values go to slot rows[b], positions cols[b], and every
    layer reads slots 0..B-1, positions 0..K-1, B and K the mask's first and last sizes (dynamic)."""

    static = True

    def __init__(self, keys, values, rows: torch.Tensor, cols: torch.Tensor, mask: torch.Tensor):
        self.keys, self.values, self.rows, self.cols, self.mask = keys, values, rows, cols, mask

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):  # HF Cache.update's signature
        return (write_and_read(self.keys[layer_idx], key_states, self.rows, self.cols, self.mask),
                write_and_read(self.values[layer_idx], value_states, self.rows, self.cols, self.mask))

    def append(self, key_states, value_states):  # the drafter's cache interface (one layer)
        return self.update(key_states, value_states, 0)


def write_and_read(buf: torch.Tensor, new: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor,
                   mask: torch.Tensor) -> torch.Tensor:
    """Write `new` [B, heads, T, D] into `buf` [slots, heads, capacity, D] at (rows [B, 1], cols [B, T]);
    return slots 0..B-1, positions 0..K-1 (narrow, not a slice: a traced graph then needs B <= slots and
    K <= capacity, which always hold, rather than guarding on them)."""
    buf[rows, :, cols] = new.transpose(1, 2).to(buf.dtype)
    return buf.narrow(0, 0, mask.shape[0]).narrow(2, 0, mask.shape[-1])


class _StepModule(torch.nn.Module):
    """What an AOT graph computes: `body(*args, mask=mask, cache=cache)`, the cache a StaticCache of its
    cache inputs.
    `owner` is a submodule so that export lifts its weights (then frozen into the graph)."""

    def __init__(self, owner: torch.nn.Module, body: Callable):
        super().__init__()
        self.owner, self._body = owner, body

    def forward(self, args, mask, rows, cols, keys, values):
        return self._body(*args, mask=mask, cache=StaticCache(keys, values, rows, cols, mask))


def weights_digest(module: torch.nn.Module, extra: dict[str, torch.Tensor] | None = None) -> str:
    """A digest of every parameter and buffer, and of the `extra` tensors a forward reads beside them
    (names, shapes, dtypes, bytes): a graph with frozen weights is valid for these weights only. ~0.3 s
    for SmolLM2-135M."""
    h, seen = hashlib.blake2b(digest_size=16), set()
    for name, t in [*module.named_parameters(), *module.named_buffers(), *(extra or {}).items()]:
        if t is None or t.is_mkldnn or (t.data_ptr(), t.dtype, tuple(t.shape)) in seen:
            continue
        seen.add((t.data_ptr(), t.dtype, tuple(t.shape)))
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype};".encode())
        h.update(t.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def aot_graph_key(what: str, fields: dict) -> tuple[Path, str]:
    """Where the graph for `fields` lives on this machine, $ANCHORSPEC_HOME/compiled/<what>-<digest>.pt2,
    and the key it is named after (JSON, written beside it as <name>.json): `fields`, the CPU (model and
    flags) and the torch and transformers versions (the code a graph was traced from and compiled against)."""
    import transformers

    from .dtype import machine_key
    from .hub import cache_home

    key = {**machine_key(), "transformers": transformers.__version__, "format": AOT_FORMAT, **fields}
    key.pop("threads")  # oneDNN's kernels take the thread count at run time (the C++ template's do not: narrow_key)
    text = json.dumps(key, sort_keys=True, default=str)
    return cache_home() / "compiled" / f"{what}-{hashlib.sha1(text.encode()).hexdigest()[:16]}.pt2", text


def aot_compile(owner: torch.nn.Module, body: Callable, example: tuple, dynamic: tuple, key: tuple[Path, str],
                what: str, gemm: str = "onednn") -> Callable:
    """`body(*args, mask=, cache=)` as an AOTInductor graph: loaded from `path` if an earlier process compiled
    it (`key`: aot_graph_key's path and key), else exported (torch.export, the sizes in `dynamic`
    symbolic), compiled with the weights frozen (on a CPU oneDNN prepacks each linear layer's weight),
    written to `path` atomically and loaded.
    `example` is (args, mask, rows, cols, keys, values) with every dynamic size >= 2 and distinct from the
    others. Returns a callable taking the same. Compiling costs about a minute and a half for
    SmolLM2-135M on 2 cores; loading a few seconds; unlike torch.compile's graphs (inductor does not
    cache a graph whose constants are prepacked), the file serves every later process. `gemm`: the
    GEMM kernels (GEMM_OPTIONS; `key` must name them, narrow_key)."""
    global _aot_built
    import torch._inductor

    path = key[0]
    if path.exists():
        try:
            runner = torch._inductor.aoti_load_package(str(path))
            _aot_built += 1
            return runner
        except Exception as e:  # noqa: BLE001 (a damaged or foreign file: compile it again)
            print(f"anchorspec: {path} did not load ({type(e).__name__}: {str(e)[:200]}); compiling it again",
                  file=sys.stderr, flush=True)
    _aot_write(owner, body, example, dynamic, key, what, gemm)
    runner = torch._inductor.aoti_load_package(str(path))
    _aot_built += 1
    return runner


def _aot_write(owner: torch.nn.Module, body: Callable, example: tuple, dynamic: tuple, key: tuple[Path, str],
               what: str, gemm: str = "onednn") -> None:
    import torch._inductor

    from ..atomic import atomic_write, make_temp_dir

    path, text = key
    print(f"anchorspec: compiling {what} for this machine (once, about a minute or two; then kept in "
          f"{path})", file=sys.stderr, flush=True)
    start = time.perf_counter()
    with torch.no_grad():
        program = torch.export.export(_StepModule(owner, body).eval(), example, dynamic_shapes=dynamic,
                                      strict=False)
    path.parent.mkdir(parents=True, exist_ok=True)

    def write(tmp: str) -> None:
        work = make_temp_dir(path.parent, ".aot-")
        try:
            # no_grad: inductor freezes (folds and prepacks the weights for oneDNN) only with grad off; a graph
            # compiled outside inference mode ran 1.5x slower at 4 tokens (session 47)
            with torch.no_grad(), torch._inductor.config.patch(freezing=True, **GEMM_OPTIONS[gemm]):
                built = torch._inductor.aoti_compile_and_package(program, package_path=str(work / "graph.pt2"))
            os.replace(built, tmp)
        finally:
            shutil.rmtree(work, ignore_errors=True)

    atomic_write(path, write)
    atomic_write(path.with_suffix(".json"), lambda tmp: Path(tmp).write_text(text))
    print(f"anchorspec: compiled {what} in {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)


def step_graph(owner: torch.nn.Module, body: Callable, example_of: Callable[..., tuple],
               args: tuple[tuple[str, ...], ...], layers: int, key: tuple[Path, str], what: str,
               forms: tuple[str, str] = ("enable_gqa", "enable_gqa")) -> Callable | None:
    """_form_graph in grouped attention's one-row form (`forms`: models/attention.py's graph_forms; `key` names that
    form's graph); where the few-row form differs, a second graph traced in it, which steps of 2..FEW_ROWS new tokens
    a row take (ByQueryRows). None where no graph can be compiled."""
    one, few = forms
    with traced_in(one):
        first = _form_graph(owner, body, example_of, args, layers, key, what)
    if one == few or first is None:
        return first
    few_key = form_key(key, few)
    with traced_in(few):
        second = _form_graph(owner, body, example_of, args, layers, few_key, f"{what} in {few} attention")
    return first if second is None else ByQueryRows(first, second, few, few_key[0])


def form_key(key: tuple[Path, str], form: str) -> tuple[Path, str]:
    """The key of the graph `key` names (aot_graph_key's), traced in attention `form` instead."""
    path, text = key
    return _sibling_key(path, {**json.loads(text), "attention": form})


class ByQueryRows:
    """One step, a graph per grouped-attention form (models/attention.py): steps of 2..FEW_ROWS new tokens a row (a
    verify, a drafter's pass) take `few`, the rest (plain steps, prefills) `one`. Both compute the same step; their
    sums may round differently in the last bit, as a one-token step and a verify already do."""

    def __init__(self, one: Callable, few: Callable, few_form: str, path: Path):
        self.one, self.few, self.few_form, self.path = one, few, few_form, path  # path: the few-row graph's file

    def __call__(self, args, mask, rows, cols, keys, values):
        graph = self.few if 1 < mask.shape[2] <= FEW_ROWS else self.one
        return graph(args, mask, rows, cols, keys, values)


def _form_graph(owner: torch.nn.Module, body: Callable, example_of: Callable[..., tuple],
                args: tuple[tuple[str, ...], ...], layers: int, key: tuple[Path, str], what: str) -> Callable | None:
    """aot_compile for a static-cache step: `args` names each leading input's dimensions ("rows",
    "tokens", "kept"); the mask [rows, 1, tokens, keys], the cache's slot rows and columns and `layers`
    key and value buffers [slots, heads, capacity, head_dim] are laid out as StaticCache reads them.
    Every size is dynamic from 1 up (keys and capacity from 2). None, after one line on stderr, where
    the graph cannot be compiled (no C++ compiler, say): the caller then runs eager.
    `example_of(rows=, tokens=, past=, kept=, slots=, capacity=)`: inputs of those sizes (static_example's), traced
    once with every size distinct; where the C++ GEMM template applies (`narrow_applies`), a second graph serves
    the steps it was measured faster at, on one row of n new tokens after 128 cached ones (NarrowWide)."""
    from torch.export import Dim

    dims = {name: Dim(name, min=1) for name in ("rows", "tokens", "kept", "slots")}
    dims.update(keys=Dim("keys", min=2), capacity=Dim("capacity", min=2))
    B, T, S, C = dims["rows"], dims["tokens"], dims["slots"], dims["capacity"]
    buffers = [{0: S, 2: C}] * layers
    dynamic = (tuple({i: dims[n] for i, n in enumerate(names)} for names in args), {0: B, 2: T, 3: dims["keys"]},
               {0: B}, {0: B, 1: T}, buffers, buffers)
    example = example_of(rows=2, tokens=3, past=5, kept=5, slots=4, capacity=11)
    try:
        wide = aot_compile(owner, body, example, dynamic, key, what)
    except Exception as e:  # noqa: BLE001 (a speed-up that cannot be had must not stop the generation)
        print(f"anchorspec: {what} could not be compiled ({type(e).__name__}: {str(e).strip()[:300]}); running "
              "eager", file=sys.stderr, flush=True)
        return None
    if not narrow_applies(example[1]):
        return wide
    twin = narrow_key(key)
    verdict_key = narrow_verdict_key(twin[0])
    cached = read_narrow_verdict(verdict_key)
    if cached == 0:  # measured here before: the template's graph never won
        return wide

    def one_row(tokens: int) -> tuple:  # what the two graphs are timed on
        return example_of(rows=1, tokens=tokens, past=128, kept=tokens, slots=1, capacity=128 + tokens)

    try:
        narrow = aot_compile(owner, body, example, dynamic, twin, what + " for narrow steps", gemm="cpp")
        up_to = cached if cached is not None else narrow_up_to(narrow, wide, one_row, verdict_key)
    except Exception as e:  # noqa: BLE001 (the wide graph serves every step)
        print(f"anchorspec: {what} for narrow steps could not be compiled ({type(e).__name__}: "
              f"{str(e).strip()[:300]}); every step takes the one graph", file=sys.stderr, flush=True)
        return wide
    return NarrowWide(narrow, wide, up_to, twin[0]) if up_to else wide


def narrow_applies(mask: torch.Tensor) -> bool:
    """Whether a step graph of this mask's dtype and device gets a C++-template twin: on a CPU, in a dtype the
    template has kernels for, unless ANCHORSPEC_NARROW_GRAPH=off."""
    from .hub import switched_on

    return mask.device.type == "cpu" and mask.dtype in NARROW_DTYPES and switched_on("ANCHORSPEC_NARROW_GRAPH")


def narrow_key(key: tuple[Path, str]) -> tuple[Path, str]:
    """The key of the C++-template twin of the graph `key` names (aot_graph_key's): the same fields, \"gemm\" and the
    thread count. The template splits each product into as many parts as there were threads when it was compiled (a
    constant in its code), so a twin compiled by a 1-thread process would run every step on one core of two."""
    path, text = key
    fields = {**json.loads(text), "gemm": "cpp", "threads": torch.get_num_threads()}
    return _sibling_key(path, fields)


def _sibling_key(path: Path, fields: dict) -> tuple[Path, str]:
    """A key beside `path` (same kind, the file named by the hash of `fields`), as aot_graph_key names its files."""
    text = json.dumps(fields, sort_keys=True, default=str)
    return path.with_name(f"{path.stem.split('-')[0]}-{hashlib.sha1(text.encode()).hexdigest()[:16]}.pt2"), text


def narrow_verdict_key(twin: Path) -> dict:
    """What a crossover verdict is valid for: the twin's graph file (its model and machine), the thread count and
    how the crossover is measured (NARROW_VERDICT)."""
    from .dtype import machine_key

    return machine_key(graph=twin.name, verdict=NARROW_VERDICT)


def read_narrow_verdict(key: dict) -> int | None:
    """The cached crossover for `key` (new rows up to which the narrow graph serves; 0: never), or None."""
    from .dtype import read_verdict, probe_cache_path

    record = read_verdict(probe_cache_path(key, "gemm"), key, _narrow_verdict_ok)
    return None if record is None else record["up_to"]


def _narrow_verdict_ok(record: dict) -> bool:
    return isinstance(record.get("up_to"), int) and record["up_to"] >= 0 and isinstance(record.get("ms"), dict)


def narrow_up_to(narrow: Callable, wide: Callable, sized: Callable[[int], tuple], key: dict,
                 sizes: tuple[int, ...] = NARROW_SIZES, repeats: int = 7) -> int:
    """The most new rows a step may have for the narrow graph to serve it: the largest of `sizes` at which, and at
    every smaller one, the narrow graph's fastest call beat the wide one's (the two alternate within each repeat; the
    fastest of `repeats` calls, since another process on the cores only slows a call); 0: never. Measured once per
    graph file and thread count, then cached under $ANCHORSPEC_HOME/gemm/ (models/dtype.py: cached_verdict)."""
    from .dtype import cached_verdict

    def measure() -> dict:
        times = {name: {n: [] for n in sizes} for name in ("narrow", "wide")}
        inputs = {n: sized(n) for n in sizes}
        with torch.no_grad():
            for r in range(repeats + 2):  # two warm-up rounds: a graph's first calls at a size ran 10-40x slower
                for n in sizes:
                    for name, graph in (("narrow", narrow), ("wide", wide)):
                        t = time.perf_counter()
                        graph(*inputs[n])
                        if r >= 2:
                            times[name][n].append(time.perf_counter() - t)
        fastest = {name: {n: min(v) for n, v in by.items()} for name, by in times.items()}
        up_to = 0
        for n in sizes:
            if fastest["narrow"][n] >= fastest["wide"][n]:
                break
            up_to = n
        return {"up_to": up_to, "ms": {name: {str(n): round(v * 1e3, 3) for n, v in by.items()}
                                       for name, by in fastest.items()}}

    record, path = cached_verdict("gemm", key, measure, _narrow_verdict_ok)
    narrow_ms, wide_ms = record["ms"]["narrow"], record["ms"]["wide"]
    timed = ", ".join(f"{n}: {narrow_ms[n]} vs {wide_ms[n]} ms" for n in list(narrow_ms)[:4])
    print(f"anchorspec: steps of up to {record['up_to']} new rows take the narrow-step graph here ({timed}; "
          f"kept in {path})", file=sys.stderr, flush=True)
    return record["up_to"]


class NarrowWide:
    """One step, two AOT graphs: `narrow` (the C++ GEMM template) for steps of at most `up_to` new rows in all
    (rows x tokens: the GEMMs' rows), `wide` (oneDNN) for the rest. Both compute the same step; their sums may
    round differently in the last bit, as oneDNN's do between thread counts."""

    def __init__(self, narrow: Callable, wide: Callable, up_to: int, path: Path | None = None):
        self.narrow, self.wide, self.up_to = narrow, wide, up_to
        self.path = path  # the narrow graph's file

    def __call__(self, args, mask, rows, cols, keys, values):
        graph = self.narrow if args[0].numel() <= self.up_to else self.wide
        return graph(args, mask, rows, cols, keys, values)


def static_example(rows: int, tokens: int, past: int, kept: int, slots: int, capacity: int, kv_heads: int,
                   head_dim: int, layers: int, dtype: torch.dtype, device) -> tuple:
    """A static step's inputs of these sizes, to trace its graph (every size distinct and >= 2):
    (token ids, positions, kept rows), then the mask, slot rows, columns, keys and values as step_graph
    lays them out."""
    ids = torch.zeros(rows, tokens, dtype=torch.long, device=device)
    positions = (past + torch.arange(tokens, device=device)).expand(rows, tokens).contiguous()
    mask = torch.zeros(rows, 1, tokens, past + tokens, dtype=dtype, device=device)
    keep = torch.arange(kept, device=device)
    slot_rows = torch.arange(rows, device=device)[:, None]
    kv = [[torch.zeros(slots, kv_heads, capacity, head_dim, dtype=dtype, device=device) for _ in range(layers)]
          for _ in range(2)]
    return (ids, positions, keep), mask, slot_rows, positions.clone(), kv[0], kv[1]


def run_static(graph: Callable, args: tuple, mask: torch.Tensor, cache) -> list[torch.Tensor]:
    """`graph` (step_graph's) over a static ForwardCache: the graph reads its inputs at the strides it
    was traced with (contiguous); the buffers are always contiguous (BatchKV allocates them), and a copy
    of one would lose the writes."""
    keys, values = cache.buffers  # every slot's, or views of one slot's rows (a prefill in that slot)
    if not all(b.is_contiguous() for b in keys + values):
        raise AnchorspecError("the AOT graph needs contiguous key/value buffers")
    small = (*args, mask, cache.rows, cache.cols)
    *args, mask, rows, cols = (t.contiguous() for t in small)
    return graph(tuple(args), mask, rows, cols, keys, values)
