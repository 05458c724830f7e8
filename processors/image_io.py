"""Image loading: any accepted image source -> an RGB `PIL.Image.Image`, or `InputError`.

Accepted sources: a filesystem path (str / PathLike, also `file://` URIs), an http(s) URL, a
`data:` URI (base64), raw bytes, a PIL image, or a numpy array (HxW, HxWx1, HxWx3, HxWx4; uint8, or
float with values in [0, 1]).

Every image goes through the same steps:
  1. bytes are capped (`limits.max_image_bytes`) before they are read / downloaded / decoded
     (files, URLs and data URIs are read by `media_sources.py`);
  2. the header is parsed and width*height checked against `limits.max_image_pixels` BEFORE the
     pixels are decoded (decompression bombs cost nothing);
  3. the pixels are fully decoded (`Image.load()`), so corrupt / truncated files fail here, not later.
     Steps 1-2 are `open_image` (an `OpenedImage`: the size known, nothing decoded, so a request's
     token count can be checked before any image of it is decoded), 3-5 `OpenedImage.decode`;
  4. the EXIF orientation is applied (`ImageOps.exif_transpose`);
  5. transparency (RGBA, LA, PA, P / L / RGB with a transparency key) is composited on white,
     then the image is converted to RGB (16-bit grayscale is scaled down to 8 bits first).
"""

from __future__ import annotations

import io
import os
from dataclasses import dataclass
from typing import Any, Union

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from vlmrun.processors.limits import InputError, ProcessorLimits, quote
from vlmrun.processors.media_sources import decode_data_uri, fetch_url, file_uri_to_path, read_local_file

ImageSource = Union[str, os.PathLike, bytes, bytearray, memoryview, Image.Image, np.ndarray]

DEFAULT_LIMITS = ProcessorLimits()
_EXIF_ORIENTATION = 0x0112


def load_image(source: ImageSource, limits: ProcessorLimits | None = None) -> Image.Image:
    """Load, validate and normalise one image; returns a fully decoded RGB PIL image.

    Raises InputError (a ValueError) with a message naming the problem for anything that is not a
    readable image within `limits`.
    """
    return open_image(source, limits).decode()


@dataclass
class OpenedImage:
    """An image whose bytes and header were read (size known and checked), pixels not yet decoded."""

    image: Image.Image
    what: str  # how error messages name it

    @property
    def size(self) -> tuple[int, int]:
        """(height, width) as stored (before any EXIF rotation, which keeps the token count)."""
        return self.image.height, self.image.width

    def decode(self) -> Image.Image:
        """The image fully decoded (corrupt or truncated data fails here), EXIF-rotated, RGB."""
        try:
            self.image.load()
        except MemoryError:
            raise
        except Exception as exc:  # truncated / corrupt data: OSError, SyntaxError, EOFError, ...
            kind = f" ({self.image.format})" if self.image.format else ""
            raise InputError(f"{self.what} is corrupt or truncated{kind}: {exc}") from None
        return to_rgb(_apply_exif_orientation(self.image))


def open_image(source: ImageSource, limits: ProcessorLimits | None = None) -> OpenedImage:
    """Read one image's bytes (file, URL, data URI) and header, not its pixels. InputError for anything
    that is not a readable image header within `limits`."""
    limits = limits or DEFAULT_LIMITS
    if isinstance(source, Image.Image):
        _check_pixels(source.width, source.height, limits, "PIL image")
        return OpenedImage(source, "PIL image")
    if isinstance(source, np.ndarray):
        return _from_array(source, limits)
    if isinstance(source, (bytes, bytearray, memoryview)):
        return open_image_bytes(bytes(source), limits, what="image bytes")
    if isinstance(source, (str, os.PathLike)):
        return _from_string(source, limits)
    raise InputError(
        f"unsupported image source of type {type(source).__name__}: expected a path, URL, data URI, "
        "bytes, PIL image or numpy array"
    )


def describe_source(source: Any) -> str:
    """A short, safe description of an image source for error messages (never the data itself)."""
    if isinstance(source, (str, os.PathLike)):
        text = os.fspath(source)
        if isinstance(text, bytes):
            text = text.decode(errors="replace")
        if text[:5].lower() == "data:":
            return f"data URI ({len(text)} chars)"
        return repr(text if len(text) <= 120 else text[:117] + "...")
    if isinstance(source, (bytes, bytearray, memoryview)):
        return f"{len(source)} bytes"
    if isinstance(source, np.ndarray):
        return f"numpy array {tuple(source.shape)} {source.dtype}"
    if isinstance(source, Image.Image):
        return f"PIL image {source.width}x{source.height} {source.mode}"
    return type(source).__name__


# --------------------------------------------------------------------------------------------
# sources


def _from_string(source: str | os.PathLike, limits: ProcessorLimits) -> OpenedImage:
    text = os.fspath(source)
    if isinstance(text, bytes):  # a bytes path from os.fspath(PathLike[bytes])
        text = text.decode()
    if isinstance(source, str):
        head = text[:10].lower()
        if head.startswith("data:"):
            return open_image_bytes(decode_data_uri(text, limits.max_image_bytes), limits, what="data URI")
        if head.startswith(("http://", "https://")):
            data = fetch_url(text, limits, limits.max_image_bytes)
            return open_image_bytes(data, limits, what=f"image at {quote(text)}")
        if head.startswith("file://"):
            return _from_path(file_uri_to_path(text), limits)
        if "://" in text[:16]:
            scheme = text.split("://", 1)[0]
            raise InputError(f"unsupported URL scheme {scheme!r}: use http(s)://, file:// or a data: URI")
    return _from_path(text, limits)


def _from_path(path: str, limits: ProcessorLimits) -> OpenedImage:
    data = read_local_file(path, limits, limits.max_image_bytes)
    return open_image_bytes(data, limits, what=f"image file {quote(path)}")


# --------------------------------------------------------------------------------------------
# decoding


def _ensure_pil_guard(max_pixels: int) -> None:
    """Keep PIL's own decompression-bomb guard from refusing images our limit allows.

    PIL warns above `Image.MAX_IMAGE_PIXELS` and raises above twice that, inside `Image.open`.
    Our header check (`_check_pixels`) is the real limit; PIL's guard stays as a second line of
    defence, raised (never lowered) to our limit when a caller configures a larger one.
    """
    current = Image.MAX_IMAGE_PIXELS
    if current is None or current < max_pixels:
        Image.MAX_IMAGE_PIXELS = max_pixels


def _registered_formats(names: tuple[str, ...]) -> list[str]:
    """The allowed format names this PIL build can decode (Image.open fails on unknown names)."""
    Image.init()
    return [name.upper() for name in names if name.upper() in Image.OPEN]


def _check_pixels(width: int, height: int, limits: ProcessorLimits, what: str) -> None:
    if width <= 0 or height <= 0:
        raise InputError(f"{what} has no pixels ({width}x{height})")
    if width * height > limits.max_image_pixels:
        raise InputError(
            f"{what} is {width}x{height} = {width * height:,} pixels, more than the limit of "
            f"{limits.max_image_pixels:,} pixels"
        )


def open_image_bytes(data: bytes, limits: ProcessorLimits | None = None, what: str = "image") -> OpenedImage:
    """Encoded image bytes opened (header read, size checked), pixels not yet decoded."""
    limits = limits or DEFAULT_LIMITS
    if not data:
        raise InputError(f"{what} is empty (0 bytes)")
    if len(data) > limits.max_image_bytes:
        raise InputError(f"{what} is {len(data):,} bytes, more than the limit of {limits.max_image_bytes:,}")
    _ensure_pil_guard(limits.max_image_pixels)
    try:
        image = Image.open(io.BytesIO(data), formats=_registered_formats(limits.allowed_formats))
    except Image.DecompressionBombError:
        raise InputError(f"{what} has more pixels than the limit of {limits.max_image_pixels:,}") from None
    except UnidentifiedImageError:
        raise InputError(
            f"{what} is not a recognised image ({_sniff(data)}); supported formats: "
            f"{', '.join(limits.allowed_formats)}"
        ) from None
    except MemoryError:
        raise
    except Exception as exc:  # malformed headers raise all sorts (SyntaxError, struct.error, ...)
        raise InputError(f"{what} has an invalid image header: {exc}") from None
    # The header alone gave the size: refuse bombs before a single pixel is decoded.
    _check_pixels(image.width, image.height, limits, what)
    return OpenedImage(image, what)


def _from_array(array: np.ndarray, limits: ProcessorLimits) -> OpenedImage:
    what = f"numpy image {tuple(array.shape)}"
    if array.ndim == 3 and array.shape[2] == 1:
        array = array[:, :, 0]
    if not (array.ndim == 2 or (array.ndim == 3 and array.shape[2] in (3, 4))):
        raise InputError(
            f"{what} has an unsupported shape: expected HxW, HxWx1, HxWx3 or HxWx4 (channels last)"
        )
    _check_pixels(array.shape[1], array.shape[0], limits, what)
    if array.dtype == np.uint8:
        pixels = array
    elif np.issubdtype(array.dtype, np.floating):
        if not np.isfinite(array).all():
            raise InputError(f"{what} contains NaN or infinite values")
        lo, hi = float(array.min()), float(array.max())
        if lo < 0.0 or hi > 1.0:
            raise InputError(f"{what} is float with values in [{lo:g}, {hi:g}]; float images must lie in [0, 1]")
        # Round to the nearest uint8 level, so that x / 255 round-trips exactly.
        pixels = np.rint(array.astype(np.float64) * 255.0).astype(np.uint8)
    else:
        raise InputError(f"{what} has dtype {array.dtype}; use uint8 (0-255) or float (0-1)")
    return OpenedImage(Image.fromarray(np.ascontiguousarray(pixels)), what)  # HxW -> L, HxWx3 -> RGB, HxWx4 -> RGBA


# --------------------------------------------------------------------------------------------
# normalisation


def _apply_exif_orientation(image: Image.Image) -> Image.Image:
    try:
        orientation = image.getexif().get(_EXIF_ORIENTATION, 1)
    except Exception:  # unreadable EXIF block: keep the pixels as stored
        return image
    if orientation in (None, 1):
        return image
    try:
        return ImageOps.exif_transpose(image)
    except Exception as exc:
        raise InputError(f"cannot apply the image's EXIF orientation ({orientation}): {exc}") from None


def to_rgb(image: Image.Image) -> Image.Image:
    """Convert to RGB; transparent pixels are composited on a white background."""
    if image.mode == "RGB":
        return image
    if image.mode.startswith("I;16"):
        # 16-bit grayscale (e.g. 16-bit PNG): scale to 8 bits instead of clipping at 255.
        levels = np.asarray(image).astype(np.float64) / 257.0
        image = Image.fromarray(np.rint(levels).astype(np.uint8))
    bands = image.getbands()
    if "A" in bands or "a" in bands or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return image.convert("RGB")


def _sniff(data: bytes) -> str:
    """A hint about what non-image bytes are, for error messages."""
    head = data[:512]
    stripped = head.lstrip()
    if stripped[:1] in (b"{", b"[") or stripped[:5].lower() in (b"<!doc", b"<html"):
        return "looks like HTML/JSON"
    printable = sum(1 for b in head if 32 <= b < 127 or b in (9, 10, 13))
    if printable >= 0.95 * len(head):
        return "looks like text"
    return f"{len(data):,} bytes of unknown type"


__all__ = ["ImageSource", "OpenedImage", "load_image", "open_image", "to_rgb", "describe_source"]
