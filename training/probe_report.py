"""What the vision tower has learned so far: `python -m training.probe_report DIR [--scenes N]`.

DIR is a training output directory holding a snapshot (`resume_state.pt`, written every 250 steps
while training runs; copy it aside to keep one from a given step). The snapshot's vision probe
(training/aux_targets.py) reads the tower's merged tokens on held-out scenes; the report gives its
per-cell accuracy for each label (kind, colour, size, third) on the cells that show a shape, and
the kind confusion matrix. A label the probe cannot read there is one the language model cannot
read either.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from testing.scene_drawing import render_scene_with_masks
from testing.scene_splits import EVAL_SEED, eval_scenes
from training.aux_targets import HEADS, AuxProbe, cell_labels
from training.checkpoint_files import RESUME_FILE, ModelSize, build_config
from vlmrun.processors import Processor
from vlmrun.shape_scenes import DESCRIBE_PROMPT, SHAPES


@torch.no_grad()
def probe_accuracy(out: Path, scenes: int) -> tuple[int, dict[str, float], torch.Tensor]:
    """(snapshot step, per-label accuracy on shape cells, [1 + kinds, 1 + kinds] kind confusion counts)."""
    from transformers import Qwen3_5ForConditionalGeneration

    processor = Processor.from_pretrained(out)
    config = build_config(processor.tokenizer, ModelSize())
    state = torch.load(out / RESUME_FILE, weights_only=False)
    model = Qwen3_5ForConditionalGeneration(config).eval()
    model.load_state_dict(state["model"])
    probe = AuxProbe(config.text_config.hidden_size)
    probe.load_state_dict(state["probe"])
    correct, total = torch.zeros(len(HEADS)), 0
    confusion = torch.zeros(HEADS["kind"], HEADS["kind"], dtype=torch.long)
    for scene in eval_scenes(scenes, EVAL_SEED):
        image, masks = render_scene_with_masks(scene)
        (item,) = processor.process_prompt(DESCRIBE_PROMPT, [image]).mm_items
        _, grid_h, grid_w = item.grid_thw
        tokens = model.model.visual(item.pixel_values, grid_thw=torch.tensor([item.grid_thw])).pooler_output
        labels = cell_labels(scene, masks, grid_h // 2, grid_w // 2)  # [cells, 4]
        predicted = torch.stack([lg.argmax(-1) for lg in probe.proj(tokens).split(list(HEADS.values()), -1)], 1)
        shown = labels[:, 0] > 0
        correct += (predicted[shown] == labels[shown]).sum(0)
        total += int(shown.sum())
        confusion.index_put_((labels[:, 0], predicted[:, 0]), torch.ones(len(labels), dtype=torch.long), accumulate=True)
    return state["step"], {name: float(c) / total for name, c in zip(HEADS, correct)}, confusion


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="training output directory with resume_state.pt")
    parser.add_argument("--scenes", type=int, default=60)
    args = parser.parse_args(argv)
    step, accuracy, confusion = probe_accuracy(args.out, args.scenes)
    print(f"step {step}: probe accuracy on cells showing a shape: "
          + ", ".join(f"{name} {100 * a:.1f} %" for name, a in accuracy.items()))
    names = ("none", *SHAPES)
    print("kind confusion (rows: true, columns: predicted): " + " ".join(names))
    for name, row in zip(names, confusion.tolist()):
        print(f"  {name:>8} {row}")


if __name__ == "__main__":
    main()
