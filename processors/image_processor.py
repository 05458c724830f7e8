"""Qwen-VL image preprocessing: smart resize, then rescale / normalise / patchify (torch).

Output equals transformers' Qwen2-VL image processors (the image processor of Qwen2-VL, Qwen2.5-VL,
Qwen3-VL and Qwen3.5) bit for bit, for the same preprocessor config: with the "torchvision" backend
`Qwen2VLImageProcessor` (transformers' default when torchvision is installed; resize by torchvision
on the CPU or the GPU), with the "pil" backend `Qwen2VLImageProcessorPil` (resize by PIL on the
host). Rescale + normalise is one lookup table per uint8 level, built with the backend's float ops,
so values are bit-identical; it and the patchify run in torch, on CPU or CUDA
(`vlmrun.processors.pixel_backends`).

Layout of `pixel_values` for one image with grid (t=1, gh, gw), patch P, temporal patch T, merge m:
rows are patches in merge-window order (window row, window col, row in window, col in window),
each row is a flattened [C, T, P, P] block; a still image is repeated T times along time.

Per-image overrides (`min_pixels`, `max_pixels`, `resized_height`, `resized_width`) follow
qwen-vl-utils (`fetch_image`): the image is first resized by PIL to qwen-vl-utils' size, then the
HF processor's sizing runs on that image within the model's configured bounds (usually the
identity); `override_size` and `model_size` are the two steps.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
from dataclasses import dataclass
from typing import Any, Mapping

import torch
from PIL import Image

from vlmrun.processors.image_io import to_rgb
from vlmrun.processors.limits import InputError
from vlmrun.processors.pixel_backends import create_pixel_backend, resolve_image_backend

OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
MAX_ASPECT_RATIO = 200
# qwen-vl-utils' defaults for per-image sizing, in merged tokens (each token = factor**2 pixels).
QWEN_VL_UTILS_MIN_TOKENS = 4
QWEN_VL_UTILS_MAX_TOKENS = 16384


def smart_resize(height: int, width: int, factor: int = 28, min_pixels: int = 56 * 56,
                 max_pixels: int = 28 * 28 * 1280) -> tuple[int, int]:
    """Target (height, width): multiples of `factor`, area within [min_pixels, max_pixels], aspect kept.

    Same arithmetic as the transformers Qwen2-VL image processor: round each side to the nearest
    multiple of `factor` (Python's round, half to even); if the area is too large, scale both sides
    by sqrt(area / max_pixels) and floor to multiples (never below `factor`); if too small, scale
    up by sqrt(min_pixels / area) and ceil. Raises InputError past an aspect ratio of 200.
    """
    _check_aspect(height, width)
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def qwen_vl_utils_size(height: int, width: int, factor: int, min_pixels: int | None = None,
                       max_pixels: int | None = None) -> tuple[int, int]:
    """The size qwen-vl-utils' `fetch_image` resizes to for per-item options: the library's own
    `smart_resize` (which differs from transformers' in two corners: the rounded sides are clamped
    to at least `factor` before the area checks, the shrink branch is not), its failures as
    InputError. Missing bounds default to 4 and 16384 merged tokens, as there."""
    from qwen_vl_utils.vision_process import smart_resize as fetch_image_size

    min_pixels = QWEN_VL_UTILS_MIN_TOKENS * factor * factor if min_pixels is None else min_pixels
    max_pixels = QWEN_VL_UTILS_MAX_TOKENS * factor * factor if max_pixels is None else max_pixels
    if max_pixels < min_pixels:
        raise InputError(f"max_pixels ({max_pixels}) must be >= min_pixels ({min_pixels})")
    _check_aspect(height, width)
    h_bar, w_bar = fetch_image_size(height, width, factor, min_pixels, max_pixels)
    if h_bar <= 0 or w_bar <= 0:
        raise InputError(
            f"image {width}x{height} cannot be resized into max_pixels={max_pixels} with sides that are "
            f"multiples of {factor}"
        )
    return h_bar, w_bar


def _check_aspect(height: int, width: int) -> None:
    if height <= 0 or width <= 0:
        raise InputError(f"image size must be positive, got {width}x{height}")
    ratio = max(height, width) / min(height, width)
    if ratio > MAX_ASPECT_RATIO:
        raise InputError(
            f"image {width}x{height} has an aspect ratio of {ratio:.1f}; it must be at most {MAX_ASPECT_RATIO}"
        )


def _triple(value: Any, name: str) -> tuple[float, float, float]:
    if isinstance(value, (int, float)):
        return (float(value),) * 3
    values = tuple(float(v) for v in value)
    if len(values) != 3:
        raise ValueError(f"preprocessor config: {name} must have 3 values (RGB), got {len(values)}")
    return values  # type: ignore[return-value]


@dataclass(frozen=True)
class ImageProcessorConfig:
    """The fields of a Qwen-VL `preprocessor_config.json` that shape pixel_values.

    Defaults are those of transformers' Qwen2-VL image processor class.
    """

    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    image_mean: tuple[float, float, float] = OPENAI_CLIP_MEAN
    image_std: tuple[float, float, float] = OPENAI_CLIP_STD
    rescale_factor: float = 1 / 255
    do_rescale: bool = True
    do_normalize: bool = True
    do_resize: bool = True
    resample: int = int(Image.Resampling.BICUBIC)

    @property
    def factor(self) -> int:
        """Side lengths must be multiples of this (one merged token covers factor x factor pixels)."""
        return self.patch_size * self.merge_size

    @property
    def patch_dim(self) -> int:
        return 3 * self.temporal_patch_size * self.patch_size * self.patch_size

    @classmethod
    def from_dict(cls, config: Mapping[str, Any]) -> "ImageProcessorConfig":
        """Read a preprocessor config dict (transformers 4.x or 5.x spelling).

        Pixel bounds come from `size` ({"shortest_edge", "longest_edge"}, or the older
        {"min_pixels", "max_pixels"}); top-level `min_pixels` / `max_pixels` win over `size`, as in
        transformers.
        """
        d = cls()
        size = config.get("size") or {}
        if not isinstance(size, Mapping):
            size = {}
        min_pixels = size.get("shortest_edge", size.get("min_pixels", d.min_pixels))
        max_pixels = size.get("longest_edge", size.get("max_pixels", d.max_pixels))
        if config.get("min_pixels") is not None:
            min_pixels = config["min_pixels"]
        if config.get("max_pixels") is not None:
            max_pixels = config["max_pixels"]

        def get(key: str, default: Any) -> Any:
            value = config.get(key)
            return default if value is None else value

        out = cls(
            patch_size=int(get("patch_size", d.patch_size)),
            temporal_patch_size=int(get("temporal_patch_size", d.temporal_patch_size)),
            merge_size=int(get("merge_size", d.merge_size)),
            min_pixels=int(min_pixels),
            max_pixels=int(max_pixels),
            image_mean=_triple(get("image_mean", d.image_mean), "image_mean"),
            image_std=_triple(get("image_std", d.image_std), "image_std"),
            rescale_factor=float(get("rescale_factor", d.rescale_factor)),
            do_rescale=bool(get("do_rescale", d.do_rescale)),
            do_normalize=bool(get("do_normalize", d.do_normalize)),
            do_resize=bool(get("do_resize", d.do_resize)),
            resample=int(get("resample", d.resample)),
        )
        if min(out.patch_size, out.temporal_patch_size, out.merge_size, out.min_pixels) <= 0:
            raise ValueError(f"preprocessor config has a non-positive size field: {out}")
        if out.max_pixels < out.min_pixels:
            raise ValueError(f"preprocessor config: max_pixels {out.max_pixels} < min_pixels {out.min_pixels}")
        return out

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike) -> "ImageProcessorConfig | None":
        """The config of a checkpoint directory, or None if it has none (a text-only model).

        Reads `preprocessor_config.json`, else the `image_processor` entry of `processor_config.json`.
        """
        pre = os.path.join(path, "preprocessor_config.json")
        if os.path.isfile(pre):
            with open(pre, encoding="utf-8") as fh:
                return cls.from_dict(json.load(fh))
        proc = os.path.join(path, "processor_config.json")
        if os.path.isfile(proc):
            with open(proc, encoding="utf-8") as fh:
                data = json.load(fh)
            if isinstance(data.get("image_processor"), Mapping):
                return cls.from_dict(data["image_processor"])
        return None

    def fingerprint(self) -> bytes:
        """Bytes that identify every field that maps resized pixels to pixel_values."""
        return json.dumps(
            [self.patch_size, self.temporal_patch_size, self.merge_size, list(self.image_mean),
             list(self.image_std), self.rescale_factor, self.do_rescale, self.do_normalize],
            separators=(",", ":"),
        ).encode()


@dataclass
class ProcessedImage:
    """One preprocessed image.

    pixel_values: [grid_t * grid_h * grid_w, 3 * T * P * P] float32 (on the requested device).
    grid_thw: (grid_t, grid_h, grid_w) in patches (grid_t is 1 for an image).
    hash: sha256 hex digest identifying the pixel content (see `ImageProcessor.preprocess`).
    size: (height, width) of the resized image in pixels.
    """

    pixel_values: torch.Tensor
    grid_thw: tuple[int, int, int]
    hash: str
    size: tuple[int, int] = (0, 0)


class ImageProcessor:
    """Resizes and patchifies images for the Qwen-VL vision towers (CPU or CUDA tensors).

    backend: "auto" (torchvision when it imports, else PIL — transformers' default), "torchvision"
    or "pil"; see `vlmrun.processors.pixel_backends`.
    """

    def __init__(self, config: ImageProcessorConfig | None = None, backend: str = "auto") -> None:
        self.config = config or ImageProcessorConfig()
        self.pixels = create_pixel_backend(resolve_image_backend(backend))
        self._luts: dict[torch.device, torch.Tensor] = {}
        self._channel_offsets: dict[torch.device, torch.Tensor] = {}

    @classmethod
    def from_dict(cls, config: Mapping[str, Any], backend: str = "auto") -> "ImageProcessor":
        return cls(ImageProcessorConfig.from_dict(config), backend)

    @property
    def backend(self) -> str:
        """The resolved backend: "torchvision" or "pil"."""
        return self.pixels.name

    def fingerprint(self, device: torch.device) -> bytes:
        """The config's fingerprint plus the backend (and, for torchvision, the device type it resizes on)."""
        tag = self.backend if self.backend == "pil" else f"{self.backend}:{device.type}"
        return self.config.fingerprint() + b"|" + tag.encode()

    def num_tokens(self, grid_thw: tuple[int, int, int]) -> int:
        """Merged tokens the LLM sees for one image: t * h * w // merge**2."""
        t, h, w = grid_thw
        return t * h * w // (self.config.merge_size ** 2)

    def override_size(self, height: int, width: int, *, min_pixels: int | None = None,
                      max_pixels: int | None = None, resized_height: int | None = None,
                      resized_width: int | None = None) -> tuple[int, int] | None:
        """The size qwen-vl-utils (`fetch_image`) resizes an image to for per-item options, or None without any.

        From resized_height/resized_width when both are given, else from the image size within
        [min_pixels, max_pixels] (each defaulting to 4 / 16384 merged tokens).
        """
        if all(v is None for v in (min_pixels, max_pixels, resized_height, resized_width)):
            return None
        f = self.config.factor
        if resized_height is not None and resized_width is not None:
            return qwen_vl_utils_size(resized_height, resized_width, f)
        return qwen_vl_utils_size(height, width, f, min_pixels, max_pixels)

    def plan(self, height: int, width: int, *, min_pixels: int | None = None, max_pixels: int | None = None,
             resized_height: int | None = None, resized_width: int | None = None
             ) -> tuple[tuple[int, int] | None, tuple[int, int]]:
        """What `preprocess` does to a height x width image, known from its size alone: (the size the
        per-item options resize it to first, None when they do not; the size the model sees)."""
        first = self.override_size(height, width, min_pixels=min_pixels, max_pixels=max_pixels,
                                   resized_height=resized_height, resized_width=resized_width)
        if not self.config.do_resize or first == (height, width):
            first = None
        return first, self.model_size(*(first or (height, width)))

    def grid(self, size: tuple[int, int]) -> tuple[int, int, int]:
        """The patch grid (1, h, w) of an image the model sees at `size`."""
        p = self.config.patch_size
        return 1, size[0] // p, size[1] // p

    def model_size(self, height: int, width: int) -> tuple[int, int]:
        """(height, width) the HF processor resizes a height x width image to: `smart_resize` within the
        config's [min_pixels, max_pixels] (the size itself when the config does not resize)."""
        cfg = self.config
        f = cfg.factor
        if not cfg.do_resize:
            if height % f or width % f:
                raise InputError(
                    f"image {width}x{height}: this model's processor does not resize and needs sides "
                    f"that are multiples of {f}"
                )
            return height, width
        return smart_resize(height, width, f, cfg.min_pixels, cfg.max_pixels)

    def preprocess(self, image: Image.Image, *, min_pixels: int | None = None, max_pixels: int | None = None,
                   resized_height: int | None = None, resized_width: int | None = None,
                   device: str | torch.device = "cpu") -> ProcessedImage:
        """Resize, rescale, normalise and patchify one image, as the HF processor of the backend does.

        `image` should come from `load_image` (RGB); other modes are converted like there. Per-item
        options first resize the image with PIL to qwen-vl-utils' size, as its `fetch_image` does
        before the HF processor sees it. The backend's host step (PIL: the resize) runs here, its
        uint8 output is uploaded to `device`, the device step (torchvision: the resize) and the
        normalise + patchify run there.

        The hash is sha256 over the processor's fingerprint (config, backend, device type for
        torchvision), the uploaded and final sizes, the grid and the uploaded uint8 RGB pixels: equal
        hashes mean equal pixel_values, and it costs no device->host copy.
        """
        cfg = self.config
        device = torch.device(device)
        if image.mode != "RGB":
            image = to_rgb(image)
        first, size = self.plan(image.height, image.width, min_pixels=min_pixels, max_pixels=max_pixels,
                                resized_height=resized_height, resized_width=resized_width)
        if first is not None:
            image = image.resize((first[1], first[0]), resample=Image.Resampling.BICUBIC)  # qwen-vl-utils' resize
        host = self.pixels.host_pixels(image, size, cfg.resample)  # [h, w, 3] uint8
        grid = self.grid(size)

        digest = hashlib.sha256()
        digest.update(self.fingerprint(device))
        digest.update(struct.pack("<7q", host.shape[0], host.shape[1], *size, *grid))
        digest.update(memoryview(host))

        uploaded = torch.from_numpy(host).to(device, non_blocking=True).permute(2, 0, 1).contiguous()  # [3, h, w]
        resized = self.pixels.finish(uploaded, size, cfg.resample)  # [3, H, W] uint8
        pixel_values = self._patchify(resized, device)
        return ProcessedImage(pixel_values=pixel_values, grid_thw=grid, hash=digest.hexdigest(), size=size)

    def _lookup_table(self, device: torch.device) -> torch.Tensor:
        """[3 * 256] float32: the normalised value of every (channel, uint8 level), built with the
        backend's float ops, so a lookup gives bit-identical values."""
        if device not in self._luts:
            cfg = self.config
            table = self.pixels.normalise_table(cfg.image_mean, cfg.image_std, cfg.rescale_factor,
                                                cfg.do_rescale, cfg.do_normalize)  # [3, 256]
            self._luts[device] = table.reshape(-1).contiguous().to(device)
        return self._luts[device]

    def _patchify(self, pixels: torch.Tensor, device: torch.device) -> torch.Tensor:
        """[3, H, W] uint8 on `device` -> [gh * gw, 3 * T * P * P] float32 on `device`."""
        cfg = self.config
        p, m, t = cfg.patch_size, cfg.merge_size, cfg.temporal_patch_size
        c, h, w = pixels.shape
        gh, gw = h // p, w // p
        table = self._lookup_table(device)
        if device not in self._channel_offsets:
            self._channel_offsets[device] = (torch.arange(3, dtype=torch.int32) * 256).view(3, 1, 1).to(device)
        offsets = self._channel_offsets[device]  # [3, 1, 1]: channel c reads table[c * 256 + level]
        # rescale + normalise as one table lookup per (channel, level): [3, H, W] float32
        x = table[pixels.to(torch.int32) + offsets]
        # [C, gh/m, m, P, gw/m, m, P] -> [gh/m, gw/m, m(h), m(w), C, P, P]
        x = x.reshape(c, gh // m, m, p, gw // m, m, p).permute(1, 4, 2, 5, 0, 3, 6)
        # repeat the still frame over the temporal patch: [..., C, T, P, P]
        x = x.unsqueeze(5).expand(-1, -1, -1, -1, -1, t, -1, -1)
        return x.reshape(gh * gw, c * t * p * p)
