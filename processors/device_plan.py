"""Where images are resized, normalised and patchified: on the CPU, or on the engine's GPU.

`preprocess_device="cpu"` / `"cuda"` pick one; `"auto"` (the default) picks the GPU path only where
it wins, decided once when the engine starts (`plan_preprocess_device`):

- never off CUDA, and never with the PIL backend (PIL resizes on the host either way);
- on CUDA with torchvision, one photo-sized image (`CALIBRATION_SIZE`) is preprocessed both ways
  (`measure_paths`): the GPU path is taken when its pixels equal the CPU path's (so the choice never
  changes an output) and one GPU, which serialises the images, still outruns the CPU workers
  together by `GPU_MARGIN` (`gpu_wins`), since its time is taken from the engine's own steps.

Decoding stays on the CPU in both paths; the GPU path uploads the decoded uint8 image.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np
import torch
from PIL import Image

from vlmrun.processors.image_processor import ImageProcessor, ImageProcessorConfig
from vlmrun.threads import cpu_budget

logger = logging.getLogger(__name__)

PREPROCESS_DEVICES = ("auto", "cpu", "cuda")
CALIBRATION_SIZE = (1024, 768)  # width x height: a typical photo after its decode
GPU_MARGIN = 2.0  # the GPU path must be this much faster than the CPU workers together
MAX_WORKERS = 8  # the input pipeline's default worker count is the usable CPUs, at most this


@dataclass(frozen=True)
class PathTiming:
    """One image preprocessed both ways: seconds on one CPU worker and on the GPU (upload included)."""

    cpu_s: float
    gpu_s: float
    same_pixels: bool


def gpu_wins(timing: PathTiming, workers: int) -> bool:
    """Whether the GPU path outruns `workers` CPU workers by `GPU_MARGIN` with the CPU path's pixels."""
    return timing.same_pixels and timing.gpu_s * workers * GPU_MARGIN < timing.cpu_s


def plan_preprocess_device(requested: str, engine_device: torch.device, backend: Optional[str], workers: int,
                           measure: Callable[[], PathTiming]) -> torch.device:
    """The device images are preprocessed on. `backend`: the image processor's ("torchvision" / "pil"),
    None for a text-only model; `measure` runs only for "auto" on CUDA with torchvision."""
    if requested not in PREPROCESS_DEVICES:
        raise ValueError(f"preprocess_device must be one of {', '.join(PREPROCESS_DEVICES)}, got {requested!r}")
    cpu = torch.device("cpu")
    on_cuda = engine_device.type == "cuda" and torch.cuda.is_available()
    if requested == "cpu":
        return cpu
    if requested == "cuda":
        if not on_cuda:
            raise ValueError(f"preprocess_device='cuda' needs the engine on CUDA, in this process too; it runs on "
                             f"{engine_device}{'' if torch.cuda.is_available() else ' and this process has no GPU'}")
        return engine_device
    if not on_cuda or backend != "torchvision":
        return cpu
    try:
        timing = measure()
    except Exception as exc:  # noqa: BLE001 - any failure of the GPU path keeps the CPU path
        logger.warning("preprocess_device='auto': the GPU image path failed (%s); images stay on the CPU", exc)
        return cpu
    chosen = engine_device if gpu_wins(timing, workers) else cpu
    logger.info("preprocess_device='auto': %s (one %dx%d image: CPU %.1f ms, GPU %.1f ms, %d CPU workers, "
                "same pixels: %s)", chosen.type, *CALIBRATION_SIZE, timing.cpu_s * 1e3, timing.gpu_s * 1e3,
                workers, timing.same_pixels)
    return chosen


def choose_preprocess_device(requested: str, engine_device: torch.device, checkpoint: str,
                             image_backend: str) -> torch.device:
    """`plan_preprocess_device` for a checkpoint directory and the engine's `image_backend` option."""
    config = ImageProcessorConfig.from_pretrained(checkpoint)
    processor = None if config is None else ImageProcessor(config, image_backend)
    return plan_preprocess_device(requested, engine_device, None if processor is None else processor.backend,
                                  cpu_workers(), lambda: measure_paths(processor, engine_device))


def cpu_workers() -> int:
    """The CPU workers images would be preprocessed by: the usable CPUs (affinity, cgroup quota), at most 8."""
    return max(1, min(MAX_WORKERS, cpu_budget().cores))


def calibration_image() -> Image.Image:
    """A photo-like RGB image (gradients and noise: resampling cost does not depend on content)."""
    w, h = CALIBRATION_SIZE
    ys, xs = np.mgrid[0:h, 0:w].astype(np.float32)
    rgb = np.stack([255 * xs / w, 255 * ys / h, 127 + 127 * np.sin((xs + ys) / 9)], -1)
    rgb += np.random.default_rng(0).normal(0, 12, rgb.shape)
    return Image.fromarray(np.clip(rgb, 0, 255).astype(np.uint8))


def measure_paths(processor: ImageProcessor, device: torch.device, repeats: int = 3) -> PathTiming:
    """`calibration_image` through `processor` on the CPU and on `device` (synchronised): best of
    `repeats` after a warm-up each, and whether the pixels agree."""
    image = calibration_image()

    def best(on: torch.device) -> tuple[float, torch.Tensor]:
        out = processor.preprocess(image, device=on).pixel_values  # warm-up (tables, kernels)
        seconds = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            out = processor.preprocess(image, device=on).pixel_values
            if on.type == "cuda":
                torch.cuda.synchronize(on)
            seconds = min(seconds, time.perf_counter() - start)
        return seconds, out

    cpu_s, on_cpu = best(torch.device("cpu"))
    gpu_s, on_gpu = best(device)
    return PathTiming(cpu_s, gpu_s, bool(torch.equal(on_cpu, on_gpu.cpu())))
