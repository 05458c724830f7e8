"""Chat message parsing: OpenAI / HF style messages -> template-ready messages + image references.

A message is a dict with a "role" and a "content" that is a string, None, or a list of items:
  {"type": "text", "text": ...}                                  (also "input_text")
  {"type": "image", "image": src, "min_pixels"?, "max_pixels"?,  (qwen-vl-utils convention; src is
   "resized_height"?, "resized_width"?}                           any source `load_image` accepts)
  {"type": "image_url", "image_url": {"url": ...}}               (OpenAI; also a plain string, and
                                                                   "input_image")
  {"type": "video", "video": src, "fps"?, "nframes"?, ...}        (qwen-vl-utils; src is a path / URL /
                                                                   bytes, a list of frames or an array
                                                                   [T, H, W, 3]; also "path" / "url")
  {"type": "video_url", "video_url": {"url": ...}}               (OpenAI style; also "input_video")
  {"type": "image_pil", "image_pil": PIL.Image}                  (vLLM's in-memory image part)
Items without "type" are recognised by their "image" / "image_url" / "text" key, as the Qwen chat
templates and qwen-vl-utils do. Every image item becomes {"type": "image"} in the messages given
to the chat template (which writes the vision placeholder for it), every video item
{"type": "video"}; their sources and options are returned separately, in order of appearance.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence, Union

from vlmrun.processors.limits import InputError, quote

_IMAGE_TYPES = ("image", "image_url", "input_image")
_TEXT_TYPES = ("text", "input_text")
_VIDEO_TYPES = ("video", "video_url", "input_video")
IMAGE_SOURCE_KEYS = ("image", "image_url")
VIDEO_SOURCE_KEYS = ("video", "video_url", "path", "url")
_SIZE_KEYS = ("min_pixels", "max_pixels", "resized_height", "resized_width")
_VIDEO_INT_KEYS = ("nframes", "min_frames", "max_frames", "min_pixels", "max_pixels", "total_pixels")
_VIDEO_SECONDS_KEYS = ("fps", "video_start", "video_end")


@dataclass
class ImageRef:
    """One image of a chat: where it comes from and how to size it (None = model default)."""

    source: Any
    min_pixels: int | None = None
    max_pixels: int | None = None
    resized_height: int | None = None
    resized_width: int | None = None

    def size_options(self) -> dict[str, int | None]:
        return {k: getattr(self, k) for k in _SIZE_KEYS}


@dataclass
class VideoRef:
    """One video of a chat: where it comes from and its qwen-vl-utils options (only those given)."""

    source: Any
    options: dict[str, float | int] = field(default_factory=dict)


MediaRef = Union[ImageRef, VideoRef]


def parse_messages(messages: Sequence[Mapping[str, Any]], forbidden_text: Iterable[str] = ()
                   ) -> tuple[list[dict[str, Any]], list[MediaRef]]:
    """Validate `messages`; return (messages for the chat template, images and videos in order).

    `forbidden_text`: strings that may not appear in user text (the image / video placeholder
    tokens, which would otherwise be read as extra images).
    """
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise InputError("messages must be a list of {'role': ..., 'content': ...} dicts")
    if not messages:
        raise InputError("messages is empty")
    forbidden = tuple(forbidden_text)
    out: list[dict[str, Any]] = []
    images: list[MediaRef] = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise InputError(f"message {i} must be a dict with 'role' and 'content', got {type(message).__name__}")
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise InputError(f"message {i} has no 'role' string")
        # Keys whose value is None are dropped (OpenAI clients send content=None, tool_calls=None;
        # templates handle a missing key but would print "None").
        rendered = {k: v for k, v in message.items() if v is not None and k != "content"}
        content = message.get("content")
        if content is None:
            pass
        elif isinstance(content, str):
            _check_text(content, forbidden, f"message {i}")
            rendered["content"] = content
        elif isinstance(content, Sequence) and not isinstance(content, (bytes, bytearray)):
            rendered["content"] = [
                _parse_item(item, forbidden, f"message {i} item {j}", images) for j, item in enumerate(content)
            ]
        else:
            raise InputError(f"message {i} content must be a string or a list of items, got {type(content).__name__}")
        out.append(rendered)
    return out, images


def _parse_item(item: Any, forbidden: tuple[str, ...], where: str, images: list[MediaRef]) -> dict[str, Any]:
    if isinstance(item, str):  # a bare string in a content list: plain text
        _check_text(item, forbidden, where)
        return {"type": "text", "text": item}
    if not isinstance(item, Mapping):
        raise InputError(f"{where} must be a dict, got {type(item).__name__}")
    kind = item.get("type")
    if kind is None:  # untyped items, as the Qwen templates accept them: known by their key
        kind = next((key for key in ("image", "image_url", "video", "video_url", "text") if key in item), None)
    if kind in _TEXT_TYPES:
        text = item.get("text")
        if not isinstance(text, str):
            raise InputError(f"{where}: a text item needs a 'text' string")
        _check_text(text, forbidden, where)
        return {"type": "text", "text": text}
    if kind in _IMAGE_TYPES:
        images.append(_image_ref(item, where))
        return {"type": "image"}
    if kind == "image_pil":  # vLLM's part for an in-memory image (Python API)
        images.append(_pil_image_ref(item, where))
        return {"type": "image"}
    if kind in _VIDEO_TYPES:
        images.append(_video_ref(item, where))
        return {"type": "video"}
    if kind in ("audio", "input_audio", "audio_url"):
        raise InputError(f"{where}: content type {quote(kind)} is not supported (images, videos and text only)")
    raise InputError(f"{where}: unknown content type {quote(kind)} (expected 'text', 'image', 'image_url', 'video' or "
                     "'video_url')")


def item_source(item: Mapping[str, Any], keys: tuple[str, ...]) -> Any:
    """The source of a media item: the first of `keys` that is set; an OpenAI {"url": ...} gives its url."""
    source = next((item[k] for k in keys if item.get(k) is not None), None)
    return source.get("url") if isinstance(source, Mapping) else source


def _required_source(item: Mapping[str, Any], kind: str, where: str) -> Any:
    source = item_source(item, IMAGE_SOURCE_KEYS if kind == "image" else VIDEO_SOURCE_KEYS)
    if source is None or (isinstance(source, str) and not source.strip()):
        raise InputError(f"{where}: {kind} item has no {kind} (expected '{kind}' or '{kind}_url': {{'url': ...}})")
    return source


def _image_ref(item: Mapping[str, Any], where: str) -> ImageRef:
    ref = ImageRef(source=_required_source(item, "image", where))
    for key in _SIZE_KEYS:
        if item.get(key) is not None:
            setattr(ref, key, _positive_int(item[key], f"{where}: {key}"))
    return ref


def _pil_image_ref(item: Mapping[str, Any], where: str) -> ImageRef:
    from PIL import Image

    if not isinstance(item.get("image_pil"), Image.Image):
        raise InputError(f"{where}: an image_pil item needs a PIL.Image under 'image_pil', got "
                         f"{type(item.get('image_pil')).__name__}")
    return _image_ref({**item, "image": item["image_pil"]}, where)


def _video_ref(item: Mapping[str, Any], where: str) -> VideoRef:
    ref = VideoRef(source=_required_source(item, "video", where))
    for key in _VIDEO_INT_KEYS:
        if item.get(key) is not None:
            ref.options[key] = _positive_int(item[key], f"{where}: {key}")
    for key in _VIDEO_SECONDS_KEYS:
        if item.get(key) is not None:
            ref.options[key] = _non_negative_number(item[key], f"{where}: {key}", positive=key == "fps")
    return ref


def _non_negative_number(value: Any, what: str, positive: bool) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value or value in (float("inf"),):
        raise InputError(f"{what} must be a number, got {quote(value)}")
    if value < 0 or (positive and value == 0):
        raise InputError(f"{what} must be {'positive' if positive else 'non-negative'}, got {quote(value)}")
    return float(value)


def _positive_int(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InputError(f"{what} must be a positive integer, got {quote(value)}")
    if isinstance(value, float) and not value.is_integer():
        raise InputError(f"{what} must be a positive integer, got {quote(value)}")
    if value <= 0:
        raise InputError(f"{what} must be a positive integer, got {quote(value)}")
    return int(value)


_SURROGATE = re.compile("[\ud800-\udfff]")


def check_unicode(text: str, where: str) -> None:
    """InputError for a lone surrogate (e.g. a JSON "\\ud800" escape): not text a tokenizer can encode."""
    found = _SURROGATE.search(text)
    if found is not None:
        raise InputError(f"{where}: text has a lone surrogate U+{ord(found.group()):04X} at character "
                         f"{found.start()} (not valid Unicode)")


def _check_text(text: str, forbidden: tuple[str, ...], where: str) -> None:
    check_unicode(text, where)
    for token in forbidden:
        if token in text:
            raise InputError(f"{where}: text may not contain the reserved token {token!r}")
