"""torch.compile for decode-time forwards (the target's and the drafter's), written once.

Both compile one plain function over a static cache (decode/batch.py's ForwardCache with a mask):
inductor with the weights frozen, so on CPU each linear layer uses oneDNN's prepacked kernels and
the small ops between them fuse. Sizes that change from step to step are marked dynamic from the
first trace; otherwise each new size costs one more compile (tens of seconds) before dynamo
generalises it.
"""

from __future__ import annotations

from typing import Callable, Iterable

import torch


def graphs_compiled() -> int:
    """Graphs dynamo has compiled in this process. A step during which it grew took tens of seconds
    and is no sample of what a step costs (decode/engine.py, decode/round.py)."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


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
