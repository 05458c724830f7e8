"""Training examples: a scene, a prompt and its answer → token ids, labels and pixels for HF's model.

The prompt goes through vlmrun's own `Processor` (chat template, image preprocessing, image-pad
expansion), so the model is trained on exactly the token ids vlmrun feeds it at inference. The
answer follows the generation prompt and ends with `<|im_end|>`; only answer tokens carry a label.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import torch

from testing.scene_drawing import render_scene_with_masks
from testing.scene_splits import TRAIN_SEED
from training.aux_targets import cell_labels, subject_labels
from vlmrun.processors import Processor
from vlmrun.shape_scenes import DESCRIBE_JSON_PROMPT, DESCRIBE_PROMPT, QA, QA_KINDS, Scene, make_scene, scene_json

IGNORE = -100
# Counting and colours are learned early; telling circles, squares and triangles apart takes longest.
KIND_WEIGHTS: dict[str, float] = {"count": 0.1, "colour": 0.2, "shape": 0.35, "position": 0.35}


@dataclass
class Example:
    """One tokenised (image, prompt, answer) triple."""

    input_ids: list[int]
    n_prompt: int
    pixel_values: torch.Tensor
    grid_thw: tuple[int, int, int]
    aux_labels: torch.Tensor  # [merged tokens, 4] (see training.aux_targets)
    subject_pos: int  # index of the last word of the question, which names the shape (-1: names none)
    subject_labels: tuple[int, int, int]  # kind, colour and third of the named shape (training.aux_targets)


def pick_task(scene: Scene, seed: int, caption_fraction: float, json_fraction: float = 0.0) -> QA:
    """The training prompt/answer drawn for this scene (a fixed function of the scene and seed): its
    caption with probability caption_fraction, its JSON object (`scene_json`) with probability
    json_fraction, else a question (a kind by KIND_WEIGHTS, then a pair). With json_fraction 0 the
    draws are those of the first training stage, which had no JSON task."""
    rng = random.Random(f"task/{seed}/{scene.split_seed}/{scene.index}")
    draw = rng.random()
    if draw < caption_fraction:
        return QA(DESCRIBE_PROMPT, scene.caption, "caption")
    if draw < caption_fraction + json_fraction:
        return QA(DESCRIBE_JSON_PROMPT, scene_json(scene), "json")
    pairs = scene.qa_pairs()
    kinds = sorted({p.kind for p in pairs}, key=QA_KINDS.index)
    kind = rng.choices(kinds, weights=[KIND_WEIGHTS[k] for k in kinds])[0]
    return rng.choice([p for p in pairs if p.kind == kind])


def encode(processor: Processor, scene: Scene, qa: QA) -> Example:
    image, masks = render_scene_with_masks(scene)
    prompt = processor.process_prompt(qa.question, [image])
    answer = processor.tokenizer.encode(qa.answer, add_special_tokens=False)
    end = processor.tokenizer.convert_tokens_to_ids("<|im_end|>")
    (item,) = prompt.mm_items
    _, gh, gw = item.grid_thw
    aux = cell_labels(scene, masks, gh // 2, gw // 2)
    subject_pos, subject = -1, (0, 0, 0)
    if qa.subject is not None:
        mark = processor.tokenizer.convert_tokens_to_ids("?")
        subject_pos = max(i for i, t in enumerate(prompt.token_ids) if t == mark) - 1  # "circle" in "...circle?"
        subject = subject_labels(scene, qa.subject)
    return Example(list(prompt.token_ids) + answer + [end], len(prompt.token_ids), item.pixel_values, item.grid_thw,
                   aux, subject_pos, subject)


def training_batch(processor: Processor, split_seed: int, start: int, size: int, task_seed: int,
                   caption_fraction: float, json_fraction: float = 0.0) -> list[Example]:
    """Scenes start .. start+size-1 of the split, one task each."""
    out = []
    for index in range(start, start + size):
        scene = make_scene(split_seed, index)
        out.append(encode(processor, scene, pick_task(scene, task_seed, caption_fraction, json_fraction)))
    return out


def collate(examples: list[Example], pad_id: int, image_id: int) -> dict[str, torch.Tensor]:
    """Right-padded batch: input_ids, attention_mask, labels (next-token targets), pixels, grids, token
    types, and the probes' targets (aux_labels, subject_pos, subject_labels: popped before the model's forward)."""
    length = max(len(e.input_ids) for e in examples)
    ids = torch.full((len(examples), length), pad_id, dtype=torch.long)
    mask = torch.zeros((len(examples), length), dtype=torch.long)
    labels = torch.full((len(examples), length), IGNORE, dtype=torch.long)
    for row, e in enumerate(examples):
        n = len(e.input_ids)
        ids[row, :n] = torch.tensor(e.input_ids)
        mask[row, :n] = 1
        # position t predicts token t+1: label the positions whose next token is an answer token
        labels[row, e.n_prompt - 1 : n - 1] = ids[row, e.n_prompt : n]
    return {
        "input_ids": ids,
        "attention_mask": mask,
        "labels": labels,
        "pixel_values": torch.cat([e.pixel_values for e in examples]),
        "image_grid_thw": torch.tensor([e.grid_thw for e in examples], dtype=torch.long),
        "mm_token_type_ids": (ids == image_id).to(torch.int32),
        "aux_labels": torch.cat([e.aux_labels for e in examples]),
        "subject_pos": torch.tensor([e.subject_pos for e in examples], dtype=torch.long),
        "subject_labels": torch.tensor([e.subject_labels for e in examples], dtype=torch.long),
    }


class StageBatches(torch.utils.data.Dataset):
    """Batch number s of a training stage's deterministic stream: training scenes first_scene + s*size ..,
    one task each (`pick_task` with the stage's seed and shares), collated; rendered in a worker process."""

    def __init__(self, model_dir: Path, steps: int, first_scene: int, size: int, task_seed: int,
                 caption_fraction: float, json_fraction: float, pad: int, image: int):
        self.model_dir, self.steps, self.first_scene, self.size = model_dir, steps, first_scene, size
        self.task_seed, self.caption_fraction, self.json_fraction = task_seed, caption_fraction, json_fraction
        self.pad, self.image = pad, image
        self._processor: Processor | None = None

    def __len__(self) -> int:
        return self.steps

    def __getitem__(self, step: int) -> dict[str, torch.Tensor]:
        if self._processor is None:
            self._processor = Processor.from_pretrained(self.model_dir)
        examples = training_batch(self._processor, TRAIN_SEED, self.first_scene + step * self.size, self.size,
                                  self.task_seed, self.caption_fraction, self.json_fraction)
        return collate(examples, self.pad, self.image)
