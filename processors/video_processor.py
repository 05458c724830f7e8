"""Qwen-VL video preprocessing: pick frames, size them, resize, normalise, patchify (torch).

Output equals transformers' video processors for the same config, bit for bit:
`Qwen2VLVideoProcessor` (Qwen2-VL, Qwen2.5-VL: the "qwen2" style) and `Qwen3VLVideoProcessor`
(Qwen3-VL, Qwen3.5: the "qwen3" style; which one a checkpoint has: `vlmrun.processors.video_config`). The
two differ in

  frame sampling  qwen2: off unless configured or asked for (then `fps` / `num_frames`, rounded to
                  the temporal patch); qwen3: on, 2 frames/s by default, `linspace` indices;
  sizing          qwen2: `smart_resize` of one frame within [shortest_edge, longest_edge];
                  qwen3: the same bounds apply to the pixels of all sampled frames together;

What the LLM sees is the processor class's choice, not the video processor's (`vlmrun.processors.processor`):
`Qwen2_5_VLProcessor` writes one run of video tokens, temporal M-RoPE scaled by `second_per_grid_t`
= temporal_patch / sampled fps; `Qwen3VLProcessor` writes per temporal group a `<t seconds>` text
timestamp and its own vision_start / vision_end. A Qwen3-VL checkpoint without a video config gets
`Qwen2VLVideoProcessor` frames (from its image config's class) in the Qwen3-VL prompt, as in transformers.

Frames are decoded by `vlmrun.processors.video_io` (only the sampled ones), resized as uint8 by
torchvision (bicubic, antialias, as transformers does), normalised through the per-level lookup
table of the image path and patchified into rows [grid_t * gh * gw, 3 * T * P * P] in
merge-window order; an odd frame count repeats the last frame to fill the temporal patch.

Per-item options (qwen-vl-utils names) act as the processor's kwargs would: `fps`, `nframes`
(= num_frames), `min_frames`, `max_frames`, `min_pixels` / `max_pixels` (= size shortest_edge /
longest_edge), `total_pixels` (a pixel budget over all frames, qwen-vl-utils' per-frame cap),
`video_start` / `video_end` (seconds: frames outside are not sampled).
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
from dataclasses import dataclass, field, replace
from typing import Any, Sequence

import numpy as np
import torch

from vlmrun.processors.image_io import load_image
from vlmrun.processors.image_processor import _check_aspect, smart_resize
from vlmrun.processors.limits import InputError, ProcessorLimits
from vlmrun.processors.pixel_backends import TorchvisionPixels
from vlmrun.processors.video_config import VideoProcessorConfig
from vlmrun.processors.video_io import open_video
from vlmrun.processors.video_metadata import FrameMetadata, is_frames_with_metadata  # noqa: F401 (re-exported)

# Frame rate assumed for frames given as a list or an array (no container to read it from).
DEFAULT_FRAME_LIST_FPS = 2.0
# Frames decoded at full size at a time, each batch resized before the next is decoded.
DECODE_BATCH = 2
# Pixel values normalised and patchified at a time (the gather's int32 and float32 copies).
PATCHIFY_CHUNK = 1 << 22
VIDEO_OPTION_KEYS = ("do_sample_frames", "fps", "nframes", "min_frames", "max_frames", "min_pixels", "max_pixels", "total_pixels",
                     "video_start", "video_end")

@dataclass
class ProcessedVideo:
    """One preprocessed video.

    pixel_values: [grid_t * grid_h * grid_w, 3 * T * P * P] float32.
    grid_thw: (grid_t, grid_h, grid_w) in patches.
    hash: sha256 over the config, the sampled frames' uint8 pixels and the sampling (indices, fps).
    timestamps: seconds of each temporal group (mean of its first and last frame), for the qwen3 prompt.
    second_per_grid_t: seconds per temporal group (temporal patch / sampled fps), for qwen2 M-RoPE.
    """

    pixel_values: torch.Tensor
    grid_thw: tuple[int, int, int]
    hash: str
    timestamps: list[float] = field(default_factory=list)
    second_per_grid_t: float = 1.0
    size: tuple[int, int] = (0, 0)


@dataclass(frozen=True)
class VideoOptions:
    """Per-item options (qwen-vl-utils names); None = the processor's config."""

    fps: float | None = None
    nframes: int | None = None
    min_frames: int | None = None
    max_frames: int | None = None
    min_pixels: int | None = None
    max_pixels: int | None = None
    total_pixels: int | None = None
    video_start: float | None = None
    video_end: float | None = None
    do_sample_frames: bool | None = None  # transformers' / vLLM's: False takes every frame given or decoded


class VideoProcessor:
    """Samples, resizes and patchifies videos for the Qwen-VL vision towers (CPU tensors)."""

    def __init__(self, config: VideoProcessorConfig) -> None:
        self.config = config
        self.pixels = TorchvisionPixels()
        self._table: torch.Tensor | None = None

    def num_tokens(self, grid_thw: tuple[int, int, int]) -> int:
        t, h, w = grid_thw
        return t * h * w // (self.config.merge_size ** 2)

    def preprocess(self, source: Any, limits: ProcessorLimits, options: VideoOptions = VideoOptions(),
                   max_tokens: int | None = None) -> ProcessedVideo:
        """Decode (only the sampled frames of) `source`, then resize, normalise and patchify them.

        The frame count and the size every frame is resized to, and so the LLM tokens, come from the
        container's metadata before any frame is decoded: a video over `max_tokens` (default
        `limits.video_token_budget`: the request's limit and the model's context) is refused then.
        Frames are decoded a few at a time and resized at once, so a request holds at most
        `DECODE_BATCH` full-size frames."""
        cfg = self._config_for(options)
        budget = limits.video_token_budget if max_tokens is None else max_tokens
        metadata = None
        if is_frames_with_metadata(source):  # vLLM's (frames, metadata) form
            source, metadata = source[0], FrameMetadata.of(source[1], len(source[0]), DEFAULT_FRAME_LIST_FPS)
            if options.do_sample_frames:
                raise InputError("do_sample_frames=True with (frames, metadata): the frames are taken as sampled "
                                 "already (give the video file with 'fps' / 'nframes' to sample it)")
        if isinstance(source, (list, tuple)) or isinstance(source, (np.ndarray, torch.Tensor)):
            given_list = isinstance(source, (list, tuple))
            frames = _frames_from_list(source, limits) if given_list else _frames_from_array(source)
            self._check_frame_count(frames.shape[0], limits)
            n = frames.shape[0]
            fps = options.fps or (metadata.fps if metadata else DEFAULT_FRAME_LIST_FPS)
            indices = metadata.frames_indices if metadata else list(range(n))
            total = metadata.total_num_frames if metadata else n
            size = self._plan(n, *frames.shape[-2:], cfg, options.total_pixels, budget,
                              limits)
            resized = self.pixels.finish(frames, size, cfg.resample) if cfg.do_resize else frames
            return self._process_frames(resized, indices, total, fps, cfg)
        video = open_video(source, limits)
        total, fps = video.info.num_frames, video.info.fps
        indices = self.sample_indices(total, fps, cfg, options)
        self._check_frame_count(len(indices), limits)
        if not indices:
            raise InputError("the video has no frames")
        size = self._plan(len(indices), video.info.height, video.info.width, cfg, options.total_pixels, budget,
                          limits)
        resized = torch.empty(len(indices), 3, *size, dtype=torch.uint8)
        for start in range(0, len(indices), DECODE_BATCH):
            frames = video.frames_at(indices[start:start + DECODE_BATCH])  # [k, 3, H, W] uint8
            if tuple(frames.shape[-2:]) != (video.info.height, video.info.width):
                raise InputError(f"the video's frames are {frames.shape[-1]}x{frames.shape[-2]}, not the "
                                 f"{video.info.width}x{video.info.height} its container declares")
            resized[start:start + len(frames)] = self.pixels.finish(frames, size, cfg.resample)
        return self._process_frames(resized, indices, total, fps, cfg)

    def _plan(self, num_frames: int, height: int, width: int, cfg: VideoProcessorConfig, total_pixels: int | None,
              max_tokens: int, limits: ProcessorLimits) -> tuple[int, int]:
        """The (height, width) frames are resized to; InputError when that needs more than `max_tokens`."""
        if num_frames == 0:
            raise InputError("the video has no frames")
        size = self.target_size(num_frames, height, width, cfg, total_pixels)
        grid = (-(-num_frames // cfg.temporal_patch_size), size[0] // cfg.patch_size, size[1] // cfg.patch_size)
        tokens = self.num_tokens(grid)
        if tokens > max_tokens:
            left = (f" ({max_tokens:,} left after the request's earlier videos)"
                    if max_tokens < limits.video_token_budget else "")
            raise InputError(f"{num_frames:,} frames at {size[1]}x{size[0]} need {tokens:,} tokens, more than "
                             f"{limits.describe_video_budget()}{left} (sample fewer frames with 'fps' / "
                             "'nframes', or fewer pixels with 'max_pixels' / 'total_pixels')")
        return size

    def _check_frame_count(self, n: int, limits: ProcessorLimits) -> None:
        if n > limits.max_video_frames:
            raise InputError(f"{n:,} frames sampled from the video, more than the limit of {limits.max_video_frames:,} "
                             "(ask for fewer with 'fps' or 'nframes')")

    def _config_for(self, options: VideoOptions) -> VideoProcessorConfig:
        cfg = self.config
        changes: dict[str, Any] = {}
        if options.fps is not None or options.nframes is not None:
            changes.update(do_sample_frames=True, fps=options.fps if options.nframes is None else None,
                           num_frames=options.nframes)
        if options.do_sample_frames is not None:
            changes["do_sample_frames"] = options.do_sample_frames
        for key in ("min_frames", "max_frames", "min_pixels", "max_pixels"):
            if getattr(options, key) is not None:
                changes[key] = getattr(options, key)
        return replace(cfg, **changes) if changes else cfg

    # ----------------------------------------------------------------------------------------
    # frame sampling

    def sample_indices(self, total: int, fps: float | None, cfg: VideoProcessorConfig,
                       options: VideoOptions = VideoOptions()) -> list[int]:
        """Indices of the frames to decode, as transformers' processor of the style picks them.

        video_start / video_end cut the frame range first (indices stay those of the file)."""
        first, last = 0, total - 1
        if options.video_start is not None or options.video_end is not None:
            rate = fps or 24.0
            if options.video_start is not None:
                first = max(0, math.ceil(options.video_start * rate))
            if options.video_end is not None:
                last = min(total - 1, math.floor(options.video_end * rate))
            if last < first:
                raise InputError(f"video_start / video_end select no frames of a {total}-frame video")
        span = last - first + 1
        if not cfg.do_sample_frames:
            picked = list(range(span))
        elif cfg.style == "qwen2":
            picked = _qwen2_sample(span, fps, cfg)
        else:
            picked = _qwen3_sample(span, fps, cfg)
        return [first + i for i in picked]

    # ----------------------------------------------------------------------------------------
    # sizing, pixels

    def target_size(self, num_frames: int, height: int, width: int, cfg: VideoProcessorConfig,
                    total_pixels: int | None = None) -> tuple[int, int]:
        """(height, width) every frame is resized to."""
        f, tps = cfg.factor, cfg.temporal_patch_size
        if not cfg.do_resize:
            return height, width
        max_pixels = cfg.max_pixels
        if cfg.style == "qwen2":
            if cfg.cap_pixels_per_frame or total_pixels is not None:
                budget = total_pixels if total_pixels is not None else int(cfg.max_video_tokens * f * f * 0.9)
                max_pixels = max(min(max_pixels, budget * tps // num_frames), int(cfg.min_pixels * 1.05))
            return smart_resize(height, width, f, cfg.min_pixels, max_pixels)
        if cfg.cap_pixels_per_frame:
            per_frame = max(min(cfg.max_video_tokens * f * f, max_pixels // num_frames), int(cfg.min_pixels * 1.05))
            max_pixels = per_frame * num_frames
        if total_pixels is not None:
            max_pixels = min(max_pixels, total_pixels)
        return _qwen3_smart_resize(num_frames, height, width, tps, f, cfg.min_pixels, max_pixels)

    def _process_frames(self, resized: torch.Tensor, indices: list[int], total: int, fps: float | None,
                        cfg: VideoProcessorConfig) -> ProcessedVideo:
        """Frames already at their target size ([n, 3, H, W] uint8): hash, normalise, patchify."""
        n, _, height, width = resized.shape
        p, tps = cfg.patch_size, cfg.temporal_patch_size
        grid = (-(-n // tps), height // p, width // p)
        rate = fps if fps else 24.0
        sampled_fps = len(indices) / total * rate if total else rate
        timestamps = _timestamps(indices, rate, tps)

        digest = hashlib.sha256()
        digest.update(cfg.fingerprint())
        digest.update(struct.pack("<6q", n, height, width, *grid))
        digest.update(json.dumps([indices, rate]).encode())
        digest.update(memoryview(resized.numpy()).cast("B"))

        pixel_values = self._patchify(resized, cfg)
        return ProcessedVideo(pixel_values=pixel_values, grid_thw=grid, hash=digest.hexdigest(),
                              timestamps=timestamps, second_per_grid_t=tps / sampled_fps, size=(height, width))

    def _patchify(self, frames: torch.Tensor, cfg: VideoProcessorConfig) -> torch.Tensor:
        """[n, 3, H, W] uint8 -> [grid_t * gh * gw, 3 * T * P * P] float32 (transformers' layout), written
        into the output a band of merge-window rows of one temporal group at a time (the int32 / float32
        copies of the gather exist only for about `PATCHIFY_CHUNK` values at once)."""
        p, m, t = cfg.patch_size, cfg.merge_size, cfg.temporal_patch_size
        if self._table is None:  # mean / std are the config's (no per-item option changes them)
            self._table = self.pixels.normalise_table(cfg.image_mean, cfg.image_std, cfg.rescale_factor,
                                                      cfg.do_rescale, cfg.do_normalize).reshape(-1)
        if pad := -frames.shape[0] % t:  # repeat the last frame to fill the temporal patch
            frames = torch.cat([frames, frames[-1:].expand(pad, -1, -1, -1)])
        n, c, h, w = frames.shape
        gt, gh, gw = n // t, h // p, w // p
        offsets = (torch.arange(3, dtype=torch.int32) * 256).view(1, 3, 1, 1)
        out = torch.empty(gt * gh * gw, c * t * p * p, dtype=torch.float32)
        band = m * p  # pixel rows of one row of merge windows
        step = max(1, PATCHIFY_CHUNK // (t * c * band * w))  # rows of merge windows per chunk
        for g in range(gt):
            for r in range(0, gh // m, step):
                k = min(step, gh // m - r)
                pixels = frames[g * t:(g + 1) * t, :, r * band:(r + k) * band]  # [T, 3, k*m*P, W] uint8
                x = self._table[pixels.to(torch.int32) + offsets]  # float32
                # [T, C, k, m, P, gw/m, m, P] -> [k, gw/m, m(h), m(w), C, T, P, P]
                x = x.reshape(t, c, k, m, p, gw // m, m, p).permute(2, 5, 3, 6, 1, 0, 4, 7)
                first = g * gh * gw + r * m * gw
                out[first:first + k * m * gw] = x.reshape(k * m * gw, c * t * p * p)
        return out


# --------------------------------------------------------------------------------------------
# transformers' sampling and sizing, per style


def _qwen2_sample(total: int, fps: float | None, cfg: VideoProcessorConfig) -> list[int]:
    """`Qwen2VLVideoProcessor.sample_frames`."""
    tps = cfg.temporal_patch_size
    num_frames = cfg.num_frames
    if num_frames is not None:
        num_frames = round(num_frames / tps) * tps
    elif cfg.fps is not None:
        if fps is None:
            raise InputError("sampling by fps needs the video's frame rate, and this video has none")
        max_frames = math.floor(min(cfg.max_frames, total) / tps) * tps
        n = total / fps * cfg.fps
        n = min(max(n, cfg.min_frames), max_frames, total)
        num_frames = math.floor(n / tps) * tps
    if num_frames is None:
        return list(range(total))
    if num_frames > total:
        raise InputError(f"cannot sample {num_frames} frames from a video of {total} frames")
    if num_frames <= 0:
        raise InputError(f"the video has {total} frames, too few to sample whole temporal patches of {tps}")
    return torch.arange(0, total, total / num_frames).int().tolist()


def _qwen3_sample(total: int, fps: float | None, cfg: VideoProcessorConfig) -> list[int]:
    """`Qwen3VLVideoProcessor.sample_frames` (a video without a frame rate counts as 24 frames/s)."""
    num_frames = cfg.num_frames
    if num_frames is None and cfg.fps is not None:
        num_frames = int(total / (fps or 24) * cfg.fps)
        num_frames = min(max(num_frames, cfg.min_frames), cfg.max_frames, total)
    if num_frames is None:
        num_frames = min(max(total, cfg.min_frames), cfg.max_frames)
    return np.linspace(0, total - 1, num_frames).round().astype(int).tolist()


def _qwen3_smart_resize(num_frames: int, height: int, width: int, temporal_factor: int, factor: int,
                        min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """`smart_resize` of transformers' Qwen3-VL video processor: the bounds hold for all frames together."""
    if num_frames < temporal_factor:
        raise InputError(f"the video has {num_frames} sampled frame(s); this model needs at least {temporal_factor}")
    if height < factor or width < factor:
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    _check_aspect(height, width)
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    t_bar = round(num_frames / temporal_factor) * temporal_factor
    if t_bar * h_bar * w_bar > max_pixels:
        beta = math.sqrt((num_frames * height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif t_bar * h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (num_frames * height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def _timestamps(indices: Sequence[int], fps: float, temporal_patch: int) -> list[float]:
    """Seconds of each temporal group: the mean of its first and last frame's time (`Qwen3VLProcessor`)."""
    padded = list(indices)
    if len(padded) % temporal_patch:
        padded.extend(padded[-1] for _ in range(temporal_patch - len(padded) % temporal_patch))
    times = [i / fps for i in padded]
    return [(times[i] + times[i + temporal_patch - 1]) / 2 for i in range(0, len(times), temporal_patch)]


def _frames_from_list(frames: Sequence[Any], limits: ProcessorLimits) -> torch.Tensor:
    """Frames given one by one (paths, PIL images, ...): [n, 3, H, W] uint8; all must have one size."""
    if not frames:
        raise InputError("the video has no frames (an empty list)")
    if len(frames) > limits.max_video_frames:
        raise InputError(f"{len(frames):,} frames given, more than the limit of {limits.max_video_frames:,}")
    images = [load_image(f, limits) for f in frames]
    sizes = {im.size for im in images}
    if len(sizes) > 1:
        raise InputError(f"the frames of a video must all have one size, got {sorted(sizes)}")
    stacked = np.stack([np.asarray(im, dtype=np.uint8) for im in images])  # [T, H, W, 3]
    return torch.from_numpy(stacked).permute(0, 3, 1, 2).contiguous()


def _frames_from_array(array: Any) -> torch.Tensor:
    """An array [T, H, W, 3] (numpy or torch), or [T, 3, H, W] as qwen-vl-utils returns frames: [T, 3, H, W]
    uint8. uint8, or floats in [0, 255] (rounded to uint8)."""
    tensor = torch.as_tensor(array)
    channels_first = tensor.ndim == 4 and tensor.shape[1] == 3 and tensor.shape[-1] != 3
    if tensor.ndim != 4 or (tensor.shape[-1] != 3 and not channels_first):
        raise InputError(f"a video array must have shape [T, H, W, 3] or [T, 3, H, W], got {tuple(tensor.shape)}")
    if tensor.is_floating_point():
        if tensor.numel() and not (bool(torch.isfinite(tensor).all()) and tensor.min() >= 0 and tensor.max() <= 255):
            raise InputError("a float video array must hold pixel values in [0, 255]")
        tensor = tensor.round().to(torch.uint8)
    if tensor.dtype != torch.uint8:
        raise InputError(f"a video array must be uint8 (or floats in [0, 255]), got {tensor.dtype}")
    if tensor.shape[0] == 0:
        raise InputError("the video has no frames (an empty array)")
    return tensor.contiguous() if channels_first else tensor.permute(0, 3, 1, 2).contiguous()
