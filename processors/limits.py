"""Input limits and the one error type that bad user input raises.

Everything a request can make the processors do (decode a file, download a URL, allocate pixels)
is bounded by a `ProcessorLimits`. The server can tighten them (and switch off local paths or
remote URLs); offline callers can loosen them.
"""

from __future__ import annotations

from dataclasses import dataclass


class InputError(ValueError):
    """Bad user input (unreadable image, too large, malformed message, ...).

    The message names the problem and is safe to show to the client: it never echoes image data.
    """


# Formats whose PIL decoders are in everyday use for photos and screenshots (JPEG includes the
# multi-picture MPO files some cameras write). Other PIL plugins (EPS calls Ghostscript, exotic
# scientific formats, ...) are refused for untrusted input.
DEFAULT_IMAGE_FORMATS: tuple[str, ...] = ("JPEG", "PNG", "WEBP", "GIF", "BMP", "TIFF", "AVIF")


@dataclass
class ProcessorLimits:
    """Bounds on what one request may ask of the input processors.

    max_image_pixels: width * height of an image as decoded (before any resize). Checked from the
        header, before the pixels are decoded, so a decompression bomb costs nothing. 64 MP fits
        every common camera (a 48 MP phone photo, a 61 MP full-frame DSLR) while bounding one
        decoded image to ~192 MB of RGB.
    max_images_per_request / max_videos_per_request: images / videos in one prompt or chat (checked
        before any is loaded; 0 refuses the modality). vLLM's `limit_mm_per_prompt` maps onto them.
    max_image_bytes: encoded size of one image (file, download, data URI or raw bytes).
    url_timeout_s: total wall-clock budget for fetching one http(s) image.
    allow_local_paths: accept filesystem paths and file:// URIs. A server facing untrusted
        clients should turn this off (otherwise a client can read any image file on the host).
    allow_remote_urls: accept http(s) URLs (the server downloads them).
    allowed_formats: PIL format names that may be decoded.
    max_video_bytes: encoded size of one video (file, download, data URI or raw bytes).
    max_video_frames_decoded: frames in one video file (checked from the container before any
        frame is decoded; sampling then decodes only the frames it picks).
    max_video_frames: frames sampled from one video (what the vision tower sees, before temporal
        patching); a request asking for more (nframes, fps) fails.
    max_video_tokens: LLM tokens of all videos of one request together, checked from the container's
        metadata before a video's first frame is decoded. It bounds a request's video memory: about
        30 KB per token (float32 pixel values 24 KB, the resized frames 6 KB; README, "Video").
    Each video frame is also bounded by `max_image_pixels` as decoded.
    max_prompt_tokens: the most tokens a prompt may have (None: unchecked here). The images of a
        request are refused from their headers, before any is decoded, when they alone need more;
        its videos too, from their containers' metadata (`video_token_budget`).
    """

    max_image_pixels: int = 64_000_000
    max_images_per_request: int = 32
    max_videos_per_request: int = 32
    max_image_bytes: int = 50 * 1024 * 1024
    url_timeout_s: float = 10.0
    allow_local_paths: bool = True
    allow_remote_urls: bool = True
    allowed_formats: tuple[str, ...] = DEFAULT_IMAGE_FORMATS
    max_video_bytes: int = 512 * 1024 * 1024
    max_video_frames_decoded: int = 216_000  # two hours at 30 frames/s
    max_video_frames: int = 768
    max_video_tokens: int = 65_536
    max_prompt_tokens: int | None = None  # the images of a request may need no more (set by the engine)

    def __post_init__(self) -> None:
        for name in ("max_image_pixels", "max_image_bytes", "max_video_bytes",
                     "max_video_frames_decoded", "max_video_frames", "max_video_tokens"):
            if int(getattr(self, name)) <= 0:
                raise ValueError(f"ProcessorLimits.{name} must be positive")
        for name in ("max_images_per_request", "max_videos_per_request"):
            if int(getattr(self, name)) < 0:
                raise ValueError(f"ProcessorLimits.{name} must be >= 0")
        if self.url_timeout_s <= 0:
            raise ValueError("ProcessorLimits.url_timeout_s must be positive")

    @property
    def video_token_budget(self) -> int:
        """The LLM tokens the videos of one request may need together: `max_video_tokens`, and never
        more than a prompt may hold (the model's context), so a video that could never run is refused
        from its container's metadata, before a frame is decoded (the server and the offline API alike)."""
        if self.max_prompt_tokens is None:
            return self.max_video_tokens
        return max(1, min(self.max_video_tokens, self.max_prompt_tokens))

    def describe_video_budget(self) -> str:
        """The video token budget as an error message names it."""
        if self.video_token_budget < self.max_video_tokens:
            return f"the {self.video_token_budget:,} tokens a prompt may hold in this model's context"
        return f"the limit of {self.max_video_tokens:,} video tokens per request"


def quote(value: object, limit: int = 100) -> str:
    """A client value as an error message shows it: repr'd, at most `limit` characters of it."""
    text = repr(value)
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(value) if isinstance(value, str) else len(text):,} characters)"


def check_video_tokens(n_tokens: int, limits: ProcessorLimits) -> None:
    """Raise InputError if the videos of a request need more LLM tokens than `limits` allows."""
    if n_tokens > limits.video_token_budget:
        raise InputError(
            f"the videos of this request need {n_tokens:,} tokens, more than {limits.describe_video_budget()} "
            "(sample fewer frames with 'fps' / 'nframes', or fewer pixels with 'max_pixels')"
        )


def check_media_count(n_images: int, n_videos: int, limits: ProcessorLimits) -> None:
    """Raise InputError if a request carries more images or more videos than `limits` allows."""
    for what, n, limit in (("images", n_images, limits.max_images_per_request),
                           ("videos", n_videos, limits.max_videos_per_request)):
        if n > limit:
            raise InputError(f"too many {what} in one request: {n} (the limit is {limit})")
