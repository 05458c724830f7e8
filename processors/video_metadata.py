"""vLLM's video input form `(frames, metadata)`: frames sampled already, with what the source video was.

vLLM's Qwen3-VL takes a video as a tuple of its frames (an array [T, H, W, 3] or a list of frames) and
a metadata dict (`fps` of the source, `frames_indices` the frames had in it, `total_num_frames`,
`duration`, `video_backend`...). The processor then samples nothing, and the timestamps of the Qwen3-VL
prompt (`<t seconds>`) and the Qwen2.5-VL temporal scale come from the metadata: frame k is at
`frames_indices[k] / fps` seconds. `do_sample_frames=True` (sample again from the given frames) is
refused with a message; give the video file with `fps` / `nframes` for that.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Any, Mapping

from vlmrun.processors.limits import InputError


def is_frames_with_metadata(source: Any) -> bool:
    """vLLM's video form `(frames, metadata)`: a 2-tuple of frames (an array or a list) and a metadata dict."""
    return isinstance(source, tuple) and len(source) == 2 and isinstance(source[1], Mapping)


@dataclass(frozen=True)
class FrameMetadata:
    """What vLLM's video metadata says of frames sampled already: the source's frame rate, the indices the
    frames had in it and its frame count (so timestamps and the temporal scale are the source's)."""

    fps: float
    frames_indices: list[int]
    total_num_frames: int

    @classmethod
    def of(cls, metadata: Mapping[str, Any], num_frames: int, default_fps: float = 2.0) -> "FrameMetadata":
        """From vLLM's metadata dict (`fps`, `frames_indices`, `total_num_frames`; `duration`, `video_backend`
        and the like are not needed); InputError for a value that does not fit `num_frames` frames."""
        fps = _plain(metadata.get("fps")) or default_fps
        if isinstance(fps, bool) or not isinstance(fps, numbers.Real) or not math.isfinite(fps) or fps <= 0:
            raise InputError(f"video metadata: fps must be a positive number, got {fps!r}")
        indices = _plain(metadata.get("frames_indices"))
        indices = list(range(num_frames)) if indices is None else list(indices)
        if len(indices) != num_frames or not all(isinstance(i, numbers.Integral) and i >= 0 for i in indices):
            raise InputError(f"video metadata: frames_indices must hold one index (an integer >= 0) per frame, "
                             f"{num_frames} here; got {len(indices)}")
        total = _plain(metadata.get("total_num_frames")) or (max(indices) + 1)
        if isinstance(total, bool) or not isinstance(total, numbers.Integral) or total <= max(indices):
            raise InputError(f"video metadata: total_num_frames must be an integer above every frame index, "
                             f"got {total!r}")
        if metadata.get("do_sample_frames"):
            raise InputError("video metadata: do_sample_frames=True is not supported (give the frames sampled "
                             "already, or the video file with 'fps' / 'nframes' to sample it)")
        return cls(float(fps), [int(i) for i in indices], int(total))


def _plain(value: Any) -> Any:
    """A numpy / torch scalar or array as Python numbers (`.tolist()`); anything else as it is."""
    return value.tolist() if hasattr(value, "tolist") else value
