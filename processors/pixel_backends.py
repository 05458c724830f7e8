"""The two ways an RGB image becomes resized uint8 pixels and normalised values: PIL and torchvision.

They mirror transformers' two Qwen2-VL image processors, which differ only in the resize and in
the float ops of rescale + normalise:

  `PilPixels` = `Qwen2VLImageProcessorPil`: bicubic resize of the uint8 RGB image by PIL on the host,
      then rescale in float64, cast to float32, (x - mean) / std in float32.
  `TorchvisionPixels` = `Qwen2VLImageProcessor` (transformers' default when torchvision is
      installed): the uint8 [3, H, W] tensor is resized by `torchvision.transforms.v2.functional.resize`
      (bicubic, antialias) on the tensor's device, then normalised in float32 with rescale folded into
      mean and std (mean / rescale_factor, std / rescale_factor) — the same calls, on the same device.

A backend splits its work in two: `host_pixels` (on the CPU, before the upload: PIL resizes here)
and `finish` (on the target device, after the upload: torchvision resizes here). The normalisation
depends only on (channel, uint8 level), so it is a [3, 256] table built with the backend's own float
ops: a lookup gives bit-identical values on any device.

`resolve_image_backend("auto" | "torchvision" | "pil")` follows transformers: torchvision when it
can be imported, else PIL. torchvision is imported only when its backend is used.
"""

from __future__ import annotations

import functools
from typing import Protocol

import numpy as np
import torch
from PIL import Image

IMAGE_BACKENDS = ("auto", "torchvision", "pil")


@functools.lru_cache(maxsize=1)
def torchvision_available() -> bool:
    """True when torchvision's tensor functional API imports (and its C ops load) here."""
    try:
        from torchvision.transforms.v2 import functional  # noqa: F401
    except Exception:  # not installed, or built for another torch (its C ops fail to load)
        return False
    return True


def resolve_image_backend(name: str) -> str:
    """"torchvision" or "pil" for an `image_backend` option value (ValueError for others)."""
    if name not in IMAGE_BACKENDS:
        raise ValueError(f"image_backend must be one of {', '.join(IMAGE_BACKENDS)}; got {name!r}")
    if name == "auto":
        return "torchvision" if torchvision_available() else "pil"
    if name == "torchvision" and not torchvision_available():
        raise ValueError("image_backend='torchvision' needs torchvision (pip install torchvision built for "
                         f"torch {torch.__version__}); image_backend='pil' works without it")
    return name


@functools.lru_cache(maxsize=None)
def _levels_by_channel() -> torch.Tensor:
    """[3, 1, 256] uint8: every level in every channel, an image whose normalisation is the table."""
    return torch.arange(256, dtype=torch.uint8).expand(3, 1, 256).contiguous()


class PixelBackend(Protocol):
    name: str

    def host_pixels(self, image: Image.Image, size: tuple[int, int], resample: int) -> np.ndarray:
        """[h, w, 3] uint8 RGB, C-contiguous: what is uploaded to the device."""

    def finish(self, pixels: torch.Tensor, size: tuple[int, int], resample: int) -> torch.Tensor:
        """[3, h, w] uint8 on the device -> [3, H, W] uint8 of `size` = (H, W)."""

    def normalise_table(self, mean: tuple[float, ...], std: tuple[float, ...], rescale_factor: float,
                        do_rescale: bool, do_normalize: bool) -> torch.Tensor:
        """[3, 256] float32 (CPU): the value of level v in channel c."""


class PilPixels:
    """PIL's bicubic resize on the host; normalisation as `Qwen2VLImageProcessorPil` computes it."""

    name = "pil"

    def host_pixels(self, image: Image.Image, size: tuple[int, int], resample: int) -> np.ndarray:
        height, width = size
        if (width, height) != image.size:
            image = image.resize((width, height), resample=resample)
        return np.array(image, dtype=np.uint8)

    def finish(self, pixels: torch.Tensor, size: tuple[int, int], resample: int) -> torch.Tensor:
        return pixels

    def normalise_table(self, mean: tuple[float, ...], std: tuple[float, ...], rescale_factor: float,
                        do_rescale: bool, do_normalize: bool) -> torch.Tensor:
        # numpy's order: rescale in float64, cast to float32, then (x - mean) / std in float32
        levels = torch.arange(256, dtype=torch.float64)
        if do_rescale:
            levels = levels * rescale_factor
        table = levels.to(torch.float32).expand(3, 256)  # [3, 256]
        if do_normalize:
            table = (table - torch.tensor(mean, dtype=torch.float32).view(3, 1)) / torch.tensor(
                std, dtype=torch.float32).view(3, 1)
        return table.contiguous()


class TorchvisionPixels:
    """torchvision's resize on the device; normalisation as `Qwen2VLImageProcessor` computes it."""

    name = "torchvision"

    def __init__(self) -> None:
        from torchvision.transforms.v2 import functional as tvF
        from transformers.image_utils import pil_torch_interpolation_mapping

        self._tvF = tvF
        self._modes = pil_torch_interpolation_mapping  # PIL resample -> torchvision InterpolationMode, as HF maps it

    def host_pixels(self, image: Image.Image, size: tuple[int, int], resample: int) -> np.ndarray:
        return np.array(image, dtype=np.uint8)

    def finish(self, pixels: torch.Tensor, size: tuple[int, int], resample: int) -> torch.Tensor:
        if tuple(pixels.shape[-2:]) == size:
            return pixels
        mode = self._modes[Image.Resampling(resample)]
        return self._tvF.resize(pixels, list(size), interpolation=mode, antialias=True)

    def normalise_table(self, mean: tuple[float, ...], std: tuple[float, ...], rescale_factor: float,
                        do_rescale: bool, do_normalize: bool) -> torch.Tensor:
        levels = _levels_by_channel()  # [3, 1, 256] uint8
        if do_normalize:
            if do_rescale:  # transformers folds the rescale into mean and std (float32 tensors)
                mean = torch.tensor(mean) * (1.0 / rescale_factor)
                std = torch.tensor(std) * (1.0 / rescale_factor)
            table = self._tvF.normalize(levels.to(torch.float32), mean, std)
        elif do_rescale:
            table = levels * rescale_factor
        else:
            table = levels.to(torch.float32)
        return table.reshape(3, 256).to(torch.float32).contiguous()


def create_pixel_backend(name: str) -> PixelBackend:
    """The backend for a resolved name ("torchvision" | "pil")."""
    return TorchvisionPixels() if name == "torchvision" else PilPixels()
