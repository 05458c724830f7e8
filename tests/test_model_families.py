"""What a model family registers, and that each part is read from the family (docs/adding_a_model.md).

A family is one line of `vlmrun.families.FAMILIES` (its model class and its media processing) and its
`Model` class (prompt positions, multimodal extras). Every registered family must provide each part:
a new one that leaves one out fails here. The parts are then read from the family, not from shared
code: the processor's styles from the registry line, the engine's positions from the class, the
model's extras through the vision stage under names the model chose.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import transformers

from vlmrun.cache.encoder_cache import EncoderCache
from vlmrun.families import DEFAULT_MEDIA, FAMILIES, QWEN2_5_VL_MEDIA, Family
from vlmrun.models.base import Model
from vlmrun.models.blocks.vision_common import VisionEmbeddings
from vlmrun.models.registry import get_model_class, prompt_positions
from vlmrun.multimodal.prompt_positions import LinearPositions, MRopePositions
from vlmrun.multimodal.vision_stage import ChunkSpan, VisionStage
from vlmrun.processors import Processor
from vlmrun.processors.placeholders import MMItem

# the tiny checkpoint fixture (tests/conftest.py) of each family that takes media
MEDIA_FIXTURES = {
    "Qwen2_5_VLForConditionalGeneration": "qwen2_5_vl_dir",
    "Qwen3VLForConditionalGeneration": "qwen3_vl_dir",
    "Qwen3VLMoeForConditionalGeneration": "qwen3_vl_moe_dir",
    "Qwen3_5ForConditionalGeneration": "qwen3_5_dir",
    "Qwen3_5MoeForConditionalGeneration": "qwen3_5_moe_dir",
}


def _default_config(arch: str):
    """The HF default config of `arch` (no weights, nothing read from disk), naming the architecture."""
    config = getattr(transformers, arch).config_class()
    config.architectures = [arch]
    return config


@pytest.mark.parametrize("arch", sorted(FAMILIES))
def test_every_family_registers_each_part(arch):
    family = FAMILIES[arch]
    cls = get_model_class([arch])
    assert issubclass(cls, Model) and cls.__name__ == family.class_name
    takes_media = family.media is not None
    assert cls.supports_images == takes_media, "a family with media processing has a vision tower, and back"
    config = _default_config(arch)
    positions = cls.prompt_positions(config)
    assert isinstance(positions, MRopePositions if takes_media else LinearPositions), (
        f"{arch}: a VL family places its prompts with M-RoPE, a text-only one with 1-D positions")
    if takes_media:
        assert {family.media.video, family.media.prompt} <= {"qwen2", "qwen3"}
    else:
        assert cls.mm_extras == ()
    assert isinstance(cls.mm_extras, tuple) and all(isinstance(n, str) for n in cls.mm_extras)
    pos, delta = prompt_positions(config, list(range(7)), [])  # the engine's one call: text only
    assert torch.equal(pos, torch.arange(7).expand(3, -1)) and delta == 0


def test_every_media_family_has_a_checkpoint_checked_here():
    assert set(MEDIA_FIXTURES) == {a for a, f in FAMILIES.items() if f.media is not None}


@pytest.mark.parametrize("arch", sorted(MEDIA_FIXTURES))
def test_the_vision_tower_returns_exactly_the_extras_its_class_names(request, arch):
    model_dir = request.getfixturevalue(MEDIA_FIXTURES[arch])
    config = transformers.AutoConfig.from_pretrained(model_dir)
    torch.manual_seed(0)
    model = get_model_class([arch])(config).eval()
    vision = config.vision_config
    patch_dim = getattr(vision, "in_channels", 3) * vision.temporal_patch_size * vision.patch_size ** 2
    with torch.no_grad():
        out = model.encode_images(torch.randn(2 * 16, patch_dim), [(1, 4, 4), (1, 4, 4)])  # 4 tokens each
    assert out.embeds.shape[0] == 8
    assert set(out.extras) == set(model.mm_extras)
    assert all(extra.shape[-2] == 8 for extra in out.extras.values())  # image rows on the second-to-last dim


def test_text_only_family_refuses_media_through_the_same_call():
    item = MMItem(hash="x", offset=0, length=4, pixel_values=None, grid_thw=(1, 4, 4))
    with pytest.raises(ValueError, match="takes no images"):
        prompt_positions(_default_config("Qwen3ForCausalLM"), [5] * 4, [item])


def _without_processor_names(model_dir: Path, out: Path, architecture: str) -> Path:
    """The checkpoint with `architecture` in config.json, a model type transformers does not know, and no file
    naming a processor or video processor class: only the family can say how it takes videos."""
    shutil.copytree(model_dir, out)
    (out / "video_preprocessor_config.json").unlink(missing_ok=True)
    config = json.loads((out / "config.json").read_text())
    config.update(architectures=[architecture], model_type="a_new_vl")
    (out / "config.json").write_text(json.dumps(config))
    for name in ("preprocessor_config.json", "tokenizer_config.json"):
        data = json.loads((out / name).read_text())
        data.pop("processor_class", None)
        if name == "preprocessor_config.json":
            data["image_processor_type"] = "Qwen2VLImageProcessorFast"  # an image class with no video twin
        (out / name).write_text(json.dumps(data))
    return out


def test_the_processor_takes_its_styles_from_the_registry_line(qwen3_vl_dir, tmp_path, monkeypatch):
    """One registry line gives a new family its processor styles; an unregistered architecture gets the default."""
    model_dir = _without_processor_names(qwen3_vl_dir, tmp_path / "ckpt", "ANewVLForConditionalGeneration")
    unregistered = Processor.from_pretrained(model_dir)
    assert (unregistered.video_prompt, unregistered.video_processor.config.style) == (
        DEFAULT_MEDIA.prompt, DEFAULT_MEDIA.video) == ("qwen3", "qwen3")
    monkeypatch.setitem(FAMILIES, "ANewVLForConditionalGeneration",
                        Family("vlmrun.models.qwen2_5_vl", "Qwen2_5_VLForConditionalGeneration", QWEN2_5_VL_MEDIA))
    registered = Processor.from_pretrained(model_dir)
    assert (registered.video_prompt, registered.video_processor.config.style) == ("qwen2", "qwen2")


class _ModelWithItsOwnExtras(torch.nn.Module):
    """A vision tower whose model returns an extra of its own beside the embeddings: [2, tokens, 2]."""

    def encode_images(self, pixel_values: torch.Tensor, grid_thw) -> VisionEmbeddings:
        embeds = pixel_values[::4, :2]  # [tokens, 2]: one row per 4 patches
        return VisionEmbeddings(embeds, {"a_new_extra": torch.stack([embeds * 10, embeds * 100])})


def test_a_models_own_extras_reach_the_batch_sliced_like_the_embeddings():
    """The vision stage caches, slices and joins extras it knows nothing of: an image split across two
    prefill chunks gets its extra's rows in both, the second from the encoder cache."""
    pixels = torch.arange(16 * 3, dtype=torch.float32).view(16, 3)  # grid (1, 4, 4): 4 tokens
    item = MMItem(hash="img", offset=3, length=4, pixel_values=pixels, grid_thw=(1, 4, 4))
    want = _ModelWithItsOwnExtras().encode_images(pixels, [(1, 4, 4)]).extras["a_new_extra"]  # [2, 4, 2]
    stage = VisionStage(_ModelWithItsOwnExtras(), EncoderCache(100), torch.device("cpu"), torch.float32)
    first = stage.prepare([ChunkSpan([item], start=0, end=5, row_offset=0)], num_tokens=5)  # item tokens 0, 1
    assert torch.equal(first.mm_mask, torch.tensor([False, False, False, True, True]))
    assert set(first.mm_extras) == {"a_new_extra"}
    assert torch.equal(first.mm_extras["a_new_extra"], want[:, 0:2])
    second = stage.prepare([ChunkSpan([item], start=5, end=9, row_offset=1)], num_tokens=6)  # item tokens 2, 3
    assert torch.equal(second.mm_extras["a_new_extra"], want[:, 2:4])
    assert torch.equal(second.mm_embeds, pixels[::4, :2][2:4])
