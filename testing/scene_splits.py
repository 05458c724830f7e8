"""The training and evaluation splits of the shape scenes, and the one question evaluation asks.

Training draws scenes from split `TRAIN_SEED`; evaluation uses seeds never used in training
(`EVAL_SEED`; the example pictures in assets/images use split 2). A split's scene k is
`vlmrun.shape_scenes.make_scene(seed, k)`.
"""

from __future__ import annotations

import random
from typing import Iterator

from vlmrun.shape_scenes import QA, QA_KINDS, Scene, make_scene

TRAIN_SEED = 0
EVAL_SEED = 1


def iter_scenes(split_seed: int, start: int = 0, count: int | None = None) -> Iterator[Scene]:
    """Scenes `start, start+1, ...` of a split (endless when count is None)."""
    index = start
    while count is None or index < start + count:
        yield make_scene(split_seed, index)
        index += 1


def eval_scenes(count: int = 300, split_seed: int = EVAL_SEED) -> list[Scene]:
    """The held-out evaluation scenes (a split seed never used in training)."""
    return list(iter_scenes(split_seed, 0, count))


def eval_question(scene: Scene) -> QA:
    """The one question asked about an evaluation scene: kinds cycle with the index, then a fixed pick."""
    pairs = scene.qa_pairs()
    kinds = sorted({p.kind for p in pairs}, key=QA_KINDS.index)
    kind = kinds[scene.index % len(kinds)]
    candidates = [p for p in pairs if p.kind == kind]
    return candidates[random.Random(f"eval-question/{scene.split_seed}/{scene.index}").randrange(len(candidates))]
