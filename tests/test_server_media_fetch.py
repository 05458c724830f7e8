"""A media URL that never answers holds a fetch thread until its deadline, never a thread that prepares
media (issue 45, "no other client delayed more than 2 s"): the server fetches URLs in its fetch pool
before the request's preparation (`ServerState.resolve_media`), chat completions and /tokenize alike."""

from __future__ import annotations

import socket
import threading
import time
from typing import Iterator

import httpx
import pytest

from tests.server_fixtures import served_fixtures
from tests.test_server import data_uri

MODEL = "tiny"
URL_TIMEOUT_S = 4.0


# one media thread: a fetch that held it would hold every other image request
engine, server = served_fixtures(max_model_len=256, served_model_name=MODEL, settings={
    "preprocess_workers": 1, "allow_private_urls": True, "url_timeout_s": URL_TIMEOUT_S})[:2]


@pytest.fixture()
def silent_url() -> Iterator[str]:
    """An http URL on a local socket that accepts connections and never answers."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(16)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}/picture.png"


def image_chat(url: str) -> dict:
    return {"model": MODEL, "max_tokens": 2, "temperature": 0, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "What is it?"}]}]}


def _png() -> bytes:
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (32, 32), (200, 30, 30)).save(buf, format="PNG")
    return buf.getvalue()


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/tokenize"])
def test_a_url_that_never_answers_holds_up_no_other_image_request(server, silent_url, path):
    stuck: list[httpx.Response] = []

    def send_stuck() -> None:
        with httpx.Client(base_url=server.base_url, timeout=60) as client:
            stuck.append(client.post(path, json=image_chat(silent_url)))

    hanging = [threading.Thread(target=send_stuck) for _ in range(2)]
    for t in hanging:
        t.start()
    time.sleep(0.5)  # the stuck requests are waiting on the silent socket
    with httpx.Client(base_url=server.base_url, timeout=60) as client:
        started = time.monotonic()
        r = client.post(path, json=image_chat(data_uri(_png(), "image/png")))
        took = time.monotonic() - started
    assert r.status_code == 200, r.text
    assert took < URL_TIMEOUT_S - 1.5, f"an image request waited {took:.1f} s behind a fetch that never answers"
    for t in hanging:
        t.join(timeout=30)
    assert [x.status_code for x in stuck] == [400, 400]
    for x in stuck:
        err = x.json()["error"]
        assert err["param"] == "messages" and "timed out" in err["message"], err


def test_images_of_many_pixels_hold_up_no_other_image_request(server, monkeypatch):
    """A request whose images declare more than `bulk_pixels` is prepared in the bulk pool: while one is
    held there, an ordinary image request still finds the (single) media thread free."""
    import io

    from PIL import Image

    state = server.app.state.vlmrun
    monkeypatch.setattr(state, "bulk_pixels", 100 * 100)
    buf = io.BytesIO()
    Image.new("RGB", (400, 400), (20, 200, 30)).save(buf, format="PNG")
    big = data_uri(buf.getvalue(), "image/png")  # 160,000 pixels, past the (lowered) bulk bound
    gate = threading.Event()
    original = state.processor.process_chat

    def held(messages, **kwargs):
        if any(isinstance(part, dict) and part.get("image") == big for m in messages for part in m["content"]):
            gate.wait(30)  # the costly preparation, held until the other request is answered
        return original(messages, **kwargs)

    monkeypatch.setattr(state.processor, "process_chat", held)
    answers: list[httpx.Response] = []

    def send_big() -> None:
        with httpx.Client(base_url=server.base_url, timeout=60) as client:
            answers.append(client.post("/v1/chat/completions", json=image_chat(big)))

    costly = threading.Thread(target=send_big)
    costly.start()
    try:
        time.sleep(0.5)
        with httpx.Client(base_url=server.base_url, timeout=60) as client:
            started = time.monotonic()
            r = client.post("/v1/chat/completions", json=image_chat(data_uri(_png(), "image/png")))
            took = time.monotonic() - started
        assert r.status_code == 200, r.text
        assert took < 5, f"an image request waited {took:.1f} s behind a request of many pixels"
    finally:
        gate.set()
        costly.join(timeout=60)
    assert answers[0].status_code == 200, answers[0].text
