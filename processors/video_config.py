"""Which video processor a checkpoint has and its config: `VideoProcessorConfig`, read as transformers reads it.

Two styles, by the class transformers' `AutoVideoProcessor` picks: `Qwen2VLVideoProcessor` ("qwen2":
Qwen2-VL, Qwen2.5-VL, and Qwen3-VL checkpoints whose only config is an image config naming
`Qwen2VLImageProcessor`) and `Qwen3VLVideoProcessor` ("qwen3"). `vlmrun.processors.video_processor` samples,
sizes and patchifies by it.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Mapping

from PIL import Image

from vlmrun.processors.image_processor import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD, _triple

IMAGENET_STANDARD = (0.5, 0.5, 0.5)

# transformers' class defaults per style (what a checkpoint's config leaves out)
_STYLE_DEFAULTS: dict[str, dict[str, Any]] = {
    "qwen2": dict(patch_size=14, min_pixels=128 * 28 * 28, max_pixels=28 * 28 * 768, image_mean=OPENAI_CLIP_MEAN,
                  image_std=OPENAI_CLIP_STD, do_sample_frames=False, fps=None, max_video_tokens=128000),
    "qwen3": dict(patch_size=16, min_pixels=128 * 32 * 32, max_pixels=32 * 32 * 768, image_mean=IMAGENET_STANDARD,
                  image_std=IMAGENET_STANDARD, do_sample_frames=True, fps=2.0, max_video_tokens=768),
}
# the video processor classes transformers has, by the style they sample and size frames in
_STYLE_OF_VIDEO_CLASS = {"Qwen2VLVideoProcessor": "qwen2", "Qwen3VLVideoProcessor": "qwen3"}


@dataclass(frozen=True)
class VideoProcessorConfig:
    """The fields of a Qwen-VL video processor config that shape frames and pixel_values."""

    style: str = "qwen3"
    patch_size: int = 16
    temporal_patch_size: int = 2
    merge_size: int = 2
    min_pixels: int = 128 * 32 * 32  # size["shortest_edge"]
    max_pixels: int = 32 * 32 * 768  # size["longest_edge"]
    image_mean: tuple[float, float, float] = IMAGENET_STANDARD
    image_std: tuple[float, float, float] = IMAGENET_STANDARD
    rescale_factor: float = 1 / 255
    do_rescale: bool = True
    do_normalize: bool = True
    do_resize: bool = True
    resample: int = int(Image.Resampling.BICUBIC)
    do_sample_frames: bool = True
    fps: float | None = 2.0
    num_frames: int | None = None
    min_frames: int = 4
    max_frames: int = 768
    cap_pixels_per_frame: bool = False
    max_video_tokens: int = 768

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size

    @classmethod
    def from_dict(cls, config: Mapping[str, Any], style: str) -> "VideoProcessorConfig":
        """A video processor config dict (or, as transformers falls back to it, the image one).

        The class the dict names (`video_processor_type`, else the video class transformers pairs
        with its `image_processor_type`) decides the style; `style` (the family's, `vlmrun.families`) otherwise."""
        style = _style_of_class(config) or style
        d = _STYLE_DEFAULTS[style]
        size = config.get("size") if isinstance(config.get("size"), Mapping) else {}
        min_pixels = size.get("shortest_edge", size.get("min_pixels", d["min_pixels"]))
        max_pixels = size.get("longest_edge", size.get("max_pixels", d["max_pixels"]))
        if style == "qwen2":  # Qwen2VLVideoProcessor's init lets top-level min/max_pixels set the size
            min_pixels = config.get("min_pixels") or min_pixels
            max_pixels = config.get("max_pixels") or max_pixels
        base = cls()

        def get(key: str, default: Any) -> Any:
            value = config.get(key)
            return default if value is None else value

        out = cls(
            style=style,
            patch_size=int(get("patch_size", d["patch_size"])),
            temporal_patch_size=int(get("temporal_patch_size", base.temporal_patch_size)),
            merge_size=int(get("merge_size", base.merge_size)),
            min_pixels=int(min_pixels),
            max_pixels=int(max_pixels),
            image_mean=_triple(get("image_mean", d["image_mean"]), "image_mean"),
            image_std=_triple(get("image_std", d["image_std"]), "image_std"),
            rescale_factor=float(get("rescale_factor", base.rescale_factor)),
            do_rescale=bool(get("do_rescale", base.do_rescale)),
            do_normalize=bool(get("do_normalize", base.do_normalize)),
            do_resize=bool(get("do_resize", base.do_resize)),
            resample=int(get("resample", base.resample)),
            do_sample_frames=bool(get("do_sample_frames", d["do_sample_frames"])),
            fps=None if get("fps", d["fps"]) is None else float(get("fps", d["fps"])),
            num_frames=None if config.get("num_frames") is None else int(config["num_frames"]),
            min_frames=int(get("min_frames", base.min_frames)),
            max_frames=int(get("max_frames", base.max_frames)),
            cap_pixels_per_frame=bool(get("cap_pixels_per_frame", False)),
            max_video_tokens=int(get("max_video_tokens", d["max_video_tokens"])),
        )
        if min(out.patch_size, out.temporal_patch_size, out.merge_size, out.min_pixels) <= 0:
            raise ValueError(f"video processor config has a non-positive size field: {out}")
        return out

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, style: str) -> "VideoProcessorConfig | None":
        """transformers' order: `processor_config.json` ["video_processor"], `video_preprocessor_config.json`,
        then `preprocessor_config.json` (the image processor's). None when there is none of them."""
        nested = read_json(os.path.join(path, "processor_config.json"))
        if nested is not None and isinstance(nested.get("video_processor"), Mapping):
            return cls.from_dict(nested["video_processor"], style)
        for name in ("video_preprocessor_config.json", "preprocessor_config.json"):
            data = read_json(os.path.join(path, name))
            if data is not None:
                return cls.from_dict(data, style)
        return None

    def fingerprint(self) -> bytes:
        fields = [self.style, self.patch_size, self.temporal_patch_size, self.merge_size, list(self.image_mean),
                  list(self.image_std), self.rescale_factor, self.do_rescale, self.do_normalize, self.resample]
        return json.dumps(fields, separators=(",", ":")).encode()


def _style_of_class(config: Mapping[str, Any]) -> str | None:
    """The style of the class `AutoVideoProcessor` picks from a config dict: `video_processor_type`, else
    the video twin of `image_processor_type` where transformers has one (`Qwen2VLImageProcessor` ->
    `Qwen2VLVideoProcessor`; `Qwen2VLImageProcessorFast` has none). None: the family decides."""
    named = config.get("video_processor_type")
    if named is None and config.get("image_processor_type"):
        named = str(config["image_processor_type"]).replace("ImageProcessor", "VideoProcessor")
    return _STYLE_OF_VIDEO_CLASS.get(str(named))


def read_json(path: str) -> dict[str, Any] | None:
    """The JSON object in the checkpoint file at `path`; None when there is no such file."""
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as fh:
        return json.load(fh)
