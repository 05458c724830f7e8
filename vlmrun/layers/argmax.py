"""`last_dim_argmax(x)`: `torch.argmax(x, dim=-1)` of a step's logits, the same indices, quicker on the CPU.

On the CPU, torch's argmax over the last dim walks (value, index) pairs one element at a time: about
0.9 ns an element on one core of this project's machine, so a greedy step over a real vocabulary (151,936
entries) at batch 256 spends 35 ms in it. `amax` over a short contiguous last dim is vectorized (about
0.1 ns an element). So each row is cut into blocks of `width` entries:

1. the block maxima, `amax` over [rows, blocks, width] -> [rows, blocks];
2. the first block whose maximum is the row's: `argmax` over the block maxima (rows x blocks elements);
3. the first maximum inside that block: `argmax` over its `width` entries.

That is torch.argmax's answer, ties and NaN included. torch.argmax returns the first maximum, a NaN
counting as above everything (the first NaN wins). `amax` propagates NaN, so step 2 picks the first block
holding a NaN when there is one, else the first block holding the row's maximum (an earlier block's
maximum is smaller), and step 3 finds that NaN or maximum inside it. An all -inf row gives 0 either way.
tests/test_argmax.py checks it against torch.argmax on rows full of ties, NaN and infinities.

Measured on one core (`python -m bench.bench_argmax`, BENCHMARKS.md): 1.9x at [256, 512], 2.7-6x at Qwen's
vocabularies ([256, 151936]: 32.4 -> 6.8 ms in a quiet run). On CUDA torch.argmax is one quick kernel: used as is,
and so is it for fewer than `MIN_ELEMENTS` logits, a vocabulary no block width divides, a non-contiguous tensor.
"""

from __future__ import annotations

from typing import Optional

import torch

WIDTHS = (128, 64, 32)  # block widths tried, widest first
WIDE_VOCAB = 16384  # from this vocabulary size on, the widest width that divides it; below it, 32
MIN_ELEMENTS = 65536  # below this many logits the three calls cost more than one argmax ([64, 512]: even)


def block_width(vocab_size: int) -> Optional[int]:
    """The block width for rows of `vocab_size` entries, or None (no width divides it: plain argmax)."""
    widths = WIDTHS if vocab_size >= WIDE_VOCAB else WIDTHS[-1:]
    return next((w for w in widths if vocab_size % w == 0 and vocab_size > w), None)


def last_dim_argmax(x: torch.Tensor) -> torch.Tensor:
    """x: [rows, vocab] -> [rows] int64, equal to `x.argmax(dim=-1)` (module docstring)."""
    blocked = x.device.type == "cpu" and x.dim() == 2 and x.is_contiguous() and x.numel() >= MIN_ELEMENTS
    width = block_width(x.shape[-1]) if blocked else None
    if width is None:
        return x.argmax(dim=-1)
    rows, vocab = x.shape
    blocks = x.view(rows, vocab // width, width)  # [rows, blocks, width]
    block = blocks.amax(dim=-1).argmax(dim=-1)  # [rows] the first block holding the row's maximum (or NaN)
    inside = torch.gather(blocks, 1, block.view(rows, 1, 1).expand(rows, 1, width))  # [rows, 1, width]
    return block * width + inside.view(rows, width).argmax(dim=-1)  # [rows]
