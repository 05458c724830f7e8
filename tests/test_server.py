"""The OpenAI-compatible server, driven by the official `openai` client over 127.0.0.1.

A live uvicorn (in a thread, on a free port) serves the tiny random Qwen3-VL checkpoint. The
outputs are meaningless tokens; what is checked is the protocol: plain and streamed chat, images
as base64 data URIs (one and two per message), logprobs, stop strings, n=2, text completions,
the API key, /v1/models, /health and /metrics.
"""

from __future__ import annotations

import base64
import io

import httpx
import numpy as np
import openai
import pytest
from PIL import Image

from tests.server_fixtures import MODEL, served_fixtures, tiny_engine, wait_until_idle  # noqa: F401 (shared from here too)
from vlmrun.server.launch import serve_in_thread
from vlmrun.server.settings import ServerSettings

# ---------------------------------------------------------------------------- helpers (shared)


def picture(width: int, height: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    ys, xs = np.mgrid[0:height, 0:width]
    rgb = np.stack([xs * 255 // max(width - 1, 1), ys * 255 // max(height - 1, 1),
                    rng.integers(0, 256, size=(height, width))], axis=-1)
    return Image.fromarray(rgb.astype(np.uint8), "RGB")


def png_bytes(image: Image.Image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def data_uri(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


# ---------------------------------------------------------------------------- fixtures


engine, server, client = served_fixtures(settings={"enable_auto_tool_choice": True, "tool_call_parser": "hermes"})


def chat(client: openai.OpenAI, content, **kwargs):
    kwargs = {"temperature": 0, "max_tokens": 8, **kwargs}
    return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}], **kwargs)


# ---------------------------------------------------------------------------- tests


def test_models_health_and_metrics(client, server):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    assert httpx.get(server.base_url + "/health").json() == {"status": "ok"}
    chat(client, "warm up")
    text = httpx.get(server.base_url + "/metrics").text
    for name in ("vlmrun_requests_total", "vlmrun_time_to_first_token_seconds_bucket",
                 "vlmrun_time_per_output_token_seconds_count", "vlmrun_num_requests_waiting",
                 "vlmrun_kv_cache_usage_ratio", "vlmrun_generation_tokens_total", "vlmrun_prompt_tokens_total"):
        assert name in text, name
    assert "vlmrun_gdn_pool" not in text  # no hybrid model: no GDN pool
    long_prompt = "Describe every colour of the sea and the sky at dawn, slowly and in detail. " * 3
    chat(client, long_prompt, max_tokens=2)
    chat(client, long_prompt, max_tokens=2)  # the same prompt again: its full pages hit the prefix cache
    text = httpx.get(server.base_url + "/metrics").text
    hits = [float(line.split()[-1]) for line in text.splitlines()
            if line.startswith("vlmrun_prefix_cache_hit_tokens_total")]
    assert hits and hits[0] > 0, "the second identical prompt must be served from the prefix cache"


def test_plain_and_streamed_chat_agree(client):
    full = chat(client, "Tell me a story.", max_tokens=10)
    choice = full.choices[0]
    assert full.object == "chat.completion" and full.model == MODEL
    assert choice.message.role == "assistant" and choice.finish_reason in ("length", "stop")
    assert full.usage.completion_tokens <= 10 and full.usage.prompt_tokens > 0
    assert full.usage.total_tokens == full.usage.prompt_tokens + full.usage.completion_tokens

    stream = chat(client, "Tell me a story.", max_tokens=10, stream=True, stream_options={"include_usage": True})
    pieces, finish, usage, roles = [], None, None, []
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            roles += [c.delta.role] if c.delta.role else []
            pieces.append(c.delta.content or "")
            finish = c.finish_reason or finish
    assert roles == ["assistant"]
    assert "".join(pieces) == choice.message.content
    assert finish == choice.finish_reason
    assert usage is not None and usage.completion_tokens == full.usage.completion_tokens


def test_base64_image_and_two_images_in_one_message(client):
    one = chat(client, [image_part(data_uri(png_bytes(picture(64, 48, 1)))),
                        {"type": "text", "text": "What is in the picture?"}])
    two = chat(client, [image_part(data_uri(png_bytes(picture(64, 48, 1)))),
                        image_part(data_uri(png_bytes(picture(90, 40, 2)), "image/png")),
                        {"type": "text", "text": "Compare the two pictures."}])
    text_only = chat(client, "What is in the picture?")
    assert one.choices[0].message.content is not None and two.choices[0].message.content is not None
    # each image adds its vision tokens to the prompt
    assert two.usage.prompt_tokens > one.usage.prompt_tokens > text_only.usage.prompt_tokens + 4
    jpeg = io.BytesIO()
    picture(50, 70, 3).save(jpeg, format="JPEG")
    again = chat(client, [{"type": "text", "text": "Describe."}, image_part(data_uri(jpeg.getvalue(), "image/jpeg"))])
    assert again.usage.completion_tokens >= 1


def test_logprobs(client):
    out = chat(client, "Count to ten.", max_tokens=6, logprobs=True, top_logprobs=3)
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens
    for entry in content:
        assert entry.logprob <= 0.0
        assert len(entry.top_logprobs) == 3
        values = [t.logprob for t in entry.top_logprobs]
        assert values == sorted(values, reverse=True)
        assert entry.logprob <= values[0] + 1e-6
        assert bytes(entry.bytes).decode("utf-8", errors="replace") == entry.token
    # greedy: the chosen token is the most likely one
    assert all(abs(e.logprob - e.top_logprobs[0].logprob) < 1e-5 for e in content)
    plain = chat(client, "Count to ten.", max_tokens=6)
    assert plain.choices[0].logprobs is None
    assert plain.choices[0].message.content == out.choices[0].message.content


def test_stop_sequences(client):
    base = chat(client, "Write a sentence.", max_tokens=24, extra_body={"ignore_eos": True}).choices[0].message.content
    stop = next((base[i:i + 2] for i in range(1, len(base) - 1)
                 if base[i:i + 2].isprintable() and "\ufffd" not in base[i:i + 2] and base[i:i + 2].strip()), None)
    if stop is None:
        pytest.skip(f"no usable stop string in the tiny model's output {base!r}")
    cut = chat(client, "Write a sentence.", max_tokens=24, stop=[stop, "never-appears"], extra_body={"ignore_eos": True})
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].message.content == base[:base.index(stop)]
    streamed = chat(client, "Write a sentence.", max_tokens=24, stop=stop, stream=True, extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == base[:base.index(stop)]


def test_n_choices_and_seed(client):
    kw = dict(n=2, temperature=1.0, top_p=0.95, seed=7, max_tokens=8, presence_penalty=0.2, frequency_penalty=0.1,
              logprobs=True, extra_body={"top_k": 50, "min_p": 0.01, "repetition_penalty": 1.1})
    out = chat(client, "Say something.", **kw)
    assert [c.index for c in out.choices] == [0, 1]
    assert out.usage.completion_tokens == sum(len(c.logprobs.content) for c in out.choices)
    again = chat(client, "Say something.", **kw)  # seeded: the same two samples
    assert [c.message.content for c in again.choices] == [c.message.content for c in out.choices]
    stream = chat(client, "Say something.", n=2, max_tokens=5, stream=True, temperature=0)
    texts = {0: "", 1: ""}
    finished = set()
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            if c.finish_reason:
                finished.add(c.index)
    assert finished == {0, 1}
    assert texts[0] == texts[1]  # greedy: both choices alike


def test_text_completions(client):
    out = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=6, temperature=0,
                                    logprobs=2, echo=False)
    choice = out.choices[0]
    assert out.object == "text_completion" and choice.finish_reason in ("length", "stop")
    assert len(choice.logprobs.tokens) == out.usage.completion_tokens
    assert all(len(t) <= 2 for t in choice.logprobs.top_logprobs)
    echoed = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=6, temperature=0, echo=True)
    assert echoed.choices[0].text == "Once upon a time" + choice.text
    streamed = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=6, temperature=0,
                                         stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == choice.text
    batch = client.completions.create(model=MODEL, prompt=["a b c", "d e f"], max_tokens=3, temperature=0, n=2)
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]


def test_api_key(engine):
    srv = serve_in_thread(engine, ServerSettings(served_model_name=MODEL, api_key="sekret"))
    try:
        anon = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError) as info:
            anon.models.list()
        assert info.value.status_code == 401
        r = httpx.post(srv.base_url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]})
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        good = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="sekret", max_retries=0)
        assert good.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                            max_tokens=2).choices[0].message is not None
        assert httpx.get(srv.base_url + "/health").status_code == 200  # probes need no key
    finally:
        srv.stop()
    wait_until_idle(engine)


def test_cli_registers_serve_and_web(capsys, monkeypatch, tmp_path):
    from vlmrun.cli import build_parser, main
    from vlmrun.server.cli import server_settings

    args = build_parser().parse_args(["serve", "--model", "some/model", "--api-key", "k", "--port", "9001",
                                      "--allowed-local-media-path", "/srv/media", "--allow-private-urls"])
    settings = server_settings(args)
    assert (args.port, settings.served_model_name, settings.api_key) == (9001, "some/model", "k")
    assert settings.allow_private_urls and settings.allowed_local_media_path == "/srv/media"
    monkeypatch.setattr("vlmrun.default_model.default_model_path", lambda: tmp_path / "absent")
    assert main(["serve"]) == 2  # no --model and no bundled default: a clear error, not a traceback
    assert "bundled default model is missing" in capsys.readouterr().err
    assert main(["web"]) == 2 and main(["web", "--model", "m", "--server", "http://x"]) == 2
    assert "--model" in capsys.readouterr().err
    assert main(["web", "--model", str(tmp_path), "--limit-mm-per-prompt", '{"audio": 1}']) == 2  # exit 2, no traceback
    assert "vlmrun web:" in capsys.readouterr().err
