"""Test videos: moving shapes on a gradient, written with torchcodec's encoder (deterministic pixels)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch


def moving_shapes(num_frames: int, height: int, width: int, seed: int = 0) -> torch.Tensor:
    """[num_frames, 3, height, width] uint8: a gradient background, a square and a bar that move."""
    rng = np.random.default_rng(seed)
    ys, xs = np.mgrid[0:height, 0:width].astype(np.float32)
    colours = rng.integers(40, 256, size=(2, 3))
    frames = np.empty((num_frames, height, width, 3), dtype=np.uint8)
    side = max(4, min(height, width) // 4)
    for k in range(num_frames):
        rgb = np.stack([255 * xs / max(width - 1, 1), 255 * ys / max(height - 1, 1),
                        np.full_like(xs, (37 * k + 50 * seed) % 256)], axis=-1)
        x0 = (k * 5 + seed * 7) % max(width - side, 1)
        y0 = (k * 3) % max(height - side, 1)
        rgb[y0:y0 + side, x0:x0 + side] = colours[0]
        bar = (k * 4) % max(width, 1)
        rgb[:, bar:bar + 3] = colours[1]
        frames[k] = rgb.astype(np.uint8)
    return torch.from_numpy(frames).permute(0, 3, 1, 2).contiguous()


def write_video(path: Path, num_frames: int, height: int, width: int, fps: float, seed: int = 0) -> Path:
    """An mp4 (H.264 when the FFmpeg build has it, else mpeg4) of `moving_shapes`."""
    from torchcodec.encoders import VideoEncoder

    frames = moving_shapes(num_frames, height, width, seed)
    VideoEncoder(frames, frame_rate=fps).to_file(str(path))
    return Path(path)
