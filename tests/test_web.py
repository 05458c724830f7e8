"""The Gradio demo in a real browser: headless Chromium (Debian's /usr/bin/chromium, driven by
Playwright; no browser download) against a live vlmrun server with the tiny Qwen3-VL checkpoint.

Upload an image and ask; the answer streams in and the status shows the model and tokens/s. A
second turn (from an example image) carries the first one along; Stop aborts a long answer on
the server. A generated video clip, uploaded after clearing the chat, goes to the server as a
`video_url` and its answer streams back. The page is saved as a screenshot under tests/artifacts/.
"""

from __future__ import annotations

import os
import shutil
import socket
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

from tests.test_server import tiny_engine, wait_until_idle
from vlmrun.server.launch import serve_in_thread
from vlmrun.server.settings import ServerSettings

CHROMIUM = os.environ.get("VLMRUN_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]
ARTIFACTS = Path(__file__).resolve().parent / "artifacts"
ASSETS = Path(__file__).resolve().parent.parent / "assets" / "images"
MODEL = "tiny-qwen3-vl"

pytestmark = pytest.mark.skipif(not (os.path.exists(CHROMIUM) or shutil.which("chromium")),
                                reason="needs Debian's chromium (apt-get install chromium; `make test` installs it)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def backend(qwen3_vl_dir) -> Iterator[tuple[Any, Any]]:
    engine = tiny_engine(qwen3_vl_dir, max_model_len=4096)
    server = serve_in_thread(engine, ServerSettings(served_model_name=MODEL))
    yield engine, server
    server.stop()
    engine.shutdown()


@pytest.fixture(scope="module")
def demo_url(backend) -> Iterator[tuple[str, list]]:
    from vlmrun.web.app import build_demo, theme
    from vlmrun.web.client import ChatClient

    sent: list = []

    class RecordingClient(ChatClient):
        def stream_chat(self, model, messages, params):
            sent.append((messages, params))
            return super().stream_chat(model, messages, params)

    demo = build_demo(RecordingClient(backend[1].base_url))
    port = free_port()
    demo.queue()
    demo.launch(server_name="127.0.0.1", server_port=port, prevent_thread_lock=True, quiet=True, theme=theme(),
                ssr_mode=False, allowed_paths=[str(ASSETS)], share=False)
    yield f"http://127.0.0.1:{port}/", sent
    demo.close()


@pytest.fixture(scope="module")
def page(demo_url) -> Iterator[Any]:
    from playwright.sync_api import sync_playwright

    executable = CHROMIUM if os.path.exists(CHROMIUM) else shutil.which("chromium")
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=executable, args=CHROMIUM_ARGS, headless=True)
        pg = browser.new_page(viewport={"width": 1280, "height": 1100})
        pg.set_default_timeout(60_000)
        pg.goto(demo_url[0], wait_until="domcontentloaded")
        pg.wait_for_selector("#prompt textarea")
        yield pg
        browser.close()


def status_text(page) -> str:
    return page.locator("#status").inner_text()


def send(page, text: str) -> None:
    box = page.locator("#prompt textarea")
    box.fill(text)
    box.press("Enter")


def wait_for_answer(page, answer: int, tokens: int) -> str:
    """Wait until the status line reports answer number `answer` complete with `tokens` tokens."""
    page.wait_for_function(
        "([k, n]) => { const s = document.querySelector('#status').innerText; "
        "return s.includes('answer ' + k + ': ' + n + ' tokens in') && s.includes('tokens/s'); }",
        arg=[answer, tokens])
    return status_text(page)


def set_max_tokens(page, n: int) -> None:
    box = page.locator("#max-tokens input[type=number]")
    box.fill(str(n))
    box.press("Tab")


def test_upload_ask_stream_multiturn_and_stop(page, demo_url, backend):
    engine, _ = backend
    sent = demo_url[1]
    assert MODEL in page.locator("body").inner_text()
    set_max_tokens(page, 24)

    # 1. upload an image and ask: the answer streams in, the status shows model and speed
    page.locator("#prompt input[type=file]").set_input_files(str(ASSETS / "chelsea_451x300.jpg"))
    page.wait_for_selector("#prompt img")
    send(page, "What is in the picture?")
    status = wait_for_answer(page, 1, 24)
    assert MODEL in status and "tokens/s" in status
    bot = page.locator("#chat .message.bot")
    assert bot.count() >= 1 and bot.last.inner_text().strip()
    assert page.locator("#chat img").count() >= 1
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "web_demo.png"), full_page=True)
    assert len(sent) == 1
    messages, params = sent[-1]
    assert params["max_tokens"] == 24
    assert messages[-1]["content"][0]["image_url"]["url"].startswith("data:image/jpeg;base64,")

    # 2. a second turn from an example image: the first turn goes along
    page.locator("text=Describe this image.").first.click()
    page.wait_for_timeout(300)
    page.locator("#prompt textarea").press("Enter")
    wait_for_answer(page, 2, 24)
    assert len(sent) == 2
    messages, _ = sent[-1]
    assert [m["role"] for m in messages] == ["user", "assistant", "user"]
    assert messages[1]["content"]  # the first answer, as the client saw it streamed
    assert messages[2]["content"][0]["image_url"]["url"].startswith("data:image/")
    page.screenshot(path=str(ARTIFACTS / "web_demo_second_turn.png"), full_page=True)

    # 3. a long answer, stopped half way: the server aborts it and frees its memory
    wait_until_idle(engine)
    set_max_tokens(page, 2000)
    steps_before = engine.stats.num_steps
    send(page, "Tell me a very long story.")
    page.wait_for_function("() => document.querySelector('#status').innerText.includes('answer 3: ~')")
    page.locator("#stop").click()
    wait_until_idle(engine, timeout=15)
    assert engine.stats.num_steps - steps_before < 1500
    time.sleep(0.5)
    assert "2000 tokens in" not in status_text(page) and len(sent) == 3
    assert (ARTIFACTS / "web_demo.png").stat().st_size > 10_000


def test_upload_a_video_clip(page, demo_url, backend, tmp_path):
    """A generated clip goes up as a video_url data URI; the answer streams back."""
    pytest.importorskip("torchcodec")
    from vlmrun.processors.video_io import video_decoder
    from testing.videos import write_video

    if video_decoder() != "torchcodec":
        pytest.skip("needs torchcodec with the system FFmpeg libraries")
    engine, _ = backend
    sent = demo_url[1]
    wait_until_idle(engine)
    page.locator("#clear").click()
    set_max_tokens(page, 24)  # sampled (temperature 0.7): 24 tokens of the tiny model are never all blank
    clip = write_video(tmp_path / "clip.mp4", 8, 48, 64, 4.0)
    page.locator("#prompt input[type=file]").set_input_files(str(clip))
    page.wait_for_selector("#prompt .thumbnail-item .feather-video")  # the clip's thumbnail
    before = len(sent)
    send(page, "What moves?")
    try:
        page.wait_for_function(
            "() => { const s = document.querySelector('#status').innerText; "
            "return s.includes(' tokens in') && s.includes('tokens/s') && s.includes('answer 1'); }")
    except Exception:
        raise AssertionError(f"status: {status_text(page)!r}") from None
    assert len(sent) == before + 1
    messages, _ = sent[-1]
    assert messages[-1]["content"][0]["video_url"]["url"].startswith("data:video/mp4;base64,")
    page.wait_for_function(  # the chat shows the answer (its last update may land just after the status's)
        "() => { const m = document.querySelectorAll('#chat .message.bot'); "
        "return m.length > 0 && m[m.length - 1].innerText.trim().length > 0; }", timeout=10_000)
    page.screenshot(path=str(ARTIFACTS / "web_demo_video.png"), full_page=True)
