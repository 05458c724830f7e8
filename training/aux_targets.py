"""An auxiliary training signal for the vision tower: what each merged vision token shows.

From scratch, a tiny VLM trained only on answer tokens sits for a long time on the "blind"
plateau: at first the language model averages all image tokens, a small shape moves that average
by ~1 %, and the gradient that should teach the vision tower what a shape is stays faint. So while
training, a linear probe (dropped afterwards; the shipped checkpoint is a plain Qwen3.5) reads every
merged vision token, i.e. the embeddings the language model receives, and predicts four labels:
the kind, colour and size of the shape covering that 32 x 32 cell (or "none") and which third of
the picture the cell lies in. The dense, local signal teaches the tower shapes, colours and
positions in a few hundred steps; the answer loss then only has to learn to read them.
"""

from __future__ import annotations

import numpy as np
import torch
from PIL import Image

from vlmrun.synthetic import COLOURS, SHAPES, SIZES, SLOTS, Scene

# label sets: index 0 is "no shape" for kind / colour / size
HEADS: dict[str, int] = {"kind": 1 + len(SHAPES), "colour": 1 + len(COLOURS), "size": 1 + len(SIZES), "slot": len(SLOTS)}
MIN_COVERAGE = 0.03  # a cell shows a shape when the shape covers at least this share of it


def cell_labels(scene: Scene, masks: list[np.ndarray], grid_h: int, grid_w: int) -> torch.Tensor:
    """[grid_h * grid_w, 4] long labels (kind, colour, size, slot) for the merged-token grid, row-major."""
    coverage = np.zeros((len(masks), grid_h, grid_w), dtype=np.float32)
    for k, mask in enumerate(masks):
        cells = Image.fromarray(mask.astype(np.float32), "F").resize((grid_w, grid_h), Image.Resampling.BOX)
        coverage[k] = np.asarray(cells)
    labels = np.zeros((grid_h, grid_w, 4), dtype=np.int64)
    cols = (np.arange(grid_w) + 0.5) / grid_w
    labels[..., 3] = np.minimum((cols * 3).astype(np.int64), 2)[None, :]
    if masks:
        best = coverage.argmax(0)
        present = coverage.max(0) >= MIN_COVERAGE
        for k, shape in enumerate(scene.shapes):
            sel = present & (best == k)
            labels[sel, 0] = 1 + SHAPES.index(shape.kind)
            labels[sel, 1] = 1 + list(COLOURS).index(shape.colour)
            labels[sel, 2] = 1 + SIZES.index(shape.size)
            labels[sel, 3] = SLOTS.index(shape.slot)  # a shape's cells carry the shape's third
    return torch.from_numpy(labels.reshape(-1, 4))


class AuxProbe(torch.nn.Module):
    """Linear heads on the merged vision tokens; the summed cross-entropy of the four labels."""

    def __init__(self, dim: int):
        super().__init__()
        self.proj = torch.nn.Linear(dim, sum(HEADS.values()))

    def loss(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = self.proj(tokens).split(list(HEADS.values()), dim=-1)
        return sum(torch.nn.functional.cross_entropy(lg, labels[:, i]) for i, lg in enumerate(logits))
