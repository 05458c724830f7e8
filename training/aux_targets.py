"""Auxiliary training signals: linear probes on the model's hidden states, dropped after training
(the shipped checkpoint is a plain Qwen3.5).

- Vision probe. From scratch, a tiny VLM trained only on answer tokens sits for a long time on the
  "blind" plateau: at first the language model averages all image tokens, a small shape moves that
  average by ~1 %, and the gradient that should teach the vision tower what a shape is stays faint.
  So a probe reads every merged vision token (the embeddings the language model receives) and
  predicts four labels: the kind, colour and size of the shape covering that 32 x 32 cell (or
  "none") and which third of the picture the cell lies in. The dense, local signal teaches the
  tower shapes, colours and positions in a few hundred steps.
- Question probe. A question that names a shape ("Where is the red circle?", "What colour is the
  shape on the left?") needs the model to find that shape among the image tokens. Learned from the
  one answer token alone, that lookup stayed at chance (the answer for a random shape) for 4,000
  steps. So a second probe reads the hidden state of the question's last word (the one that
  completes the name: "circle", "left") after the first full-attention layer and predicts the
  named shape's kind, colour and third: the lookup is taught where it can happen; the answer then only
  has to copy it from there.
"""

from __future__ import annotations

import numpy as np
import torch
from PIL import Image

from vlmrun.shape_scenes import COLOURS, SHAPES, SIZES, SLOTS, Scene

# label sets: index 0 is "no shape" for kind / colour / size
HEADS: dict[str, int] = {"kind": 1 + len(SHAPES), "colour": 1 + len(COLOURS), "size": 1 + len(SIZES), "slot": len(SLOTS)}
QUESTION_HEADS: dict[str, int] = {"kind": len(SHAPES), "colour": len(COLOURS), "slot": len(SLOTS)}
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


def subject_labels(scene: Scene, subject: int) -> tuple[int, int, int]:
    """(kind, colour, third) of the shape a question names (`QA.subject`)."""
    shape = scene.shapes[subject]
    return SHAPES.index(shape.kind), list(COLOURS).index(shape.colour), SLOTS.index(shape.slot)


def _summed_ce(logits: torch.Tensor, labels: torch.Tensor, heads: dict[str, int]) -> torch.Tensor:
    parts = logits.split(list(heads.values()), dim=-1)
    return sum(torch.nn.functional.cross_entropy(lg, labels[:, i]) for i, lg in enumerate(parts))


class AuxProbe(torch.nn.Module):
    """The vision probe (`vision_loss`) and the question probe (`question_loss`): linear heads whose
    summed cross-entropies are added to the answer loss."""

    def __init__(self, dim: int):
        super().__init__()
        self.proj = torch.nn.Linear(dim, sum(HEADS.values()))
        self.question = torch.nn.Linear(dim, sum(QUESTION_HEADS.values()))

    def vision_loss(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        # tokens: [vision tokens, dim]; labels: [vision tokens, 4]
        return _summed_ce(self.proj(tokens), labels, HEADS)

    def question_loss(self, hidden: torch.Tensor, positions: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        # hidden: [batch, seq, dim]; positions: [batch] (the name's last word, -1: none); labels: [batch, 3]
        rows = (positions >= 0).nonzero().squeeze(1)
        if rows.numel() == 0:
            return hidden.sum() * 0.0
        return _summed_ce(self.question(hidden[rows, positions[rows]]), labels[rows], QUESTION_HEADS)
