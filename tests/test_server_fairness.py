"""Preprocessing is bounded per request and never stalls other clients (issue 29).

Image preprocessing is slowed on purpose (a sleep per image) so that the test does not depend on
the machine's speed: a text request is answered while every media worker is busy with another
client's images; a client that leaves while its images are being prepared stops that work at the
next image. bench/bench_server_fairness.py measures the same on real JPEGs.
"""

from __future__ import annotations

import threading
import time
from typing import Iterator

import httpx
import pytest

from tests.server_fixtures import served_fixtures
from tests.test_server import data_uri, picture, png_bytes
from vlmrun.server.launch import ServerThread, serve_in_thread
from vlmrun.server.settings import ServerSettings

MODEL = "tiny"
SLOW_S = 0.4  # seconds each image takes to prepare here


engine = served_fixtures(max_model_len=512)[0]


@pytest.fixture()
def slow_server(engine, monkeypatch) -> Iterator[tuple[ServerThread, list[float]]]:
    srv = serve_in_thread(engine, ServerSettings(served_model_name=MODEL, preprocess_workers=2))
    processor = srv.app.state.vlmrun.processor
    real = processor.image_processor.preprocess
    prepared: list[float] = []

    def slow(*args, **kwargs):
        time.sleep(SLOW_S)
        prepared.append(time.monotonic())
        return real(*args, **kwargs)

    monkeypatch.setattr(processor.image_processor, "preprocess", slow)
    yield srv, prepared
    srv.stop()


def image_request(n: int) -> dict:
    parts = [{"type": "image_url", "image_url": {"url": data_uri(png_bytes(picture(32, 32, seed=k)))}} for k in range(n)]
    return {"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": [
        *parts, {"type": "text", "text": "Describe."}]}]}


TEXT = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]}


def test_a_text_request_does_not_wait_for_other_clients_images(slow_server):
    srv, prepared = slow_server
    with httpx.Client(base_url=srv.base_url, timeout=60) as client:
        start = time.perf_counter()
        assert client.post("/v1/chat/completions", json=TEXT).status_code == 200
        idle = time.perf_counter() - start
    heavy = [threading.Thread(target=lambda: httpx.post(srv.base_url + "/v1/chat/completions", json=image_request(8),
                                                        timeout=60), daemon=True) for _ in range(3)]
    for t in heavy:  # 3 clients x 8 images x 0.4 s on 2 media workers: ~5 s of queued image work
        t.start()
    time.sleep(0.5)
    with httpx.Client(base_url=srv.base_url, timeout=60) as client:
        start = time.perf_counter()
        assert client.post("/v1/chat/completions", json=TEXT).status_code == 200
        loaded = time.perf_counter() - start
    for t in heavy:
        t.join(timeout=60)
    assert len(prepared) == 24
    assert loaded < max(1.0, 5 * idle), (idle, loaded)  # not behind the ~5 s of image work


def test_a_client_that_leaves_stops_its_preparation(slow_server):
    srv, prepared = slow_server
    with pytest.raises(httpx.TimeoutException):
        httpx.post(srv.base_url + "/v1/chat/completions", json=image_request(20), timeout=1.0)
    time.sleep(3 * SLOW_S)
    done = len(prepared)
    assert done < 8, done  # 20 images would take 8 s; the work stopped at the image after the client left
    time.sleep(3 * SLOW_S)
    assert len(prepared) == done
    with httpx.Client(base_url=srv.base_url, timeout=60) as client:
        assert client.post("/v1/chat/completions", json=TEXT).status_code == 200
    assert srv.app.state.vlmrun.admission.in_flight == 0


def test_images_a_prompt_cannot_hold_are_refused_before_any_is_decoded(qwen3_vl_dir, monkeypatch):
    """Each image's token count comes from its header and options; a request whose images alone need
    more tokens than the context allows fails before one pixel is decoded (no 70 s of work for a 400)."""
    from vlmrun.processors.image_io import OpenedImage
    from tests.test_server import picture
    from vlmrun import LLM, SamplingParams

    decoded = []
    real = OpenedImage.decode
    monkeypatch.setattr(OpenedImage, "decode", lambda self: decoded.append(self.what) or real(self))
    llm = LLM(str(qwen3_vl_dir), dtype="float32", device="cpu", max_model_len=128)
    big = [picture(400, 300, seed=k) for k in range(3)]  # 54 tokens each at the tiny processor's cap: 162 > 127
    out = llm.generate([{"prompt": "Describe.", "images": big}], SamplingParams(max_tokens=2), use_tqdm=False)[0]
    assert "need 162 tokens, more than a prompt may have (127); refused before any was decoded" in out.error
    assert decoded == []
    out = llm.generate([{"prompt": "Describe.", "images": big[:1]}], SamplingParams(max_tokens=2), use_tqdm=False)[0]
    assert out.error is None and len(decoded) == 1
    out = llm.generate([{"prompt": "Hi", "images": [{"image": big[0], "min_pixels": 10**9, "max_pixels": 10**10}]}],
                       SamplingParams(max_tokens=2), use_tqdm=False)[0]
    assert "its options resize it to 36544x27392 = 1,001,013,248 pixels, more than the limit" in out.error
    assert len(decoded) == 1
