"""A CPU stand-in for `torch.cuda.set_sync_debug_mode("error")` over a model runner's `launch`.

On CUDA a step's launch must only queue work: any read of a device value on the host, and any
blocking copy between host and device, makes the host wait for the device (and breaks async
scheduling and CUDA graphs). On the CPU nothing waits, so `LaunchSyncGuard` (a `TorchFunctionMode`)
follows which tensors *would* live on the device and records (and raises) a `HostSync` where the
launch would wait.

Which tensors are device-resident (the rule):
1. a tensor that existed before the launch and did not come in through its chunks: the runner's
   state (weights, caches, its buffers, encoder-cache embeddings, LoRA slots) lives on its device,
   while the chunks' tensors (positions, KV slots, pixels) are the scheduler's host metadata;
2. a tensor a launch op makes from a device-resident one (any tensor input);
3. a tensor a factory makes with an explicit `device=` (how code puts a new tensor on the runner's
   device; host metadata is made without one; `device="cpu"` spelled as that string stays host);
4. a tensor moved onto the device: `.to(device)`, `upload`, `copy_` into a device-resident tensor;
   also a device tensor on its way to the host (`.to("cpu", non_blocking=True)`: not readable yet).

What counts as a sync (each recorded with the vlmrun line that did it):
- a host read of a device-resident tensor: `item`, `tolist`, `bool`, `int`, `float`, `index`,
  formatting, `numpy`, `cpu()` / `.to("cpu")` / `copy_` to a host tensor without `non_blocking`,
  `torch.equal` / `allclose` / `is_nonzero`;
- a device op whose output size depends on device values: `nonzero`, `argwhere`, `masked_select`,
  `unique`, `bincount`, `repeat_interleave` without `output_size`, one-argument `where`, indexing
  with a boolean tensor;
- a blocking copy host -> device: `.to(device)` or `copy_` without `non_blocking=True`,
  `torch.tensor(data, device=...)`;
- a host tensor (more than a scalar) in a device op: on CUDA either an error or an implicit blocking
  copy (a CPU index tensor into a CUDA tensor is copied up before the kernel).

Library internals called by one intercepted function are not seen (the mode is off inside it), nor
are syncs inside a C++ kernel of the CPU build; `bincount` and friends are listed for that reason.
"""

from __future__ import annotations

import dataclasses
import traceback
import weakref
from typing import Any, Callable, Iterable, Optional

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

Tensor = torch.Tensor


class HostSync(AssertionError):
    """A launch did something that makes the host wait for the device on CUDA."""


READS = {Tensor.item, Tensor.tolist, Tensor.__bool__, Tensor.__int__, Tensor.__float__, Tensor.__index__,
         Tensor.__format__, Tensor.__repr__, Tensor.numpy, Tensor.__array__, Tensor.__contains__,
         Tensor.cpu, Tensor.equal, Tensor.allclose, Tensor.is_nonzero,
         torch.equal, torch.allclose, torch.is_nonzero}
DATA_DEPENDENT = {torch.nonzero, Tensor.nonzero, torch.argwhere, Tensor.argwhere, torch.masked_select,
                  Tensor.masked_select, torch.unique, Tensor.unique, torch.unique_consecutive,
                  Tensor.unique_consecutive, torch.bincount, Tensor.bincount}
FACTORIES = {torch.zeros, torch.ones, torch.empty, torch.full, torch.arange, torch.rand, torch.randn,
             torch.randint, torch.linspace, torch.eye, torch.empty_strided, torch.randperm}
UPLOADING_FACTORIES = {torch.tensor, torch.as_tensor}
INDEXING = {Tensor.__getitem__, Tensor.__setitem__}


class TensorSet:
    """Tensors by identity (a WeakSet would compare tensors with ==)."""

    def __init__(self) -> None:
        self._refs: dict[int, weakref.ref] = {}

    def add(self, t: Tensor) -> None:
        key = id(t)
        self._refs[key] = weakref.ref(t, lambda _, key=key: self._refs.pop(key, None))

    def __contains__(self, t: Tensor) -> bool:
        ref = self._refs.get(id(t))
        return ref is not None and ref() is t


def host_tensors(root: Any, depth: int = 5) -> TensorSet:
    """Every tensor reachable from `root` (dataclass fields, containers, object attributes)."""
    found, seen = TensorSet(), set()

    def walk(obj: Any, level: int) -> None:
        if level < 0 or id(obj) in seen or isinstance(obj, (str, bytes, int, float, bool, type(None))):
            return
        seen.add(id(obj))
        if isinstance(obj, Tensor):
            found.add(obj)
        elif isinstance(obj, dict):
            for v in obj.values():
                walk(v, level - 1)
        elif isinstance(obj, (list, tuple, set, frozenset)):
            for v in obj:
                walk(v, level - 1)
        elif dataclasses.is_dataclass(obj) or hasattr(obj, "__dict__"):
            for v in getattr(obj, "__dict__", {}).values():
                walk(v, level - 1)
            for f in dataclasses.fields(obj) if dataclasses.is_dataclass(obj) else ():
                walk(getattr(obj, f.name, None), level - 1)

    walk(root, depth)
    return found


def _tensors_in(result: Any) -> list[Tensor]:
    """The tensors a torch function returned (a tensor, tuples of them, `torch.return_types` included)."""
    if isinstance(result, Tensor):
        return [result]
    if isinstance(result, (tuple, list)):
        return [t for r in result for t in _tensors_in(r)]
    return []


def _where(skip: str = "launch_sync_guard") -> str:
    """The innermost vlmrun frame of the current stack: 'path:line in function'."""
    for frame in reversed(traceback.extract_stack()):
        if "/vlmrun/" in frame.filename and skip not in frame.filename:
            return f"{frame.filename.split('/vlmrun/', 1)[1]}:{frame.lineno} in {frame.name}"
    return "?"


class LaunchSyncGuard(TorchFunctionMode):
    """Records (and raises) every host sync of the code run inside it; `host_inputs`: the launch's chunks."""

    def __init__(self, host_inputs: Any, raise_on_sync: bool = True):
        super().__init__()
        self.host = host_tensors(host_inputs)
        self.device = TensorSet()
        self.made = TensorSet()  # tensors made inside the launch
        self.syncs: list[str] = []
        self.raise_on_sync = raise_on_sync

    def on_device(self, t: Tensor) -> bool:
        if t in self.device:
            return True
        if t in self.made or t in self.host:
            return False
        self.device.add(t)  # runner state from before the launch (rule 1)
        return True

    def sync(self, what: str) -> None:
        message = f"{what} at vlmrun/{_where()}"
        self.syncs.append(message)
        if self.raise_on_sync:
            raise HostSync(message)

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: Optional[dict] = None):
        kwargs = kwargs or {}
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, Tensor)]
        resident = [t for t in tensors if self.on_device(t)]
        name = getattr(func, "__name__", repr(func))
        out_on_device = bool(resident)
        if resident:
            self.check_device_op(func, name, args, kwargs, tensors, resident)
        if func in (Tensor.to, Tensor.cuda):
            out_on_device = self.check_move(name, args, kwargs, bool(resident))
        elif func is Tensor.copy_:
            out_on_device = self.check_copy(args, kwargs)
        elif func in FACTORIES or func in UPLOADING_FACTORIES:
            device = kwargs.get("device")
            out_on_device = device is not None and device != "cpu"
            if out_on_device and func in UPLOADING_FACTORIES:
                self.sync(f"torch.{name}(host data, device=...) copies up blocking")
        result = func(*args, **kwargs)
        if out_on_device and not resident and result is args[0]:
            result = result.view_as(result)  # an upload the CPU made a no-op: a tensor of its own, as on CUDA
        for t in _tensors_in(result):
            self.made.add(t)
            if out_on_device:
                self.device.add(t)
        return result

    def check_device_op(self, func: Callable, name: str, args: tuple, kwargs: dict, tensors: list[Tensor],
                        resident: list[Tensor]) -> None:
        if func in READS:
            self.sync(f"Tensor.{name} reads a device tensor on the host")
        elif func in DATA_DEPENDENT:
            self.sync(f"{name} on a device tensor (output size read from the device)")
        elif func in (torch.repeat_interleave, Tensor.repeat_interleave) and kwargs.get("output_size") is None \
                and any(isinstance(a, Tensor) for a in args[1:2]):
            self.sync("repeat_interleave with tensor repeats and no output_size")
        elif func is torch.where and len(args) + len(kwargs) == 1:
            self.sync("one-argument torch.where (nonzero)")
        elif func in INDEXING and len(args) > 1 and any(
                isinstance(t, Tensor) and t.dtype == torch.bool and t.dim() > 0 for t in tree_flatten(args[1])[0]):
            self.sync(f"Tensor.{name} with a boolean mask (nonzero)")
        if func not in (Tensor.to, Tensor.copy_):
            ids = {id(t) for t in resident}
            host = [t for t in tensors if id(t) not in ids and t.dim() > 0]
            if host:
                self.sync(f"{name} mixes a host tensor {tuple(host[0].shape)} into a device op")

    def check_move(self, name: str, args: tuple, kwargs: dict, from_device: bool) -> bool:
        """`.to(...)` / `.cuda()`: whether the result is device-resident; a blocking transfer is a sync."""
        target: Optional[bool] = True if name == "cuda" else None  # True: device, False: host, None: stays
        for a in list(args[1:]) + [kwargs.get("device"), kwargs.get("other")]:
            if isinstance(a, str) or isinstance(a, torch.device):
                target = not (isinstance(a, str) and a.split(":")[0] == "cpu")
            elif isinstance(a, Tensor):
                target = self.on_device(a)
        non_blocking = bool(kwargs.get("non_blocking")) or any(a is True for a in args[1:])
        if target is None or target == from_device:
            return from_device
        if not non_blocking:
            self.sync("blocking copy " + ("device -> host" if from_device else "host -> device") + f" ({name})")
        return True  # uploaded, or on its way down (not readable before the step's one sync)

    def check_copy(self, args: tuple, kwargs: dict) -> bool:
        dest, src = args[0], args[1]
        non_blocking = bool(kwargs.get("non_blocking")) or (len(args) > 2 and args[2] is True)
        dest_on, src_on = self.on_device(dest), isinstance(src, Tensor) and self.on_device(src)
        if isinstance(src, Tensor) and dest_on != src_on and src.dim() > 0 and not non_blocking:
            self.sync("blocking copy_ " + ("host -> device" if dest_on else "device -> host"))
        return dest_on or src_on


def syncs_of(fn: Callable[[], Any], host_inputs: Iterable[Any] = ()) -> list[str]:
    """Runs `fn` under a recording (non-raising) guard: the syncs it would make on CUDA."""
    guard = LaunchSyncGuard(list(host_inputs), raise_on_sync=False)
    with guard:
        fn()
    return guard.syncs
