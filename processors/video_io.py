"""Video decoding: a video source -> an open `VideoFile` that knows its frame count and rate and
decodes only the frames asked for, or `InputError`.

The decoder is torchcodec (what transformers decodes video files with: `VideoDecoder` in exact seek
mode, frames fetched by index), else PyAV (every frame decoded in order, the asked ones kept). Both
need FFmpeg: torchcodec the system's libraries (Debian: `apt-get install ffmpeg`), PyAV its own
wheel. `video_decoder()` names the one that works here; with none, every video is an InputError
that says what to install.

Accepted sources: a filesystem path (also `file://` URIs), an http(s) URL, a `data:video/...` URI,
raw bytes. Bytes are capped by `limits.max_video_bytes` before they are read, and the frame count
by `limits.max_video_frames_decoded` before any frame is decoded.
"""

from __future__ import annotations

import functools
import io
import os
from dataclasses import dataclass
from typing import Any, Protocol, Sequence

import torch

from vlmrun.processors.media_sources import decode_data_uri, fetch_url, file_uri_to_path, read_local_file
from vlmrun.processors.limits import InputError, ProcessorLimits, quote

VIDEO_DECODERS = ("torchcodec", "pyav")


@dataclass(frozen=True)
class VideoInfo:
    """What the container says: frame count, average frame rate, frame size in pixels."""

    num_frames: int
    fps: float | None
    height: int
    width: int


class VideoFile(Protocol):
    info: VideoInfo

    def frames_at(self, indices: Sequence[int]) -> torch.Tensor:
        """[len(indices), 3, H, W] uint8 RGB frames."""


@functools.lru_cache(maxsize=1)
def video_decoder() -> str | None:
    """"torchcodec" when it loads with the system FFmpeg, else "pyav" when `av` imports, else None."""
    try:
        import torchcodec
        from torchcodec.decoders import VideoDecoder  # noqa: F401

        # torchcodec imports without FFmpeg too (its image decoders need none) and says so here
        if getattr(torchcodec, "ffmpeg_major_version", 0) is not None:
            return "torchcodec"
    except Exception:  # not installed, or no FFmpeg libraries it can load
        pass
    try:
        import av  # noqa: F401

        return "pyav"
    except Exception:
        return None


def open_video(source: Any, limits: ProcessorLimits) -> VideoFile:
    """Read `source` (path, file:// or http(s) URL, data URI, bytes) and open it for decoding."""
    data = _read_source(source, limits)
    decoder = video_decoder()
    if decoder is None:
        raise InputError("no video decoder is available: install torchcodec and FFmpeg (Debian: apt-get install "
                         "ffmpeg; pip install torchcodec), or PyAV (pip install av)")
    try:
        video: VideoFile = _TorchcodecVideo(data) if decoder == "torchcodec" else _PyAVVideo(data)
    except InputError:
        raise
    except Exception as exc:  # the decoders raise RuntimeError / ValueError / av.error.* for non-videos
        raise InputError(f"cannot decode the video: {_first_line(exc)}") from None
    info = video.info
    if info.num_frames <= 0:
        raise InputError("the video has no frames")
    if info.num_frames > limits.max_video_frames_decoded:
        raise InputError(f"the video has {info.num_frames:,} frames, more than the limit of "
                         f"{limits.max_video_frames_decoded:,}")
    if info.height * info.width > limits.max_image_pixels:
        raise InputError(f"video frames of {info.width}x{info.height} are more than the limit of "
                         f"{limits.max_image_pixels:,} pixels")
    return video


def _read_source(source: Any, limits: ProcessorLimits) -> bytes:
    cap = limits.max_video_bytes
    if isinstance(source, (bytes, bytearray, memoryview)):
        data = bytes(source)
        if len(data) > cap:
            raise InputError(f"video bytes are {len(data):,}, more than the limit of {cap:,}")
    elif isinstance(source, (str, os.PathLike)):
        text = os.fspath(source)
        text = text.decode() if isinstance(text, bytes) else text
        head = text[:10].lower()
        if head.startswith("data:"):
            data = decode_data_uri(text, cap, media="video")
        elif head.startswith(("http://", "https://")):
            data = fetch_url(text, limits, cap, what="video")
        else:
            path = file_uri_to_path(text) if head.startswith("file://") else text
            data = read_local_file(path, limits, cap, what="video")
    else:
        raise InputError(f"unsupported video source of type {type(source).__name__}: expected a path, URL, data "
                         "URI, bytes, a list of frames or an array [T, H, W, C]")
    if not data:
        raise InputError("the video is empty (0 bytes)")
    return data


def _first_line(exc: Exception) -> str:
    """The decoder's message without its source location (torchcodec: "Class, file.cpp:70, message")."""
    lines = str(exc).strip().strip("'\"").splitlines()
    text = lines[0] if lines else type(exc).__name__
    if ".cpp:" in text:
        text = text.rsplit(".cpp:", 1)[1].split(", ", 1)[-1]
    return quote(text, 200)


class _TorchcodecVideo:
    """transformers' way: `VideoDecoder(seek_mode="exact")`, frames fetched by index."""

    def __init__(self, data: bytes) -> None:
        from torchcodec.decoders import VideoDecoder

        self._decoder = VideoDecoder(data, seek_mode="exact", num_ffmpeg_threads=0)
        meta = self._decoder.metadata
        self.info = VideoInfo(num_frames=int(meta.num_frames or 0), fps=meta.average_fps,
                              height=int(meta.height or 0), width=int(meta.width or 0))

    def frames_at(self, indices: Sequence[int]) -> torch.Tensor:
        try:
            return self._decoder.get_frames_at(indices=[int(i) for i in indices]).data.contiguous()
        except Exception as exc:  # a truncated or corrupt stream fails here
            raise InputError(f"cannot decode the video's frames: {_first_line(exc)}") from None


class _PyAVVideo:
    """PyAV: decode every frame of the first video stream in order, keep the asked ones."""

    def __init__(self, data: bytes) -> None:
        import av

        self._data = data
        with av.open(io.BytesIO(data)) as container:
            if not container.streams.video:
                raise InputError("the file has no video stream")
            stream = container.streams.video[0]
            fps = float(stream.average_rate) if stream.average_rate else None
            count = sum(1 for _ in container.demux(stream) if _.size)  # packets with data = frames
            self.info = VideoInfo(num_frames=count, fps=fps, height=stream.height, width=stream.width)

    def frames_at(self, indices: Sequence[int]) -> torch.Tensor:
        import av

        wanted = [int(i) for i in indices]
        keep = set(wanted)
        frames: dict[int, torch.Tensor] = {}
        try:
            with av.open(io.BytesIO(self._data)) as container:
                for k, frame in enumerate(container.decode(video=0)):
                    if k in keep:
                        frames[k] = torch.from_numpy(frame.to_ndarray(format="rgb24")).permute(2, 0, 1)
                    if k >= max(wanted):
                        break
        except Exception as exc:
            raise InputError(f"cannot decode the video's frames: {_first_line(exc)}") from None
        missing = [i for i in wanted if i not in frames]
        if missing:
            raise InputError(f"the video ended before frame {missing[0]} (truncated?)")
        return torch.stack([frames[i] for i in wanted]).contiguous()
