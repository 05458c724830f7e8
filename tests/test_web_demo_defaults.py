"""The web demo as a newcomer meets it: a refused upload is answered in the conversation naming the user's
file (and that turn is not sent again), Stop shows only while an answer streams, the sliders start from the
checkpoint's generation config, and the bundled shapes model is named for what it is."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("gradio")

from vlmrun.default_model import MODEL_DIR_NAME  # noqa: E402
from vlmrun.processors.image_io import describe_source  # noqa: E402
from vlmrun.web.app import FALLBACK_SAMPLING, build_demo  # noqa: E402
from vlmrun.web.client import ChatClient, ServerError  # noqa: E402
from vlmrun.web.conversation import Turn, explain_error, media_part, to_chatbot, to_openai  # noqa: E402


class RefusingClient(ChatClient):
    """A server that refuses the last image it is sent, naming it as vlmrun's processors do."""

    def __init__(self) -> None:
        super().__init__("http://127.0.0.1:9")
        self.sent: list[list[dict[str, Any]]] = []

    async def stream_chat(self, model: str, messages: list[dict[str, Any]], params: dict[str, Any]):
        self.sent.append(messages)
        images = [p["image_url"]["url"] for m in messages if isinstance(m["content"], list)
                  for p in m["content"] if p["type"] == "image_url"]
        raise ServerError(f"HTTP 400: image {len(images)} ({describe_source(images[-1])}): data URI is not a "
                          f"recognised image (looks like text)")
        yield  # an async generator


def _components(demo: Any) -> dict[str, Any]:
    return {c.elem_id: c for c in demo.blocks.values() if getattr(c, "elem_id", None)}


def _respond(demo: Any) -> Any:
    return next(f.fn for f in demo.fns.values() if getattr(f.fn, "__name__", "") == "respond")


def test_a_refused_upload_is_answered_in_the_conversation_naming_the_file(tmp_path: Path) -> None:
    bad = tmp_path / "holiday.png"
    bad.write_bytes(b"not a picture")
    client = RefusingClient()
    demo = build_demo(client, model="some-model")
    respond = _respond(demo)

    async def run() -> list[tuple]:
        args = ({"text": "what is this?", "files": [str(bad)]}, [], "", 0.0, 1.0, 0, 16, 1.0, -1)
        return [update async for update in respond(*args)]

    updates = asyncio.run(run())
    chat, turns, box, status, stop = updates[-1]
    answer = chat[-1]["content"]
    assert "'holiday.png'" in answer and "image 1" not in answer and "data URI" not in answer
    assert "HTTP 400" not in answer and "not a recognised image" in answer
    assert turns[-1].error and "error" in status
    assert box.value["files"] == []  # the bad file left the input box; the question stays
    assert stop.visible is False and updates[0][-1].visible is True  # Stop only while generating
    # the failed turn is shown but never sent again
    assert to_openai(turns + [Turn("next question")]) == [
        {"role": "user", "content": [{"type": "text", "text": "next question"}]}]


def test_errors_number_images_as_they_were_sent(tmp_path: Path) -> None:
    paths = []
    for name in ("a.png", "b.png", "c.png"):
        (tmp_path / name).write_bytes(b"x")
        paths.append(str(tmp_path / name))
    turns = [Turn("one", [paths[0]], error="not answered: ..."), Turn("two", [paths[1]], answer="ok"),
             Turn("three", [paths[2]])]
    ref = describe_source(media_part(paths[2])["image_url"]["url"])
    assert explain_error(f"image 2 ({ref}): too big", turns) == ("'c.png': too big", {paths[2]})
    shown = to_chatbot(turns)
    assert shown[2] == {"role": "assistant", "content": "⚠️ not answered: ..."}


def test_stop_is_hidden_until_an_answer_streams() -> None:
    demo = build_demo(ChatClient("http://127.0.0.1:9"), model="some-model")
    assert _components(demo)["stop"].visible is False


def test_the_sliders_start_from_the_generation_config() -> None:
    defaults = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "max_tokens": 4096, "repetition_penalty": 1.0}
    parts = _components(build_demo(ChatClient("http://127.0.0.1:9"), model="m", sampling_defaults=defaults))
    assert parts["temperature"].value == 0.6 and parts["top-p"].value == 0.95 and parts["top-k"].value == 20
    assert parts["max-tokens"].value == 4096 and parts["repetition-penalty"].value == 1.0
    plain = _components(build_demo(ChatClient("http://127.0.0.1:9"), model="m", sampling_defaults={"top_k": 5}))
    assert plain["top-k"].value == 5 and plain["temperature"].value == FALLBACK_SAMPLING["temperature"]


def test_a_greedy_checkpoint_starts_the_temperature_at_zero(tmp_path: Path) -> None:
    from vlmrun.default_model import default_model_path
    from vlmrun.web.app import checkpoint_sampling_defaults

    assert checkpoint_sampling_defaults(default_model_path(), {})["temperature"] == 0.0  # do_sample: false
    (tmp_path / "generation_config.json").write_text('{"do_sample": false, "temperature": 0.6}')
    assert checkpoint_sampling_defaults(tmp_path, {"temperature": 0.6, "top_k": 20}) == {"temperature": 0.6, "top_k": 20}
    (tmp_path / "generation_config.json").write_text('{"do_sample": true}')
    assert checkpoint_sampling_defaults(tmp_path, {}) == {}


def test_the_page_says_when_it_runs_the_bundled_shapes_model() -> None:
    shapes = _components(build_demo(ChatClient("http://127.0.0.1:9"), model=MODEL_DIR_NAME))
    assert "shapes model" in shapes["model-note"].value and "--model" in shapes["model-note"].value
    assert "model-note" not in _components(build_demo(ChatClient("http://127.0.0.1:9"), model="Qwen/Qwen3-VL-2B"))
