"""The model families vlmrun serves, one registry line each: `FAMILIES`.

A line maps an HF `architectures` name (config.json) to the `Model` subclass that runs it (module and
class name, imported lazily by `vlmrun.models.registry`) and to how its checkpoints' media are
processed (`ProcessorStyle`, read by `vlmrun.processors.Processor.from_pretrained`; None for a
text-only family). Everything else a family owns lives on its model class: prompt positions
(`Model.prompt_positions`), multimodal extras (`Model.mm_extras`), its blocks. Adding a family:
docs/adding_a_model.md.

This module sits on the bottom floor (it imports nothing from vlmrun), so both the input processors
(bottom floor) and the model registry read the same table.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional, Sequence

Style = Literal["qwen2", "qwen3"]


@dataclass(frozen=True)
class ProcessorStyle:
    """How a family's checkpoints take videos, where the checkpoint's own files do not say.

    video: how frames are sampled and sized (`vlmrun.processors.video_config.VideoProcessorConfig.style`):
        "qwen2" (`Qwen2VLVideoProcessor`) or "qwen3" (`Qwen3VLVideoProcessor`), for a video config that
        names no class transformers maps.
    prompt: how a video is written into the prompt (`Processor.video_prompt`): "qwen2" (one run of pads,
        `Qwen2_5_VLProcessor`) or "qwen3" (timestamped temporal groups, `Qwen3VLProcessor`), for a
        checkpoint whose files name no processor class.
    """

    video: Style
    prompt: Style


QWEN2_5_VL_MEDIA = ProcessorStyle(video="qwen2", prompt="qwen2")
QWEN3_VL_MEDIA = ProcessorStyle(video="qwen3", prompt="qwen3")
# a checkpoint of no registered architecture is read in the newest style (what transformers maps the
# newer Qwen-VL model types to)
DEFAULT_MEDIA = QWEN3_VL_MEDIA


@dataclass(frozen=True)
class Family:
    """One registry line: the model class of an architecture and its media processing (None: text only)."""

    module: str  # e.g. "vlmrun.models.qwen3_vl"
    class_name: str  # a `vlmrun.models.base.Model` subclass in `module`
    media: Optional[ProcessorStyle]


FAMILIES: dict[str, Family] = {
    "Qwen3ForCausalLM": Family("vlmrun.models.qwen3", "Qwen3ForCausalLM", None),
    "Qwen3VLForConditionalGeneration": Family("vlmrun.models.qwen3_vl", "Qwen3VLForConditionalGeneration",
                                              QWEN3_VL_MEDIA),
    "Qwen2_5_VLForConditionalGeneration": Family("vlmrun.models.qwen2_5_vl", "Qwen2_5_VLForConditionalGeneration",
                                                 QWEN2_5_VL_MEDIA),
    "Qwen3VLMoeForConditionalGeneration": Family("vlmrun.models.qwen3_vl", "Qwen3VLMoeForConditionalGeneration",
                                                 QWEN3_VL_MEDIA),
    "Qwen3_5ForConditionalGeneration": Family("vlmrun.models.qwen3_5", "Qwen3_5ForConditionalGeneration",
                                              QWEN3_VL_MEDIA),
    "Qwen3_5MoeForConditionalGeneration": Family("vlmrun.models.qwen3_5", "Qwen3_5MoeForConditionalGeneration",
                                                 QWEN3_VL_MEDIA),
    "Qwen3NextForCausalLM": Family("vlmrun.models.qwen3_next", "Qwen3NextForCausalLM", None),
}


def family_of(architectures: Optional[Sequence[str]]) -> Optional[tuple[str, Family]]:
    """(name, family) of the first registered name in `architectures` (config.json's), None if none is."""
    for name in architectures or ():
        if name in FAMILIES:
            return name, FAMILIES[name]
    return None


def media_style(architectures: Optional[Sequence[str]]) -> ProcessorStyle:
    """The media processing of the checkpoint's family; `DEFAULT_MEDIA` for an unregistered (or text-only)
    architecture, whose checkpoint may still carry processor files."""
    found = family_of(architectures)
    return found[1].media if found is not None and found[1].media is not None else DEFAULT_MEDIA
