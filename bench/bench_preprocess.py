"""Image preprocessing throughput: the torchvision backend vs the PIL backend, on CPU.

Preprocesses the same decoded RGB photos (photo-like sizes and aspect ratios, deterministic
pictures) with `processors.ImageProcessor` under Qwen3-VL's published preprocessor config (patch 16,
65,536 to 16,777,216 pixels: photos keep about their own size) and prints one line: images/s of
each backend (resize + rescale/normalise + patchify + hash), best of --repeats alternating passes,
with the command, date and machine.

    python -m bench.bench_preprocess --images 32 --threads 2
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from PIL import Image

from bench.common import add_threads_option, apply_threads, describe_run
from vlmrun.processors import ImageProcessor

QWEN3_VL_CONFIG = {"size": {"shortest_edge": 65536, "longest_edge": 16777216}, "patch_size": 16,
                   "temporal_patch_size": 2, "merge_size": 2, "image_mean": [0.5, 0.5, 0.5],
                   "image_std": [0.5, 0.5, 0.5]}
SIZES = [(641, 479), (1023, 767), (801, 799), (1279, 719), (479, 641), (333, 500)]  # width x height, none a multiple of 32


def make_images(n: int) -> list[Image.Image]:
    """Smooth gradients plus noise (resampling cost does not depend on content)."""
    rng = np.random.default_rng(0)
    images = []
    for i in range(n):
        w, h = SIZES[i % len(SIZES)]
        ys, xs = np.mgrid[0:h, 0:w].astype(np.float32)
        rgb = np.stack([255 * xs / w, 255 * ys / h, 127 + 127 * np.sin((xs + ys) / 9)], -1)
        rgb += rng.normal(0, 12, rgb.shape)
        images.append(Image.fromarray(np.clip(rgb, 0, 255).astype(np.uint8)))
    return images


def images_per_second(processors: dict[str, ImageProcessor], images: list[Image.Image],
                      repeats: int) -> dict[str, float]:
    """Best pass of each backend over `repeats` passes, the backends alternating pass by pass (the
    best pass is the one least disturbed by other work on a shared machine)."""
    for processor in processors.values():
        processor.preprocess(images[0])  # warm-up (tables, imports, thread pool)
    best = {name: float("inf") for name in processors}
    for _ in range(repeats):
        for name, processor in processors.items():
            start = time.perf_counter()
            for image in images:
                processor.preprocess(image)
            best[name] = min(best[name], time.perf_counter() - start)
    return {name: len(images) / seconds for name, seconds in best.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--images", type=int, default=32)
    add_threads_option(parser, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    apply_threads(args)
    images = make_images(args.images)
    processors = {b: ImageProcessor.from_dict(QWEN3_VL_CONFIG, b) for b in ("torchvision", "pil")}
    rates = images_per_second(processors, images, args.repeats)
    import torchvision

    print(f"{describe_run(__spec__.name)}, torchvision {torchvision.__version__} | {args.images} photos 333x500..1279x719, Qwen3-VL config: "
          f"torchvision {rates['torchvision']:.1f} images/s, PIL {rates['pil']:.1f} images/s "
          f"({rates['torchvision'] / rates['pil']:.2f}x)")


if __name__ == "__main__":
    main()
