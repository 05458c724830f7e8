"""A processed prompt's pixels moved to memory of their own: an anonymous mapping per tensor.

A worker thread allocates an input's pixel tensor (about 1 MB for a 448 px image) from its own glibc
arena; the engine's thread frees it once the image is encoded, at a time no worker can predict, while
the arena has served the next inputs' blocks around it. With the CPU engine's `keep_freed_memory`
(every freed block kept for reuse) those holes pile up over thousands of inputs and the peak RSS grows
with the number of inputs (docs/input_pipeline.md). Copied into an anonymous `mmap` of its own (a
memcpy and a fault per page, well under a millisecond against ~20 ms of preprocessing), the pixels
leave no hole: the worker frees its own block at once (the next input reuses it) and the mapping goes
back to the kernel when the engine drops the pixels.
"""

from __future__ import annotations

import mmap

import torch

from vlmrun.processors import ProcessedPrompt


def mapped_copy(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` (CPU, contiguous or not) copied into an anonymous mapping that lives as long as the copy."""
    size = tensor.numel() * tensor.element_size()
    if size == 0:
        return tensor.clone()
    buffer = mmap.mmap(-1, size)
    out = torch.frombuffer(buffer, dtype=tensor.dtype, count=tensor.numel()).view(tensor.shape)
    out.copy_(tensor)
    return out


def map_pixels(prompt: ProcessedPrompt) -> ProcessedPrompt:
    """`prompt` with each item's CPU pixel tensor moved to its own mapping (in place; returned)."""
    for item in prompt.mm_items:
        pixels = item.pixel_values
        if pixels is not None and pixels.device.type == "cpu":
            item.pixel_values = mapped_copy(pixels)
    return prompt
