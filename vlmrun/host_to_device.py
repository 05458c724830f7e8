"""Host tensors to the device without making the host wait for the device.

A plain `.to("cuda")` from pageable memory returns only when the copy is done, so it waits for every
kernel queued before it: under async scheduling that would make planning step N+1 wait for step N.
`upload` copies from pinned memory without blocking (the caching host allocator keeps the pinned
block until the copy has run). Every host-built tensor that goes up in a step uses it.
"""

from __future__ import annotations

import array
from typing import Sequence

import torch


def upload(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`host` (a CPU tensor) on `device`: queued behind the device's work on CUDA, a plain move elsewhere
    (non-blocking there too, as on CUDA: on the CPU the tensor itself)."""
    if device.type != "cuda":
        return host.to(device, non_blocking=True)
    return host.pin_memory().to(device, non_blocking=True)


def int64_tensor(values: Sequence[int]) -> torch.Tensor:
    """A host int64 tensor [n] of `values` (Python ints), about twice as fast as `torch.tensor(values)` for
    the step's few-hundred-long lists: one copy into an `array` buffer, which the tensor then shares
    (a short list goes through `torch.tensor`, quicker there)."""
    if len(values) < 8:
        return torch.tensor(values, dtype=torch.int64)
    return torch.frombuffer(array.array("q", values), dtype=torch.int64)
