"""Synthetic image folders for caption-job tests and benchmarks: good images and broken files.

Nothing here is downloaded; every file is generated from a seed, so runs repeat exactly.
"""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
from PIL import Image


def write_images(folder: Path, count: int, size: tuple[int, int] | None = (32, 32), seed: int = 0,
                 fmt: str = "PNG", sizes_range: tuple[int, int] = (96, 448)) -> list[Path]:
    """`count` images of random colour blocks named img_00000.<ext>, ... in `folder`.

    size: (width, height) of every image, or None for a random size per image with sides in
    `sizes_range` (photo-like variety of aspect ratios)."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    ext = {"PNG": "png", "JPEG": "jpg"}[fmt]
    paths = []
    for i in range(count):
        w, h = size if size is not None else (int(rng.integers(*sizes_range)), int(rng.integers(*sizes_range)))
        blocks = rng.integers(0, 256, size=(max(h // 8, 1), max(w // 8, 1), 3), dtype=np.uint8)
        image = Image.fromarray(blocks).resize((w, h), Image.NEAREST)
        path = folder / f"img_{i:05d}.{ext}"
        image.save(path, fmt, **({"quality": 90} if fmt == "JPEG" else {}))
        paths.append(path)
    return paths


def write_bad_files(folder: Path) -> dict[str, str]:
    """Broken inputs beside good ones: {file name: what is wrong with it}."""
    folder.mkdir(parents=True, exist_ok=True)
    buf = io.BytesIO()
    Image.fromarray(np.full((64, 64, 3), 200, dtype=np.uint8)).save(buf, "JPEG")
    jpeg = buf.getvalue()
    bad = {
        "zero_bytes.jpg": b"",
        "truncated.jpg": jpeg[: len(jpeg) // 2],
        "corrupt.png": b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 4,
        "not_an_image.jpg": b"this is a text file with an image suffix\n",
    }
    for name, data in bad.items():
        (folder / name).write_bytes(data)
    return {"zero_bytes.jpg": "empty", "truncated.jpg": "truncated", "corrupt.png": "corrupt",
            "not_an_image.jpg": "not an image"}
