"""The demo's conversation: a list of turns, rendered for the Chatbot and for the server.

A `Turn` is one user message (text and any number of image or video files) and the answer so far, or
the error that ended it: a failed turn stays in the conversation, its error shown as the answer and
naming the user's file (`explain_error`), and is not sent to the server again.
The Chatbot shows the media from their files; the server receives them as base64 data URIs (images
as `image_url` items, videos as `video_url` items), so the demo works against any OpenAI-compatible
server, local or not, without sharing a filesystem.
"""

from __future__ import annotations

import base64
import mimetypes
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class Turn:
    text: str
    images: list[str] = field(default_factory=list)  # file paths (images and videos)
    answer: str = ""
    error: str = ""  # why the server could not answer (shown in the conversation; the turn is not sent again)


def image_data_uri(path: str) -> str:
    media_type = mimetypes.guess_type(path)[0] or "image/png"
    if not media_type.startswith("image/"):
        media_type = "application/octet-stream"
    data = base64.b64encode(Path(path).read_bytes()).decode("ascii")
    return f"data:{media_type};base64,{data}"


def is_video_file(path: str) -> bool:
    return (mimetypes.guess_type(path)[0] or "").startswith("video/")


def video_data_uri(path: str) -> str:
    media_type = mimetypes.guess_type(path)[0] or "video/mp4"
    return f"data:{media_type};base64,{base64.b64encode(Path(path).read_bytes()).decode('ascii')}"


def media_part(path: str) -> dict[str, Any]:
    """The OpenAI content item for one uploaded file."""
    if is_video_file(path):
        return {"type": "video_url", "video_url": {"url": video_data_uri(path)}}
    return {"type": "image_url", "image_url": {"url": image_data_uri(path)}}


def to_openai(turns: list[Turn], system_prompt: str = "") -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    if system_prompt.strip():
        messages.append({"role": "system", "content": system_prompt.strip()})
    turns = sent_turns(turns)
    for i, turn in enumerate(turns):
        content: list[dict[str, Any]] = [media_part(p) for p in turn.images]
        content.append({"type": "text", "text": turn.text})
        messages.append({"role": "user", "content": content})
        if i < len(turns) - 1:  # the last turn is the one being answered
            messages.append({"role": "assistant", "content": turn.answer})
    return messages


def sent_turns(turns: list[Turn]) -> list[Turn]:
    """The turns the server sees: all but the failed ones."""
    return [t for t in turns if not t.error]


def to_chatbot(turns: list[Turn]) -> list[dict[str, Any]]:
    """Chatbot messages: each image as its own file message, then the text, then the answer (or the error)."""
    shown: list[dict[str, Any]] = []
    for turn in turns:
        for path in turn.images:
            shown.append({"role": "user", "content": {"path": path}})
        if turn.text:
            shown.append({"role": "user", "content": turn.text})
        shown.append({"role": "assistant", "content": f"⚠️ {turn.error}" if turn.error else turn.answer})
    return shown


def user_turn(message: Any) -> Turn:
    """A Turn from the MultimodalTextbox value {"text": str, "files": [path | {"path": ...}]}."""
    message = message or {}
    files = []
    for f in message.get("files") or []:
        files.append(_file_path(f))
    return Turn(text=(message.get("text") or "").strip(), images=files)


# how the server's processors name a data-URI upload in an error (`vlmrun.processors.image_io.describe_source`)
_MEDIA_REF = re.compile(r"\b(image|video) (\d+) \(data URI \(\d+ chars\)\)")


def explain_error(error: str, turns: list[Turn]) -> tuple[str, set[str]]:
    """The server's error with each "image N (data URI (...))" / "video N (...)" replaced by the name of
    the file the user uploaded (and "data URI" by "file": the user sent a file), and the paths of the
    files it names. The server numbers images and videos apart, in the order `to_openai` sends them."""
    sent = sent_turns(turns)
    files = {"image": [p for t in sent for p in t.images if not is_video_file(p)],
             "video": [p for t in sent for p in t.images if is_video_file(p)]}
    named: set[str] = set()

    def name(match: re.Match) -> str:
        kind, number = match.group(1), int(match.group(2))
        if not 1 <= number <= len(files[kind]):
            return match.group(0)
        path = files[kind][number - 1]
        named.add(path)
        return repr(Path(path).name)

    text = _MEDIA_REF.sub(name, error)
    if named:
        text = re.sub(r"\bdata URI\b", "the file", text)
    return text, named


def without_files(message: Any, paths: set[str]) -> dict[str, Any]:
    """The MultimodalTextbox value `message` less the uploads at `paths` (a bad file's thumbnail goes)."""
    message = message or {}
    keep = [f for f in message.get("files") or [] if _file_path(f) not in paths]
    return {"text": message.get("text") or "", "files": keep}


def _file_path(file: Any) -> str:
    """An upload of the MultimodalTextbox value: a path, or {"path": ...}."""
    return file["path"] if isinstance(file, dict) else str(file)
