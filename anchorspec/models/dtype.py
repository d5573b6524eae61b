"""The compute dtype, and `--dtype auto`: the dtype that is fast on the machine at hand.

CUDA: bfloat16. CPU: it depends on the CPU. With avx512_bf16 or AMX, bf16 matmuls run faster than
fp32 (half the weight bytes to stream); without them oneDNN emulates bf16 and it can run tens of
times slower than fp32 (1 against 70 GFLOP/s measured on an AVX2 Zen3). So on a CPU, `auto` times a
short GEMM probe at the model's own step shapes in both dtypes and takes bf16 only when it is
clearly faster. The verdict is cached per machine (CPU model and flags, torch version, threads,
shapes) under $ANCHORSPEC_HOME/dtype/, so the probe runs once, and the choice is printed once per
process on stderr.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from ..atomic import atomic_create_text
from ..errors import AnchorspecError
from .hub import cache_home
from .packed import pack_weight, packed_linear, packing_supported

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}
AUTO = "auto"
DTYPE_CHOICES = (AUTO, *DTYPES)  # what every --dtype accepts
# bf16 must beat fp32 by this margin: a near-tie is not worth bf16's rounding (and run-to-run noise).
BF16_MARGIN = 0.9
# Shapes probed when no model config is at hand: SmolLM2-135M's (hidden 576, MLP 1536).
FALLBACK_SHAPES = (576, 1536)
PROBE_VERSION = 5  # bump when the probe changes, so old verdicts are not reused
# prepacked weights (models/packed.py) must beat the plain layout of the same dtype by this margin
PACK_MARGIN = 0.95
PROBE_ROWS = (1, 2, 16)  # a decode step, a chain's verify (fp32 GEMMs of 2-3 rows are slow here), a wide one

_announced: set[str] = set()


def parse_dtype(name: str) -> torch.dtype:
    """A concrete dtype name (not `auto`: see resolve_dtype)."""
    if name not in DTYPES:
        raise AnchorspecError(f"unknown dtype {name!r}; choose one of {', '.join(DTYPES)}")
    return DTYPES[name]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def cpu_description() -> dict:
    """CPU model name and flags (Linux /proc/cpuinfo; elsewhere what `platform` says, without flags)."""
    model, flags = "", []
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and not model:
                model = value.strip()
            elif key.strip() in ("flags", "Features") and not flags:  # x86 / ARM
                flags = sorted(value.split())
    except OSError:
        pass
    return {"model": model or platform.processor() or platform.machine(), "flags": flags}


def cpu_line(flags: tuple[str, ...] = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")) -> str:
    """"model [the listed flags it has]": the one line benchmarks print beside their figures."""
    cpu = cpu_description()
    return f"{cpu['model']} [{' '.join(f for f in flags if f in cpu['flags'])}]"


def bf16_hardware(flags: list[str]) -> list[str]:
    """The CPU flags that give native bf16 matmuls (empty: bf16 is emulated)."""
    return [f for f in ("avx512_bf16", "amx_bf16", "avx_vnni_bf16", "bf16") if f in flags]


def _gemm_seconds(rows: int, hidden: int, intermediate: int, repeats: int = 15) -> dict[str, float]:
    """Seconds of one [rows, hidden] x [hidden, intermediate] product in float32, bfloat16 and, where
    oneDNN can, both with prepacked weights ("float32_packed", "bfloat16_packed", models/packed.py) (the best of
    `repeats`, the cases taking turns, so a neighbour's burst of work hits both alike). The weights
    cycle through enough copies (~64 MB in fp32) to spill the caches, as a real decode step streams
    every layer's weights from memory; a single cache-resident matrix would flatter fp32."""
    # at most 64 copies: matrices under 1 MB are a toy's, whose weights stay in cache as it decodes (the tests'
    # 32x64 ones took 8,192 copies: minutes of probing)
    copies = max(1, min(64, (64 << 20) // (hidden * intermediate * 4)))
    gen = torch.Generator().manual_seed(0)
    fp32 = [torch.randn(intermediate, hidden, generator=gen) for _ in range(copies)]
    x32 = torch.randn(rows, hidden, generator=gen)
    bf16 = [w.bfloat16() for w in fp32]
    cases = {"float32": (x32, fp32, F.linear), "bfloat16": (x32.bfloat16(), bf16, F.linear)}
    for name, x, weights in (("float32_packed", x32, fp32), ("bfloat16_packed", x32.bfloat16(), bf16)):
        if packing_supported(x.dtype, "cpu"):
            cases[name] = (x, [pack_weight(w) for w in weights],  # as PackedLinear packs
                           lambda x, w: packed_linear(x, w, None, intermediate))
    calls = {}
    with torch.inference_mode():
        for name, (x, weights, linear) in cases.items():
            for w in weights:  # warm-up: page in, let oneDNN pick its kernels
                linear(x, w)
            start = time.perf_counter()
            linear(x, weights[0])
            # short repeats (~3 ms): on a busy machine some run without being preempted, and the best counts
            calls[name] = max(copies, min(2000, int(0.003 / max(time.perf_counter() - start, 1e-7))))
        best = {name: float("inf") for name in cases}
        for _ in range(repeats):
            for name, (x, weights, linear) in cases.items():
                start = time.perf_counter()
                for i in range(calls[name]):
                    linear(x, weights[i % copies])
                best[name] = min(best[name], (time.perf_counter() - start) / calls[name])
    return best


def probe_gemms(hidden: int, intermediate: int) -> dict:
    """Seconds per GEMM in float32, bfloat16 and (where supported) both packed at a one-token decode
    step, a two-token chain verify and a 16-token verify/prefill chunk (PROBE_ROWS rows of the MLP's
    up projection), on the current torch thread count."""
    by_rows = {rows: _gemm_seconds(rows, hidden, intermediate) for rows in PROBE_ROWS}
    return {name: {str(rows): by_rows[rows][name] for rows in by_rows} for name in by_rows[1]}


def machine_key(**fields) -> dict:
    """What a measured verdict is valid for: this CPU (model and flags), torch version and thread count,
    plus `fields` (the shapes or dtype measured)."""
    cpu = cpu_description()
    return {"cpu": cpu["model"], "flags_sha1": hashlib.sha1(" ".join(cpu["flags"]).encode()).hexdigest()[:16],
            "torch": torch.__version__, "threads": torch.get_num_threads(), **fields}


def _probe_key(hidden: int, intermediate: int) -> dict:
    return machine_key(hidden=hidden, intermediate=intermediate, probe=PROBE_VERSION)


def probe_cache_path(key: dict, kind: str = "dtype") -> Path:
    digest = hashlib.sha1(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return cache_home() / kind / f"{digest}.json"


def _dtype_verdict_ok(record: dict) -> bool:
    return (record.get("choice") in ("float32", "bfloat16") and isinstance(record.get("pack_bf16"), bool)
            and isinstance(record.get("pack_fp32"), bool))


def read_verdict(path: Path, key: dict, ok: Callable[[dict], bool]) -> dict | None:
    """The cached verdict at `path` if it is whole and for this key; None otherwise (then it is re-measured)."""
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) and record.get("key") == key and ok(record) else None


def _verdict(seconds: dict, packing: bool = True) -> dict:
    """The probe's timings -> the choices: packed weights for a dtype when they clearly beat its plain
    layout (and `packing` is allowed); bf16 when its best form clearly beats fp32's best form."""
    total = {name: sum(by_rows.values()) for name, by_rows in seconds.items()}
    fp32, bf16 = total["float32"], total["bfloat16"]
    packed32, packed16 = total.get("float32_packed", float("inf")), total.get("bfloat16_packed", float("inf"))
    pack32, pack16 = packing and packed32 < PACK_MARGIN * fp32, packing and packed16 < PACK_MARGIN * bf16
    best_fp32, best_bf16 = (packed32 if pack32 else fp32), (packed16 if pack16 else bf16)
    return {"seconds": seconds, "bf16_speedup": best_fp32 / best_bf16, "pack_speedup": bf16 / packed16,
            "pack_fp32_speedup": fp32 / packed32, "pack_bf16": pack16, "pack_fp32": pack32,
            "choice": "bfloat16" if best_bf16 < BF16_MARGIN * best_fp32 else "float32"}


def cached_verdict(kind: str, key: dict, measure: Callable[[], dict],
                   ok: Callable[[dict], bool]) -> tuple[dict, Path]:
    """A measured verdict for `key`, read from $ANCHORSPEC_HOME/<kind>/ or measured and cached there.
    The first verdict written wins (processes probing at once, DDP ranks, then all decide alike); a
    damaged file is measured again; a read-only home only costs a probe next time."""
    path = probe_cache_path(key, kind)
    record = read_verdict(path, key, ok)
    if record is None:
        damaged = path.exists()
        record = {"key": key, **measure()}
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            if damaged:
                path.unlink(missing_ok=True)
            if not atomic_create_text(path, json.dumps(record, indent=1) + "\n"):
                record = read_verdict(path, key, ok) or record
        except OSError:
            pass
    return record, path


def cpu_probe_record(hidden: int, intermediate: int, probe: Callable[[int, int], dict] = probe_gemms) -> tuple[dict, Path]:
    """The probe's verdict for this machine and these shapes: read from the cache, or measured and cached."""
    return cached_verdict("dtype", _probe_key(hidden, intermediate),
                          lambda: _verdict(probe(hidden, intermediate)), _dtype_verdict_ok)


def _choice(record: dict, packing: bool) -> tuple[str, float, bool]:
    """(dtype name, bf16 speed over fp32, whether the chosen dtype's weights are packed) from a probe
    record, with packing allowed or not (ANCHORSPEC_PACK=off: plain bf16 must beat plain fp32)."""
    verdict = record if packing else _verdict(record["seconds"], packing=False)
    packed = verdict["pack_bf16"] if verdict["choice"] == "bfloat16" else verdict["pack_fp32"]
    return verdict["choice"], verdict["bf16_speedup"], packed


def cpu_auto_dtype(hidden: int, intermediate: int, probe: Callable[[int, int], dict] = probe_gemms,
                   packing: bool = True) -> tuple[str, str]:
    """(dtype name, why) for a CPU: bf16 if the probe (cached per machine) shows it clearly faster,
    in the form the target will run in (prepacked only if `packing`)."""
    record, path = cpu_probe_record(hidden, intermediate, probe)
    cpu, key = cpu_description(), record["key"]
    native = bf16_hardware(cpu["flags"])
    choice, speedup, packed = _choice(record, packing)
    packed = f" ({choice} weights prepacked)" if packed else ""
    why = (f"bf16 GEMMs {speedup:.2f}x the speed of fp32{packed} at this model's step shapes on "
           f"{cpu['model']} ({', '.join(native) if native else 'no native bf16'}), "
           f"{key['threads']} thread{'s' if key['threads'] != 1 else ''}; "
           f"cached in {path}")
    return choice, why


def resolve_dtype(name: str, device: str = "cpu", shapes: tuple[int, int] | None = None,
                  probe: Callable[[int, int], dict] = probe_gemms, announce: bool = True,
                  pack: str | None = None) -> torch.dtype:
    """A --dtype value to a torch dtype. `auto`: CUDA -> bfloat16; CPU -> the probe's verdict at
    `shapes` = (hidden size, MLP intermediate size) of the model (SmolLM2-135M's if None), counting
    prepacked weights only if packing is not off (`pack`, else $ANCHORSPEC_PACK)."""
    if name != AUTO:
        return parse_dtype(name)
    if str(device).startswith("cuda"):
        choice, why = "bfloat16", "CUDA"
    else:
        choice, why = cpu_auto_dtype(*(shapes or FALLBACK_SHAPES), probe=probe, packing=pack_mode(pack) != "off")
    if announce and why not in _announced:
        _announced.add(why)
        print(f"anchorspec: --dtype auto chose {choice} ({why})", file=sys.stderr)
    return DTYPES[choice]


# tests/device_emulation.py sets this to its virtual device's membership test: the CPU-only fast paths then
# step aside for tensors on that device, as they do on a GPU
virtual_device: Callable[[torch.Tensor], bool] | None = None


def on_cpu(t: torch.Tensor) -> bool:
    """Whether `t` is on the CPU, as the CPU-only fast paths (one-row grouped attention, chunked argmax) ask it."""
    return t.device.type == "cpu" and not (virtual_device is not None and virtual_device(t))


def resolve_device(name: str | torch.device | None = "auto") -> torch.device:
    """A --device value to a torch device: `auto` (or None) is CUDA when torch sees a GPU, else the CPU;
    `cuda` (or `cuda:N`) without a GPU is one clear line, not a CUDA stack trace later."""
    if isinstance(name, torch.device):
        return name
    name = (name or "auto").lower()
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cpu":
        return torch.device("cpu")
    if name.startswith("cuda"):
        if not torch.cuda.is_available():
            raise AnchorspecError(f"--device {name}: torch {torch.__version__} sees no CUDA GPU here (use cpu or auto)")
        return torch.device(name)
    raise AnchorspecError(f"--device must be auto, cpu or cuda[:N], got {name!r}")


PACK_MODES = ("auto", "on", "off")


def pack_mode(mode: str | None) -> str:
    """`mode`, else $ANCHORSPEC_PACK, else auto; checked."""
    mode = (mode or os.environ.get("ANCHORSPEC_PACK") or "auto").strip().lower()
    if mode not in PACK_MODES:
        raise AnchorspecError(f"ANCHORSPEC_PACK / pack must be one of {', '.join(PACK_MODES)}, got {mode!r}")
    return mode


def resolve_packing(mode: str | None, dtype: torch.dtype, device, shapes: tuple[int, int] | None,
                    probe: Callable[[int, int], dict] = probe_gemms, announce: bool = True) -> bool:
    """Whether to prepack the target's linear weights (models/packed.py). `mode` None reads
    $ANCHORSPEC_PACK (default auto); auto packs fp32 or bf16 on a CPU where the probe (cached, shared
    with --dtype auto) measured that dtype's packed GEMMs clearly faster; on packs wherever oneDNN can."""
    mode = pack_mode(mode)
    if mode == "off" or not packing_supported(dtype, device):
        return False
    if mode == "on":
        return True
    if dtype not in (torch.float32, torch.bfloat16):
        return False  # the probe measures these two
    record, path = cpu_probe_record(*(shapes or FALLBACK_SHAPES), probe=probe)
    name, pack = ("bf16", record["pack_bf16"]) if dtype == torch.bfloat16 else ("fp32", record["pack_fp32"])
    speedup = record["pack_speedup"] if dtype == torch.bfloat16 else record["pack_fp32_speedup"]
    why = f"prepacked {name} GEMMs {speedup:.2f}x plain {name} here; cached in {path}"
    if announce and pack and why not in _announced:
        _announced.add(why)
        print(f"anchorspec: target weights prepacked for oneDNN ({why}; ANCHORSPEC_PACK=off turns it off)",
              file=sys.stderr)
    return pack


def model_shapes(config) -> tuple[int, int] | None:
    """(hidden size, MLP intermediate size) of a transformers config, if it has both."""
    hidden = getattr(config, "hidden_size", None)
    inter = getattr(config, "intermediate_size", None)
    return (int(hidden), int(inter)) if hidden and inter else None


def resolve_target_dtype(name: str, target: str, device: str = "cpu", pack: str | None = None) -> torch.dtype:
    """resolve_dtype at the shapes of `target` (alias, directory or hub id); its config is read, not the weights."""
    if name != AUTO or str(device).startswith("cuda"):
        return resolve_dtype(name, device, pack=pack)
    from transformers import AutoConfig

    from .hub import resolve_target

    try:
        shapes = model_shapes(AutoConfig.from_pretrained(resolve_target(target)))
    except (OSError, ValueError):
        shapes = None  # the model load that follows reports the real problem
    return resolve_dtype(name, device, shapes, pack=pack)


def argmax_last(x: torch.Tensor, chunk_elements: int = 1 << 19) -> torch.Tensor:
    """``x.argmax(-1)``, same indices (ties: the first), fast on a CPU: half-precision tensors go through
    fp32 in chunks of rows (torch's CPU argmax has no vectorised bf16 kernel: 10x slower than fp32 on one
    row of a 49k vocabulary, measured), and fp32 ones through ``max(-1).indices`` (the same first-index rule;
    1.5-2x argmax's speed on [2048, 8192], measured). A chunk is about `chunk_elements` fp32 values (2 MB, a
    core's L2) in one buffer reused: chunks of 256 rows of a 49k vocabulary (50 MB, fresh pages each) made the
    target's argmax in a training step 150 ms against 40-50 (AMX Xeon, 2 threads, [1771, 49152])."""
    if not on_cpu(x) or x.dim() == 0 or x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return x.argmax(-1)
    if x.dtype == torch.float32:
        return x.max(-1).indices
    rows = x.reshape(-1, x.shape[-1])
    chunk = max(1, chunk_elements // max(rows.shape[1], 1))
    if rows.shape[0] <= chunk:  # a decode step's few rows: one conversion, no buffer
        return rows.float().max(-1).indices.reshape(x.shape[:-1])
    out = torch.empty(rows.shape[0], dtype=torch.long)
    buffer, values = torch.empty(chunk, rows.shape[1]), torch.empty(chunk)
    for a in range(0, rows.shape[0], chunk):
        n = min(chunk, rows.shape[0] - a)
        buffer[:n].copy_(rows[a:a + n])
        torch.max(buffer[:n], -1, out=(values[:n], out[a:a + n]))
    return out.reshape(x.shape[:-1])
