"""Image preprocessing throughput: the torchvision backend vs the PIL backend, on CPU.

Preprocesses the same decoded RGB photos (photo-like sizes and aspect ratios, deterministic
pictures) with `processors.ImageProcessor` under Qwen3-VL's published preprocessor config (patch 16,
65,536 to 16,777,216 pixels: photos keep about their own size) and prints one line: images/s of
each backend (resize + rescale/normalise + patchify + hash), best of --repeats alternating passes,
with the command, date and machine.

    python -m bench.bench_preprocess --images 32 --threads 2

With --workers 1,2,4 it measures instead what the input pipeline (`vlmrun.feed`) runs per input, on the
bundled model's processor: PNG bytes of shape scenes (`vlmrun.shape_scenes`, --size px square) decoded
and turned into a prompt (`load_image` + `Processor.process_prompt`: resize, patchify, chat template,
tokens), by N worker threads (as the pipeline runs them: the processor shared, one torch thread each)
and by N worker processes (each with its own processor; the prompt pickled back), and prints inputs/s
of each with the CPUs this process may use:

    python -m bench.bench_preprocess --workers 1,2,4 --images 96 --size 448
"""

from __future__ import annotations

import argparse
import io
import time
from concurrent.futures import Executor, ProcessPoolExecutor, ThreadPoolExecutor
from typing import Any, Optional

import numpy as np
import torch
from PIL import Image

from bench.common import add_threads_option, apply_threads, describe_run
from vlmrun.feed.workers import usable_cpus
from vlmrun.processors import ImageProcessor, Processor, load_image

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


_PROCESSOR: dict[str, Processor] = {}  # the processor of this process (one per worker process)


def scene_pngs(n: int, size: int) -> list[bytes]:
    """`n` shape scenes as PNG bytes, `size` px square (0: their own size, 64-256 px)."""
    from testing.scene_drawing import render_scene
    from vlmrun.shape_scenes import make_scene

    out = []
    for i in range(n):
        image = render_scene(make_scene(7, i))
        if size:
            image = image.resize((size, size), Image.BILINEAR)
        buf = io.BytesIO()
        image.save(buf, "PNG")
        out.append(buf.getvalue())
    return out


def _processor() -> Processor:
    if "p" not in _PROCESSOR:
        from vlmrun.default_model import default_model_path

        _PROCESSOR["p"] = Processor.from_pretrained(str(default_model_path()))
    return _PROCESSOR["p"]


def prepare_input(png: bytes) -> Any:
    """What the pipeline's worker does for one caption input."""
    torch.set_num_threads(1)
    processor = _processor()
    return processor.process_prompt("Describe the image.", [load_image(png, processor.limits)])


def inputs_per_second(pool: Executor, workers: int, pngs: list[bytes], repeats: int) -> float:
    list(pool.map(prepare_input, pngs[:2 * workers]))  # warm-up: every worker has its processor
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in pool.map(prepare_input, pngs):
            pass
        best = min(best, time.perf_counter() - start)
    return len(pngs) / best


def worker_scaling(workers: list[int], pngs: list[bytes], repeats: int) -> dict[str, dict[int, float]]:
    """inputs/s with N threads and with N processes, for each N of `workers`."""
    _processor()
    rates: dict[str, dict[int, float]] = {"threads": {}, "processes": {}}
    for n in workers:
        with ThreadPoolExecutor(n) as pool:
            rates["threads"][n] = inputs_per_second(pool, n, pngs, repeats)
        with ProcessPoolExecutor(n) as pool:
            rates["processes"][n] = inputs_per_second(pool, n, pngs, repeats)
    return rates


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--images", type=int, default=32)
    add_threads_option(parser, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--workers", default=None, help="e.g. 1,2,4: the input pipeline's per-input work, "
                                                        "threads vs processes")
    parser.add_argument("--size", type=int, default=448, help="with --workers: scene side in px (0: own size)")
    args = parser.parse_args()
    apply_threads(args)
    if args.workers:
        report_workers([int(n) for n in args.workers.split(",")], args)
        return
    images = make_images(args.images)
    processors = {b: ImageProcessor.from_dict(QWEN3_VL_CONFIG, b) for b in ("torchvision", "pil")}
    rates = images_per_second(processors, images, args.repeats)
    import torchvision

    print(f"{describe_run(__spec__.name)}, torchvision {torchvision.__version__} | {args.images} photos 333x500..1279x719, Qwen3-VL config: "
          f"torchvision {rates['torchvision']:.1f} images/s, PIL {rates['pil']:.1f} images/s "
          f"({rates['torchvision'] / rates['pil']:.2f}x)")


def report_workers(workers: list[int], args: argparse.Namespace, pngs: Optional[list[bytes]] = None) -> None:
    pngs = pngs if pngs is not None else scene_pngs(args.images, args.size)
    rates = worker_scaling(workers, pngs, args.repeats)
    cells = ", ".join(f"{n}: threads {rates['threads'][n]:.1f} / processes {rates['processes'][n]:.1f}" for n in workers)
    print(f"{describe_run(__spec__.name)}, {usable_cpus()} usable CPUs | {len(pngs)} shape scenes "
          f"{args.size or 'own size'} px, PNG decode + bundled model's process_prompt, inputs/s by workers: {cells}")


if __name__ == "__main__":
    main()
