"""vLLM's `mm_processor_kwargs`: per-call image / video processor options, applied to every media
item of one prompt that does not set the option itself.

Qwen-VL's processors take `min_pixels` and `max_pixels` (images and videos), `fps` and
`do_sample_frames` (videos: False takes the frames as they are, as vLLM's Qwen3-VL examples pass with
`(frames, metadata)` videos); any other key is an InputError naming it, never ignored.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from vlmrun.processors.chat import ImageRef, MediaRef
from vlmrun.processors.limits import InputError, quote

PROCESSOR_KWARGS = ("min_pixels", "max_pixels", "fps", "do_sample_frames")


def apply_processor_kwargs(refs: Sequence[MediaRef], kwargs: Mapping[str, Any] | None) -> None:
    """Set each of `kwargs` on every ref of `refs` that has no value of its own for it (in place)."""
    if not kwargs:
        return
    options = check_processor_kwargs(kwargs)
    for ref in refs:
        if isinstance(ref, ImageRef):
            for key in ("min_pixels", "max_pixels"):
                if key in options and getattr(ref, key) is None:
                    setattr(ref, key, int(options[key]))
        else:
            for key, value in options.items():
                ref.options.setdefault(key, value)


def check_processor_kwargs(kwargs: Mapping[str, Any]) -> dict[str, float | int | bool]:
    """The options, validated: positive integers for the pixel bounds, a positive number for fps, a bool
    for do_sample_frames."""
    if not isinstance(kwargs, Mapping):
        raise InputError(f"mm_processor_kwargs must be a dict such as {{'max_pixels': 200000}}, got {quote(kwargs)}")
    unknown = [key for key in kwargs if key not in PROCESSOR_KWARGS]
    if unknown:
        raise InputError(f"mm_processor_kwargs: unsupported option {quote(unknown[0])} "
                         f"(this engine takes {', '.join(PROCESSOR_KWARGS)})")
    options: dict[str, float | int | bool] = {}
    for key, value in kwargs.items():
        if key == "do_sample_frames":
            if not isinstance(value, bool):
                raise InputError(f"mm_processor_kwargs['do_sample_frames'] must be true or false, got {quote(value)}")
            options[key] = value
            continue
        integer = key != "fps"
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 \
                or (integer and isinstance(value, float) and not value.is_integer()) or value == float("inf"):
            kind = "a positive integer" if integer else "a positive number"
            raise InputError(f"mm_processor_kwargs[{key!r}] must be {kind}, got {quote(value)}")
        options[key] = int(value) if integer else float(value)
    return options
