"""CUDA's device rules, checked on a CPU: a second, virtual device for the tiny-model tests.

A GPU is lent to a session only by chance, and twice (sessions 40 and 42) the CUDA run of the lossless
tests failed at once on a tensor the decode path had left on the host. `DeviceEmulation` catches that
class of fault on any machine: every tensor is either on the virtual device or on the host (weak
references mark the device ones), and each torch call is checked against the rule CUDA enforces:

- the tensors an op combines share one device, except 0-dim host tensors (CPU scalars may join a
  CUDA op) and the index tensors of indexing (`x[idx]`, `x[idx] = v`), which may stay on the host;
- a result is on the device when any input was, or when the call named the device: `.to(d)` or
  `torch.zeros(..., device=d)` with `d` read off a device tensor's `.device` (each read hands out a new
  torch.device, so the emulation knows which side it came from); `"cpu"` names the host;
- `.cpu()`, `.tolist()`, `.item()` bring values back; `.numpy()` of a device tensor fails, as on CUDA.

The model's parameters and buffers are put on the device by `place(module)`. The numbers are the CPU's:
only the bookkeeping is checked. Blind to generator devices and to code that compares devices
(`if a.device != b.device`: equal here).
"""

from __future__ import annotations

import contextlib
import os
import weakref

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten


class DeviceMismatch(RuntimeError):
    pass


# copying between devices is allowed (dst.copy_(src)); the result stays where dst is
_COPIES = {"copy_"}
_INDEXING = {"__getitem__", "__setitem__", "index_put_", "index_put"}
_MOVES = {"to", "cpu", "cuda"}
# calls that read a tensor without combining it with another
_PASSIVE = {"__repr__", "__format__", "__len__", "__bool__", "__hash__", "__iter__", "__reduce_ex__", "__deepcopy__",
            "__array__", "__index__", "__int__", "__float__", "__contains__", "__dlpack__", "dim", "size", "numel",
            "item", "tolist", "element_size", "stride", "is_contiguous", "data_ptr", "storage_offset", "untyped_storage"}


def _name(func) -> str:
    return getattr(func, "__name__", None) or str(func)


class DeviceEmulation(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self._on: dict[int, weakref.ref] = {}  # id -> the tensor (a tensor's __eq__ is elementwise: no WeakKeyDictionary)
        # every `tensor.device` read hands out a new torch.device: remember which side each one names
        self._devices: dict[int, tuple[torch.device, bool]] = {}

    def place(self, module: torch.nn.Module) -> torch.nn.Module:
        for t in list(module.parameters()) + list(module.buffers()):
            self._mark(t, True)
        return module

    def is_on(self, t) -> bool:
        ref = self._on.get(id(t)) if isinstance(t, torch.Tensor) else None
        return ref is not None and ref() is t

    def _mark(self, t: torch.Tensor, on: bool) -> None:
        if on:
            self._on[id(t)] = weakref.ref(t)
        else:
            self._on.pop(id(t), None)

    def _remember(self, device: torch.device, on: bool) -> None:
        if len(self._devices) > 500_000:  # a whole test session: forget the oldest half
            for key in list(self._devices)[:250_000]:
                del self._devices[key]
        self._devices[id(device)] = (device, on)

    def _names_device(self, device) -> bool:
        """A torch.device read off a tensor names that tensor's side; the string "cpu" the host (code bringing
        values back); any other device the virtual one."""
        known = self._devices.get(id(device))
        if known is not None and known[0] is device:
            return known[1]
        return not (isinstance(device, str) and device == "cpu")

    def _named_device(self, name: str, args, kwargs):
        """True/False where the call itself says where its result goes; None where its inputs decide."""
        if name == "cpu":
            return False
        if name == "cuda":
            return True
        if name == "to":
            for a in list(args[1:]) + [kwargs.get("device"), kwargs.get("other")]:
                if isinstance(a, torch.Tensor):
                    return self.is_on(a)
                if isinstance(a, (torch.device, str)) or (isinstance(a, int) and not isinstance(a, bool)):
                    return self._names_device(a)
            return None
        if kwargs.get("device") is not None:
            return self._names_device(kwargs["device"])
        return None

    def _tag(self, out, on: bool) -> None:
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self._mark(t, on)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = _name(func)
        if name == "_parse_to":  # Module.to(d) parses d into a new torch.device: it names d's side
            out = func(*args, **kwargs)
            given = [a for a in list(args) + list(kwargs.values()) if isinstance(a, (str, torch.device))]
            if isinstance(out[0], torch.device) and given:
                self._remember(out[0], self._names_device(given[0]))
            return out
        if name in _PASSIVE or (name.startswith("_") and not name.startswith("__")):  # torch's private helpers
            if name == "__array__" and self.is_on(args[0]):
                raise DeviceMismatch("numpy conversion of a tensor on the device (CUDA: call .cpu() first)")
            return func(*args, **kwargs)
        if name == "__get__":  # attributes: .data, .T, .grad, ... live where their tensor does
            out = func(*args, **kwargs)
            if isinstance(out, torch.device):
                self._remember(out, self.is_on(args[0]))
                return out
            if isinstance(out, torch.Tensor) and self.is_on(args[0]):
                self._mark(out, True)
            return out
        if name == "__set__":  # param.data = tensor (Module.to): the parameter moves with its data
            out = func(*args, **kwargs)
            if len(args) == 2 and isinstance(args[0], torch.Tensor) and isinstance(args[1], torch.Tensor):
                self._tag(args[0], self.is_on(args[1]))
            return out
        if name == "numpy" and self.is_on(args[0]):
            raise DeviceMismatch("numpy() of a tensor on the device (CUDA: call .cpu() first)")
        named = self._named_device(name, args, kwargs)
        if name in _INDEXING:
            checked = [args[0]]
            if name == "__setitem__" and len(args) > 2:
                checked.append(args[2])
            if name in ("index_put_", "index_put") and len(args) > 2:
                checked.append(args[2])
            for t in tree_flatten(args[1] if len(args) > 1 else None)[0]:
                if self.is_on(t) and not self.is_on(args[0]):
                    raise DeviceMismatch(f"{name}: a host tensor indexed with a device index")
        elif name in _COPIES:
            checked = [args[0]]
        else:
            checked = tree_flatten((args, kwargs))[0]
        tensors = [t for t in checked if isinstance(t, torch.Tensor)]
        on = [t for t in tensors if self.is_on(t)]
        host = [t for t in tensors if not self.is_on(t) and t.dim() > 0]
        if on and host and name not in _MOVES:
            where = ", ".join(f"{'device' if self.is_on(t) else 'host'} {tuple(t.shape)}" for t in tensors)
            raise DeviceMismatch(f"{name} mixes the device and the host: {where}")
        out = func(*args, **kwargs)
        if name in _MOVES:
            result_on = self.is_on(args[0]) if named is None else named
            if out is args[0] and result_on != self.is_on(args[0]):
                out = out.clone()  # a real move makes a new tensor; the source stays where it was
        elif named is not None:
            result_on = named
        elif args and (name in _INDEXING or name in _COPIES or name.endswith("_")):
            result_on = self.is_on(args[0])  # in place: the result is the first argument
        else:
            result_on = bool(on)
        if not (out is args[0] if args else False) or name in _MOVES:
            self._tag(out, result_on)
        return out


ACTIVE: DeviceEmulation | None = None  # set by conftest.py for the session when ANCHORSPEC_TEST_DEVICE=emulated


def start() -> DeviceEmulation:
    """The session's emulation (conftest.py): the CPU-only fast paths treat its device as a GPU's."""
    global ACTIVE
    from anchorspec.models import dtype

    ACTIVE = DeviceEmulation()
    dtype.virtual_device = ACTIVE.is_on
    return ACTIVE


def stop() -> None:
    global ACTIVE
    from anchorspec.models import dtype

    ACTIVE, dtype.virtual_device = None, None


@contextlib.contextmanager
def emulating():
    """The running emulation, or a new one for the length of the block."""
    if ACTIVE is not None:
        yield ACTIVE
        return
    mode = start()
    try:
        with mode:
            yield mode
    finally:
        stop()


def test_device(model: torch.nn.Module) -> torch.nn.Module:
    """Where tests/helpers.py puts a tiny model: ANCHORSPEC_TEST_DEVICE (unset: the CPU; cuda on a GPU;
    emulated: the CPU, its parameters on this module's virtual device)."""
    if ACTIVE is not None:
        return ACTIVE.place(model)
    return model.to(device=os.environ.get("ANCHORSPEC_TEST_DEVICE", "cpu"))
