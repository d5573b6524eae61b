"""Linear layers with their weights prepacked by oneDNN, for a CPU target in float32, bfloat16 or float16.

Eager `F.linear` in bf16 re-reads the weight in its plain layout on every call; at one or a few
rows (a decode step, a verify) that ran at ~9 GB/s on an AVX-512-bf16 EPYC with one thread, while
oneDNN's prepacked kernel (the one inductor's freezing pass uses) streamed the same weights at
~12.5 GB/s: a decode step is mostly weight reads, so ~1.4x on the whole step, no compilation, for
every shape (prefill, verify, plain step). The output is the same matmul; oneDNN may sum in another
order, so values can differ from F.linear's in the last bit, as they do between thread counts.
In float32 the gain is elsewhere: eager F.linear of 2 or 3 rows ran at about 2x the time of 1 row
(one-row products repeated, it seems), where the packed kernel took 1.3x; a chain's verify is
such a product, and the plain step got ~1.15x faster too (one thread, same EPYC).

The target also fuses sibling projections (fuse_siblings): q/k/v, and gate/up, read the same input,
so each group becomes one packed product whose output is split. At one row a product is a weight read
plus ~20 us of call overhead, and a decode step of SmolLM2-135M makes 211 of them; fused, 121. On an
AVX-512-bf16 EPYC, 2 threads, the plain loop went from 1.35x to 1.49x HF `generate` in bf16 and from
1.32x to 1.46x in fp32 (benchmarks/bench_lean_step.py; benchmarks/results/lean-step-s37/). Members of a
group are called on the same input tensor within a forward, as decoder layers do; another tensor is
computed again.

Whether to pack is a measured decision (models/dtype.py probes both at the model's shapes and
caches the verdict per machine). The target is packed at load: it runs under no_grad or inference
mode (a packed weight has no autograd), and nothing reads its Linear weights but the LM head's,
which keeps its `weight` (tied input embeddings, the drafter's head initialisation). A drafter is
packed when an Engine pairs it with a packed target (inference only; training never packs), keeping
every `weight` (read for its dtype, and saved) beside the packed copy."""

from __future__ import annotations

import functools

import torch
from torch import nn

PACKABLE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def packing_supported(dtype: torch.dtype, device) -> bool:
    """oneDNN can prepack linear weights of this dtype on this device, on this CPU."""
    return (torch.device(device).type == "cpu" and dtype in PACKABLE_DTYPES
            and torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
            and _cpu_packs(dtype))


@functools.cache
def _cpu_packs(dtype: torch.dtype) -> bool:
    """Packing a small weight of `dtype` and multiplying with it works here. oneDNN's reduced-precision
    reorder needs CPU features (bf16: avx512bw/vl/dq or avx_ne_convert) and raises without them, as on
    an AVX2-only Zen3; trying it is the one check that stays right as oneDNN's requirements change."""
    try:
        packed_linear(torch.ones(1, 8, dtype=dtype), pack_weight(torch.ones(4, 8, dtype=dtype)), None, 4)
        return True
    except RuntimeError:
        return False


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """`weight` [out, in] in oneDNN's blocked layout (an opaque mkldnn tensor), laid out for one input
    row (a decode step; the probe in models/dtype.py times this same layout at 1 and 16 rows)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 1)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    """F.linear(x, weight, bias) with the packed weight; x [..., in] -> [..., out]."""
    y = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, x.shape[-1]), packed, bias, "none", [], "")
    return y.reshape(*x.shape[:-1], out_features)


class PackedLinear(nn.Module):
    """An inference-only nn.Linear whose weight is prepacked (see the module docstring)."""

    def __init__(self, linear: nn.Linear, keep_weight: bool = False):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer("packed_weight", pack_weight(linear.weight), persistent=False)
        self.bias = linear.bias
        # an LM head's weight is read elsewhere (tied input embeddings, the drafter's head init)
        self.weight = linear.weight if keep_weight else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return packed_linear(x, self.packed_weight, self.bias, self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, packed"


# Linear layers a decoder layer applies to one input, in the order their outputs are concatenated:
# Llama, Qwen2, Mistral, Gemma name them so (families with a fused `qkv_proj` have nothing to fuse)
SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


class _SiblingProduct(nn.Module):
    """One GEMM for several linear layers that read the same input: the first member called with `x`
    computes all their outputs at once (x @ [W_1; W_2; ...]) and keeps them until every member has
    taken its own. At one or a few rows each product is a weight read plus ~20 us of call overhead, so
    q/k/v as one call and gate/up as one cut three of a layer's seven calls. `pack`: the fused weight
    prepacked for oneDNN (eager CPU inference); otherwise kept as a stock buffer, for torch.compile,
    whose frozen graph packs it itself (Target.compile)."""

    def __init__(self, linears: list[nn.Linear], pack: bool = True):
        super().__init__()
        biases = [m.bias for m in linears]
        weight = torch.cat([m.weight.detach() for m in linears])
        self.pack = pack
        self.register_buffer("weight", pack_weight(weight) if pack else weight, persistent=False)
        self.register_buffer("bias", None if biases[0] is None else torch.cat([b.detach() for b in biases]),
                             persistent=False)
        self.sizes = [m.out_features for m in linears]
        self.input, self.outputs, self.untaken = None, [], 0

    def output(self, x: torch.Tensor, member: int) -> torch.Tensor:
        if x is not self.input or self.outputs[member] is None:  # identity, not value: a new call recomputes
            y = (packed_linear(x, self.weight, self.bias, sum(self.sizes)) if self.pack
                 else torch.nn.functional.linear(x, self.weight, self.bias))
            self.input, self.outputs, self.untaken = x, list(y.split(self.sizes, dim=-1)), len(self.sizes)
        out, self.outputs[member] = self.outputs[member], None
        self.untaken -= 1
        if not self.untaken:  # all taken: hold no activations between forwards
            self.input, self.outputs = None, []
        return out


class FusedSibling(nn.Module):
    """Where one of a fused group's linear layers was: its output, from the group's one product (a
    submodule of every member; module traversals list it once)."""

    def __init__(self, product: _SiblingProduct, member: int, in_features: int):
        super().__init__()
        self.product, self.member = product, member
        self.in_features, self.out_features = in_features, product.sizes[member]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.product.output(x, self.member)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fused ({self.member})"


def fuse_siblings(model: nn.Module, pack: bool = True) -> int:
    """Replace each group of SIBLINGS linear layers of one module (same input size and bias presence) by
    FusedSibling modules sharing one product (prepacked with `pack`). Inference only: the separate
    weights are gone. Returns the number of groups fused."""
    groups = 0
    for parent in list(model.modules()):
        for names in SIBLINGS:
            linears = [getattr(parent, n, None) for n in names]
            if not all(type(m) is nn.Linear for m in linears):
                continue
            if len({m.in_features for m in linears}) > 1 or len({m.bias is None for m in linears}) > 1:
                continue
            product = _SiblingProduct(linears, pack=pack)
            for member, (name, linear) in enumerate(zip(names, linears)):
                setattr(parent, name, FusedSibling(product, member, linear.in_features))
            groups += 1
    return groups


def is_packed(model: nn.Module) -> bool:
    """Some linear weight of `model` is prepacked for oneDNN (stock fused products are not)."""
    return any(isinstance(m, PackedLinear) or (isinstance(m, FusedSibling) and m.product.pack)
               for m in model.modules())


def pack_linears(model: nn.Module, keep_weights: bool = False, fuse: bool = False) -> int:
    """Replace every nn.Linear of `model` by a PackedLinear (the output embedding keeps its weight, and
    every one does with `keep_weights`); with `fuse`, sibling projections first become one product each
    (fuse_siblings). Returns how many were packed. Call before any hook is registered on them."""
    if fuse and not keep_weights:
        fuse_siblings(model)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    swaps = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
             if type(child) is nn.Linear]
    for parent, name, child in swaps:
        setattr(parent, name, PackedLinear(child, keep_weight=keep_weights or child is head))
    return len(swaps)
