"""Drawing shape scenes: a `vlmrun.shape_scenes.Scene` as an RGB picture, and each shape's coverage.

The picture is a pure function of the scene (its split seed and index seed the background's
texture), so the same scene always gives the same pixels. Shapes are drawn at `SUPERSAMPLE` times
the size and box-filtered down, for anti-aliased edges.
"""

from __future__ import annotations

import numpy as np
from PIL import Image, ImageDraw

from vlmrun.shape_scenes import BACKGROUNDS, Scene, Shape

SUPERSAMPLE = 4  # shapes are drawn at 4x and box-filtered down (anti-aliased edges)


def render_scene(scene: Scene) -> Image.Image:
    """The scene as an RGB image of width x height pixels (deterministic)."""
    return render_scene_with_masks(scene)[0]


def render_scene_with_masks(scene: Scene) -> tuple[Image.Image, list[np.ndarray]]:
    """The image and, per shape (left to right), its coverage in [0, 1] as a [height, width] array."""
    rng = np.random.default_rng([scene.split_seed, scene.index, 7])
    canvas = _background(scene.width, scene.height, scene.background, scene.texture, rng)  # [H, W, 3]
    masks = []
    for shape in scene.shapes:
        alpha = _shape_mask(shape, scene.width, scene.height)  # [H, W]
        masks.append(alpha)
        canvas = canvas * (1.0 - alpha[..., None]) + np.asarray(shape.rgb, dtype=np.float32) * alpha[..., None]
    image = Image.fromarray(np.clip(np.rint(canvas), 0, 255).astype(np.uint8), "RGB")
    return image, masks


def _background(width: int, height: int, name: str, texture: str, rng: np.random.Generator) -> np.ndarray:
    base = np.asarray(BACKGROUNDS[name], dtype=np.float32)
    canvas = np.broadcast_to(base, (height, width, 3)).copy()
    if texture == "noise":
        canvas += rng.normal(0.0, 6.0, size=(height, width, 1)).astype(np.float32)
    elif texture == "gradient":
        angle = rng.uniform(0, 2 * np.pi)
        ys, xs = np.mgrid[0:height, 0:width].astype(np.float32)
        ramp = (np.cos(angle) * xs / width + np.sin(angle) * ys / height) * 24.0
        canvas += (ramp - ramp.mean())[..., None]
    elif texture == "stripes":
        period = rng.uniform(6, 14)
        phase = rng.uniform(0, period)
        ys, xs = np.mgrid[0:height, 0:width].astype(np.float32)
        canvas += (6.0 * np.sin(2 * np.pi * (xs + ys + phase) / period))[..., None]
    return canvas


def _shape_mask(shape: Shape, width: int, height: int) -> np.ndarray:
    """Coverage in [0, 1] of one shape, drawn at SUPERSAMPLE x and box-filtered down."""
    s = SUPERSAMPLE
    mask = Image.new("L", (width * s, height * s), 0)
    draw = ImageDraw.Draw(mask)
    cx, cy, half = shape.cx * s, shape.cy * s, shape.extent * s / 2
    if shape.kind == "circle":
        draw.ellipse((cx - half, cy - half, cx + half, cy + half), fill=255)
    elif shape.kind == "square":
        side = half * 0.9  # a square looks larger than a circle of the same box; even them out
        draw.rectangle((cx - side, cy - side, cx + side, cy + side), fill=255)
    elif shape.kind == "triangle":
        draw.polygon([(cx, cy - half), (cx + half, cy + half * 0.85), (cx - half, cy + half * 0.85)], fill=255)
    else:
        raise ValueError(f"unknown shape kind {shape.kind!r}")
    small = mask.resize((width, height), Image.Resampling.BOX)
    return np.asarray(small, dtype=np.float32) / 255.0
