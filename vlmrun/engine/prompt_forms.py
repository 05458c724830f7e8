"""The prompt forms `LLM.generate` and `Engine.process` take, told apart and checked before any work.

vLLM's forms:
  "text"                                          the raw prompt, tokenized as is (no chat template)
  {"prompt": str, "multi_modal_data": {...}}      raw text holding one placeholder per image / video
  {"prompt_token_ids": [...], "multi_modal_data": {...}}   the same as token ids
  (either may carry "mm_processor_kwargs" and "cache_salt", a non-empty string: the prompt's
  prefix-cache entries serve only prompts of the same salt; multi_modal_data: {"image": one or a list, "video": ...};
  a video may be vLLM's `(frames, metadata)` tuple: frames sampled already, timestamps from the metadata)
vlmrun's own:
  {"prompt": str, "images": [...], "videos": [...]}   one user turn through the chat template
  [{"role": ..., "content": ...}, ...]                 a chat (the chat template)

A dict with a key no form has, or with keys of two forms, is a `PromptFormError` naming the key.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Union

from vlmrun.processors import ProcessedPrompt
from vlmrun.processors.video_processor import is_frames_with_metadata

_RAW_KEYS = ("prompt", "prompt_token_ids", "multi_modal_data", "mm_processor_kwargs", "cache_salt")
_USER_TURN_KEYS = ("prompt", "images", "videos")
_MODALITIES = ("image", "video")


class PromptFormError(ValueError):
    """A prompt in none of the accepted forms (a mistake in the calling code, not in one input)."""


@dataclass
class RawPrompt:
    """vLLM's text or tokens prompt: `text` or `token_ids` (one of them), media in placeholder order."""

    text: Optional[str] = None
    token_ids: Optional[list[int]] = None
    images: list[Any] = field(default_factory=list)
    videos: list[Any] = field(default_factory=list)
    mm_processor_kwargs: Optional[dict[str, Any]] = None
    cache_salt: Optional[str] = None  # vLLM's prefix-cache salt (`ProcessedPrompt.cache_salt`)


@dataclass
class UserTurnPrompt:
    """vlmrun's {"prompt", "images", "videos"}: one user turn, images then videos then the text."""

    text: str
    images: list[Any] = field(default_factory=list)
    videos: list[Any] = field(default_factory=list)


ParsedPrompt = Union[RawPrompt, UserTurnPrompt, list, ProcessedPrompt]


def parse_prompt(prompt: Any) -> ParsedPrompt:
    """Which form `prompt` is, checked (PromptFormError); a parsed prompt is returned as is."""
    if isinstance(prompt, (RawPrompt, UserTurnPrompt, ProcessedPrompt, list)):
        return prompt
    if isinstance(prompt, str):
        return RawPrompt(text=prompt)
    if not isinstance(prompt, Mapping):
        raise PromptFormError(f"a prompt is a string, a dict with 'prompt' or 'prompt_token_ids', or a chat "
                              f"(a list of messages); got {type(prompt).__name__}")
    if "images" in prompt or "videos" in prompt:
        return _user_turn(prompt)
    return _raw(prompt)


def with_processor_kwargs(parsed: ParsedPrompt, kwargs: Optional[Mapping[str, Any]]) -> ParsedPrompt:
    """`parsed` with a call's `mm_processor_kwargs` (`LLM.generate(mm_processor_kwargs=...)`) under its own: a
    raw prompt gets a copy whose options are the call's, overridden by the prompt's own (an item's own sizing
    still wins, `processors/processor_kwargs.py`); other forms are returned as they are (the caller passes the
    call's options to the processor for a user turn or a chat)."""
    if not kwargs or not isinstance(parsed, RawPrompt):
        return parsed
    return dataclasses.replace(parsed, mm_processor_kwargs={**kwargs, **(parsed.mm_processor_kwargs or {})})


def media_list(items: Any) -> list[Any]:
    """One item (a path, URL, bytes, PIL image, array, item dict, vLLM's video `(frames, metadata)`) -> [it];
    None -> []; a list or tuple as is (so a video given as a list of frames must be wrapped: [{"video": frames}])."""
    if items is None:
        return []
    if is_frames_with_metadata(items):
        return [items]
    if isinstance(items, (list, tuple)):
        return list(items)
    return [items]


def _user_turn(prompt: Mapping[str, Any]) -> UserTurnPrompt:
    _refuse_other_keys(prompt, _USER_TURN_KEYS, "with 'images' / 'videos' (vlmrun's templated user turn)")
    if "prompt" not in prompt:
        raise PromptFormError("a prompt dict with 'images' / 'videos' needs a 'prompt' key (the user's text)")
    return UserTurnPrompt(text=prompt["prompt"], images=media_list(prompt.get("images")),
                          videos=media_list(prompt.get("videos")))


def _raw(prompt: Mapping[str, Any]) -> RawPrompt:
    _refuse_other_keys(prompt, _RAW_KEYS, "(vLLM's text or tokens prompt)")
    if "prompt_token_ids" in prompt:  # vLLM: the ids win over a 'prompt' given beside them
        ids = prompt["prompt_token_ids"]
        if isinstance(ids, (str, bytes)) or not isinstance(ids, (list, tuple)):
            raise PromptFormError(f"prompt_token_ids must be a list of ints, got {type(ids).__name__}")
        raw = RawPrompt(token_ids=list(ids))
    elif "prompt" in prompt:
        if not isinstance(prompt["prompt"], str):
            raise PromptFormError(f"'prompt' must be a string, got {type(prompt['prompt']).__name__}")
        raw = RawPrompt(text=prompt["prompt"])
    else:
        raise PromptFormError("a prompt dict needs a 'prompt' (text) or 'prompt_token_ids' key")
    data = prompt.get("multi_modal_data") or {}
    if not isinstance(data, Mapping):
        raise PromptFormError(f"multi_modal_data must be a dict such as {{'image': [...]}}, got {type(data).__name__}")
    unknown = [key for key in data if key not in _MODALITIES]
    if unknown:
        raise PromptFormError(f"multi_modal_data: unsupported modality {unknown[0]!r} (this engine takes "
                              f"'image' and 'video')")
    raw.images, raw.videos = media_list(data.get("image")), media_list(data.get("video"))
    raw.mm_processor_kwargs = prompt.get("mm_processor_kwargs")
    raw.cache_salt = check_cache_salt(prompt.get("cache_salt"))
    return raw


def check_cache_salt(salt: Any) -> Optional[str]:
    """A prompt's `cache_salt`: None, or a non-empty string (vLLM's rule); else a PromptFormError."""
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise PromptFormError(f"'cache_salt' must be a non-empty string if given, got {salt!r:.40}")
    return salt


def _refuse_other_keys(prompt: Mapping[str, Any], allowed: tuple[str, ...], form: str) -> None:
    unknown = [key for key in prompt if key not in allowed]
    if unknown:
        raise PromptFormError(f"prompt key {unknown[0]!r} does not belong in a prompt dict {form}; "
                              f"its keys are {', '.join(allowed)}")
