"""What `Processor.from_pretrained` reads from a checkpoint directory besides the tokenizer and the
image / video processor configs: the chat template, the architectures (which pick the family), and the
processor class that
decides how videos are written into the prompt (`video_prompt_style`); and a chat template given
instead of the checkpoint's (`load_chat_template`: a file path or the template itself, as vLLM's
`--chat-template` takes it).
"""

from __future__ import annotations

import json
import os
from typing import Any

from transformers import PreTrainedTokenizerBase

from vlmrun.processors.video_config import read_json


def architectures(path: str) -> list[str]:
    """`architectures` of the checkpoint's config.json (empty when absent): what picks its family
    (`vlmrun.families`)."""
    names = _json_field(path, "config.json", "architectures")
    return [str(n) for n in names] if isinstance(names, list) else []


def video_prompt_style(path: str, family_style: str) -> str:
    """How the checkpoint's processor class writes videos into the prompt: "qwen3" (`Qwen3VLProcessor`:
    timestamped groups) or "qwen2" (`Qwen2VLProcessor`, `Qwen2_5_VLProcessor`: one run of pads).

    The class is found where `AutoProcessor` looks: `processor_config.json`, `preprocessor_config.json`
    (`video_preprocessor_config.json` only without it), `tokenizer_config.json`, `config.json`; else the
    checkpoint's family decides (`family_style`: `vlmrun.families.ProcessorStyle.prompt`)."""
    has_image_config = os.path.isfile(os.path.join(path, "preprocessor_config.json"))
    files = ("processor_config.json", "preprocessor_config.json" if has_image_config else
             "video_preprocessor_config.json", "tokenizer_config.json", "config.json")
    for name in files:
        named = _json_field(path, name, "processor_class")
        if named is not None:
            if str(named).startswith("Qwen3VL"):
                return "qwen3"
            if str(named).startswith(("Qwen2VL", "Qwen2_5_VL")):
                return "qwen2"
            break
    return family_style


def _json_field(path: str, name: str, key: str) -> Any:
    """`key` of the JSON object in file `name` of the checkpoint, None when either is missing."""
    data = read_json(os.path.join(path, name))
    return data.get(key) if isinstance(data, dict) else None


_JINJA_CHARS = "{}\n"  # a template string has at least one of these; a file path has none


def load_chat_template(value: str) -> str:
    """A chat template given by the user: the text of the file `value` names, else `value` itself when it
    reads as a Jinja template (escapes such as `\\n` typed on a command line become the characters).
    FileNotFoundError for a value that reads as a path but names no readable file."""
    try:
        with open(value, encoding="utf-8") as fh:
            return fh.read()
    except (OSError, ValueError) as exc:  # ValueError: a NUL character, never in a path
        if not any(c in value for c in _JINJA_CHARS):
            raise FileNotFoundError(f"the chat template {value!r} reads as a file path, but it cannot be "
                                    f"opened: {getattr(exc, 'strerror', None) or exc}") from None
    if "\\" in value and value.isascii():
        return value.encode("ascii").decode("unicode_escape")
    return value


def read_chat_template(path: str, tokenizer: PreTrainedTokenizerBase) -> str | None:
    """`chat_template.jinja`, else `chat_template.json`, else the tokenizer config's (its default if named)."""
    jinja = os.path.join(path, "chat_template.jinja")
    if os.path.isfile(jinja):
        with open(jinja, encoding="utf-8") as fh:
            return fh.read()
    js = os.path.join(path, "chat_template.json")
    if os.path.isfile(js):
        with open(js, encoding="utf-8") as fh:
            template = json.load(fh).get("chat_template")
        if isinstance(template, str) and template:
            return template
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # named templates: use the default one
        template = template.get("default")
    elif isinstance(template, list):  # the serialized list-of-{name, template} form
        template = next((t.get("template") for t in template if t.get("name") == "default"), None)
    return template if isinstance(template, str) and template else None
