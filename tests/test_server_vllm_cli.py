"""`vlmrun serve` as `vllm serve` users call it: the model as the positional argument, `--revision`,
`--seed`, `--enable-prefix-caching` / `--no-enable-prefix-caching`, `--chat-template`,
`--limit-mm-per-prompt`, `--enable-auto-tool-choice` / `--tool-call-parser`, `--trust-request-chat-template`,
`--mm-processor-kwargs`, and the small endpoints `/ping`, `/version`, `/tokenize`, `/detokenize`.

A server is built from a `serve` command line (the engine and settings its flags give) and compared
with tests/test_server.py's default one: each flag is checked by its effect.
"""

from __future__ import annotations

import importlib.metadata
from dataclasses import dataclass
from typing import Iterator

import httpx
import numpy as np
import openai
import pytest

import vlmrun
from vlmrun.cli import build_parser, main
from vlmrun.config import mm_limit_fields
from vlmrun.engine.async_engine import AsyncEngine
from vlmrun.processors import InputError, Processor, ProcessorLimits
from vlmrun.processors.processor_files import load_chat_template
from vlmrun.server.cli import engine_config, server_settings
from vlmrun.server.launch import ServerThread, build_engine, serve_in_thread
from vlmrun.server.settings import ServerSettings
from testing.tiny_models import CHAT_TEMPLATE
from tests.test_server import (MODEL, data_uri, engine, image_part, picture, png_bytes,  # noqa: F401
                               server, wait_until_idle)
from tests.test_server_structured import WEATHER

MARK = "FLAG-TEMPLATE "
FLAG_TEMPLATE = "{{- '" + MARK + "' -}}" + CHAT_TEMPLATE  # the checkpoint's template, marked
LONG = "Describe every colour of the sea and the sky at dawn, slowly and in detail. " * 3
IMAGE = image_part(data_uri(png_bytes(picture(40, 30, seed=1))))
LARGE_IMAGE = image_part(data_uri(png_bytes(picture(256, 192, seed=1))))  # 48 image tokens at the default size
MM_DEFAULTS = '{"max_pixels": 20000}'  # the flagged server's --mm-processor-kwargs: 15 tokens for LARGE_IMAGE


def serve_args(model_dir, *flags: str):
    return build_parser().parse_args(["serve", str(model_dir), "--dtype", "float32", "--device", "cpu",
                                      "--max-model-len", "1024", "--max-num-seqs", "64",
                                      "--kv-cache-memory-bytes", str(32 << 20), *flags])


@dataclass
class Served:
    """A server and the engine behind it."""

    base_url: str
    engine: AsyncEngine


@pytest.fixture(scope="module")
def flagged(qwen3_vl_dir) -> Iterator[Served]:
    """A server started from a `serve` command line carrying the vLLM flags."""
    args = serve_args(qwen3_vl_dir, "--served-model-name", "flagged", "--seed", "5", "--no-enable-prefix-caching",
                      "--chat-template", FLAG_TEMPLATE, "--limit-mm-per-prompt", '{"image": 1, "video": 0}',
                      "--trust-request-chat-template", "--mm-processor-kwargs", MM_DEFAULTS,
                      "--trust-request-mm-kwargs")
    eng = build_engine(engine_config(args))
    srv = serve_in_thread(eng, server_settings(args))
    yield Served(srv.base_url, eng)
    srv.stop()
    eng.shutdown()


def post(srv: ServerThread | Served, path: str, body: dict, **kwargs) -> httpx.Response:
    return httpx.post(srv.base_url + path, json=body, timeout=60, **kwargs)


def user(content) -> list[dict]:
    return [{"role": "user", "content": content}]


# ---------------------------------------------------------------------------- the command line


def test_the_model_is_positional_as_in_vllm_serve(qwen3_vl_dir, capsys):
    positional = serve_args(qwen3_vl_dir)
    assert engine_config(positional).model == str(qwen3_vl_dir)
    assert server_settings(positional).served_model_name == str(qwen3_vl_dir)
    flag = build_parser().parse_args(["serve", "--model", "some/model"])
    assert engine_config(flag).model == "some/model"
    same = build_parser().parse_args(["serve", "some/model", "--model", "some/model"])
    assert engine_config(same).model == "some/model"
    assert main(["serve", "one/model", "--model", "another/model"]) == 2
    err = capsys.readouterr().err
    assert "named twice" in err and "one/model" in err and "another/model" in err


def test_engine_flags_reach_the_engine_config(qwen3_vl_dir):
    defaults = engine_config(serve_args(qwen3_vl_dir))
    assert (defaults.seed, defaults.enable_prefix_caching, defaults.chat_template, defaults.revision) == (0, True, None,
                                                                                                         None)
    assert (defaults.max_images_per_request, defaults.max_videos_per_request) == (32, 32)
    config = engine_config(serve_args(qwen3_vl_dir, "--revision", "v2", "--seed", "7", "--no-enable-prefix-caching",
                                      "--chat-template", "t.jinja", "--limit-mm-per-prompt", '{"image": 3, "video": 0}'))
    assert (config.revision, config.seed, config.enable_prefix_caching, config.chat_template) == ("v2", 7, False,
                                                                                                  "t.jinja")
    assert (config.max_images_per_request, config.max_videos_per_request) == (3, 0)
    assert engine_config(serve_args(qwen3_vl_dir, "--enable-prefix-caching")).enable_prefix_caching
    assert engine_config(serve_args(qwen3_vl_dir, "--max-images-per-request", "4")).max_images_per_request == 4


def test_bad_vllm_flags_stop_the_server_before_loading(qwen3_vl_dir, tmp_path, capsys):
    model = str(qwen3_vl_dir)
    assert main(["serve", model, "--limit-mm-per-prompt", '{"audio": 1}']) == 2
    assert "unknown modality 'audio'" in capsys.readouterr().err
    assert main(["serve", model, "--limit-mm-per-prompt", '{"image": -1}']) == 2
    assert "non-negative integer" in capsys.readouterr().err
    assert main(["serve", model, "--limit-mm-per-prompt", '{"image": 2}', "--max-images-per-request", "3"]) == 2
    assert "disagree" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        main(["serve", model, "--limit-mm-per-prompt", "image=2"])
    assert exit_.value.code == 2 and "not JSON" in capsys.readouterr().err
    assert main(["serve", model, "--chat-template", str(tmp_path / "absent.jinja")]) == 2
    assert "reads as a file path" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        main(["serve", model, "--tool-call-parser", "mistral"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "mistral" in err and all(p in err for p in ("hermes", "qwen3_coder", "qwen3_xml"))
    assert main(["serve", model, "--enable-auto-tool-choice"]) == 2
    assert "--tool-call-parser" in capsys.readouterr().err
    assert main(["serve", model, "--mm-processor-kwargs", '{"crop": 1}']) == 2
    assert "unsupported option 'crop'" in capsys.readouterr().err
    assert main(["serve", model, "--mm-processor-kwargs", '{"max_pixels": -1}']) == 2
    assert "positive integer" in capsys.readouterr().err


def test_server_flags_reach_the_server_settings(qwen3_vl_dir):
    settings = server_settings(serve_args(qwen3_vl_dir, "--enable-auto-tool-choice", "--tool-call-parser", "qwen3_xml",
                                          "--trust-request-chat-template", "--mm-processor-kwargs", MM_DEFAULTS))
    assert (settings.enable_auto_tool_choice, settings.tool_call_parser) == (True, "qwen3_xml")
    assert settings.trust_request_chat_template
    plain = server_settings(serve_args(qwen3_vl_dir))
    assert (plain.enable_auto_tool_choice, plain.tool_call_parser) == (False, None)
    assert not plain.trust_request_chat_template
    # --mm-processor-kwargs is an engine option, as vLLM's: the engine's processor applies it
    assert engine_config(serve_args(qwen3_vl_dir, "--mm-processor-kwargs", MM_DEFAULTS)).mm_processor_kwargs \
        == {"max_pixels": 20000}
    assert engine_config(serve_args(qwen3_vl_dir)).mm_processor_kwargs is None


def test_limit_mm_per_prompt_maps_onto_the_engine_limits():
    assert mm_limit_fields({"image": 2, "video": 1}) == {"max_images_per_request": 2, "max_videos_per_request": 1}
    with pytest.raises(ValueError, match="'image'"):
        mm_limit_fields({"image": "2"})


def test_chat_template_is_a_file_or_the_template_itself(qwen3_vl_dir, tmp_path):
    path = tmp_path / "marked.jinja"
    path.write_text(FLAG_TEMPLATE, encoding="utf-8")
    assert load_chat_template(str(path)) == FLAG_TEMPLATE
    assert load_chat_template("{{ 'a' }}\\n") == "{{ 'a' }}\n"  # escapes typed on a command line
    with pytest.raises(FileNotFoundError, match="reads as a file path"):
        load_chat_template(str(tmp_path / "absent.jinja"))
    from_file = Processor.from_pretrained(qwen3_vl_dir, chat_template=str(path)).process_chat(user("hi")).text
    assert from_file.startswith(MARK)
    assert Processor.from_pretrained(qwen3_vl_dir, chat_template=FLAG_TEMPLATE).process_chat(user("hi")).text == from_file
    assert not Processor.from_pretrained(qwen3_vl_dir).process_chat(user("hi")).text.startswith(MARK)


def test_video_limit_refuses_before_decoding(qwen3_vl_dir):
    processor = Processor.from_pretrained(qwen3_vl_dir, limits=ProcessorLimits(max_videos_per_request=0))
    frames = np.zeros((4, 32, 32, 3), dtype=np.uint8)
    with pytest.raises(InputError, match=r"too many videos in one request: 1 \(the limit is 0\)"):
        processor.process_chat(user([{"type": "video", "video": frames}, {"type": "text", "text": "x"}]))


def test_seed_sets_the_engines_sampling(qwen3_vl_dir):
    """Unseeded sampled requests repeat under the same engine seed and differ under another."""
    params = vlmrun.SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)

    def sample(seed: int) -> list[list[int]]:
        llm = vlmrun.LLM(str(qwen3_vl_dir), dtype="float32", device="cpu", max_model_len=256,
                         kv_cache_memory_bytes=8 << 20, seed=seed)
        return [o.outputs[0].token_ids for o in llm.generate(["one", "two"], params, use_tqdm=False)]

    first = sample(5)
    assert sample(5) == first
    assert sample(6) != first


# ---------------------------------------------------------------------------- the flags in a served engine


def test_positional_model_serves(flagged):
    openai_client = openai.OpenAI(base_url=flagged.base_url + "/v1", api_key="unused", max_retries=0, timeout=60)
    assert [m.id for m in openai_client.models.list().data] == ["flagged"]
    out = openai_client.chat.completions.create(model="flagged", messages=user("hi"), max_tokens=3, temperature=0)
    assert out.choices[0].message.content is not None
    assert flagged.engine.engine.config.seed == 5


def test_no_enable_prefix_caching_gets_no_hits(flagged, server, engine):
    def hits(srv: ServerThread | Served, eng: AsyncEngine) -> tuple[int, int]:
        for _ in range(2):  # the second request would reuse the first's full prompt pages
            assert post(srv, "/v1/chat/completions", {"messages": user(LONG), "max_tokens": 1}).status_code == 200
        metric = next(line for line in httpx.get(srv.base_url + "/metrics").text.splitlines()
                      if line.startswith("vlmrun_prefix_cache_hit_tokens"))
        return eng.stats.prefix_hit_tokens, int(float(metric.split()[-1]))

    assert hits(flagged, flagged.engine) == (0, 0)
    assert flagged.engine.engine.prefix_cache is None
    on_tokens, on_metric = hits(server, engine)
    assert on_tokens > 0 and on_metric == on_tokens


def test_chat_template_flag_changes_the_prompt(flagged, server):
    flagged_ids = post(flagged, "/tokenize", {"messages": user("hi")}).json()["tokens"]
    default_ids = post(server, "/tokenize", {"messages": user("hi")}).json()["tokens"]
    flagged_text = post(flagged, "/detokenize", {"tokens": flagged_ids}).json()["prompt"]
    default_text = post(server, "/detokenize", {"tokens": default_ids}).json()["prompt"]
    assert flagged_text == MARK + default_text


def test_request_chat_template_needs_trust(flagged, server):
    """--trust-request-chat-template: a request's own template (its text) renders the prompt; without the
    flag it is a 400 naming chat_template, on /tokenize too; a file path is never read."""
    template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    body = {"messages": user("hi"), "chat_template": template, "max_tokens": 1, "return_token_ids": True}
    answer = post(flagged, "/v1/chat/completions", body).json()
    assert post(flagged, "/detokenize", {"tokens": answer["prompt_token_ids"]}).json()["prompt"] == "[user] hi\n"
    assert post(flagged, "/tokenize", body).json()["tokens"] == answer["prompt_token_ids"]
    for path in ("/v1/chat/completions", "/tokenize"):
        refused = post(server, path, body)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "chat_template"
        assert "--trust-request-chat-template" in refused.json()["error"]["message"]
    a_path = post(flagged, "/v1/chat/completions", {**body, "chat_template": vlmrun.__file__})
    assert a_path.status_code == 400 and a_path.json()["error"]["param"] == "chat_template"


def test_documents_reach_a_template_that_reads_them(flagged):
    template = "{% for d in documents %}{{ d.title }};{% endfor %}{{ messages[0]['content'] }}"
    body = {"messages": user("hi"), "chat_template": template,
            "documents": [{"title": "a", "text": "x"}, {"title": "b", "text": "y"}]}
    ids = post(flagged, "/tokenize", body).json()["tokens"]
    assert post(flagged, "/detokenize", {"tokens": ids}).json()["prompt"] == "a;b;hi"
    answer = post(flagged, "/v1/chat/completions", {**body, "max_tokens": 1, "return_token_ids": True}).json()
    assert answer["prompt_token_ids"] == ids


def test_mm_processor_kwargs_flag_is_the_default(flagged, server):
    """--mm-processor-kwargs sizes every image that does not size itself; a request's own
    mm_processor_kwargs (on a server started with --trust-request-mm-kwargs; elsewhere a 400, as in vLLM)
    and an item's own max_pixels win, as in vLLM."""
    def image_tokens(srv: ServerThread | Served, content, **fields) -> int:
        ids = post(srv, "/tokenize", {"messages": user(content), **fields}).json()["tokens"]
        return ids.count(flagged.engine.engine.processor.tokenizer.convert_tokens_to_ids("<|image_pad|>"))

    assert image_tokens(server, [LARGE_IMAGE, "what?"]) == 48
    assert image_tokens(flagged, [LARGE_IMAGE, "what?"]) == 15
    assert image_tokens(flagged, [LARGE_IMAGE, "what?"], mm_processor_kwargs={"max_pixels": 1 << 20}) == 48
    untrusted = post(server, "/tokenize", {"messages": user([LARGE_IMAGE, "what?"]),
                                           "mm_processor_kwargs": {"max_pixels": 20000}})
    assert untrusted.status_code == 400 and untrusted.json()["error"]["param"] == "mm_processor_kwargs"
    assert "--trust-request-mm-kwargs" in untrusted.json()["error"]["message"]
    sized = {**LARGE_IMAGE, "max_pixels": 1 << 20}
    assert image_tokens(flagged, [sized, "what?"]) == 48
    chat = post(flagged, "/v1/chat/completions", {"messages": user([LARGE_IMAGE, "what?"]), "max_tokens": 1})
    assert chat.json()["usage"]["prompt_tokens"] == post(flagged, "/tokenize", {"messages": user([LARGE_IMAGE, "what?"])
                                                                               }).json()["count"]


def test_limit_mm_per_prompt_refuses_too_many_images(flagged):
    one = post(flagged, "/v1/chat/completions", {"messages": user([IMAGE, "what?"]), "max_tokens": 1})
    assert one.status_code == 200
    two = post(flagged, "/v1/chat/completions", {"messages": user([IMAGE, IMAGE, "what?"]), "max_tokens": 1})
    assert two.status_code == 400
    error = two.json()["error"]
    assert "too many images in one request: 2 (the limit is 1)" in error["message"] and error["param"] == "messages"
    assert post(flagged, "/tokenize", {"messages": user([IMAGE, IMAGE, "what?"])}).status_code == 400


def test_auto_tool_choice_needs_the_flag(flagged, server):
    def ask(srv: ServerThread | Served, model: str, **fields) -> httpx.Response:
        return post(srv, "/v1/chat/completions", {"model": model, "messages": user("weather in Paris?"),
                                                  "tools": [WEATHER], "max_tokens": 120, "parallel_tool_calls": False,
                                                  **fields})

    for fields in ({}, {"tool_choice": "auto"}):  # "auto" is the default with tools
        refused = ask(flagged, "flagged", **fields)
        assert refused.status_code == 400, fields
        error = refused.json()["error"]
        assert error["param"] == "tool_choice" and "--enable-auto-tool-choice" in error["message"]
    assert ask(flagged, "flagged", tool_choice="none").status_code == 200
    forced = ask(flagged, "flagged", tool_choice="required")
    assert forced.status_code == 200 and forced.json()["choices"][0]["finish_reason"] == "tool_calls"
    assert ask(server, MODEL).status_code == 200  # started with --enable-auto-tool-choice


# ---------------------------------------------------------------------------- the small endpoints


def test_ping_and_version(server):
    assert httpx.get(server.base_url + "/ping").json() == {"status": "ok"}
    assert httpx.post(server.base_url + "/ping").status_code == 200
    assert httpx.get(server.base_url + "/version").json() == {"version": importlib.metadata.version("vlmrun")}


def test_tokenize_equals_the_processors_ids(server, engine):
    processor = engine.engine.processor
    chat = user([IMAGE, "what is this?"])
    answer = post(server, "/tokenize", {"model": MODEL, "messages": chat}).json()
    expected = processor.process_chat(chat).token_ids
    assert answer == {"count": len(expected), "max_model_len": 1024, "tokens": list(expected)}
    no_prompt = post(server, "/tokenize", {"messages": chat, "add_generation_prompt": False}).json()
    assert no_prompt["tokens"] == list(processor.process_chat(chat, add_generation_prompt=False).token_ids)
    assert no_prompt["count"] < answer["count"]
    text = post(server, "/tokenize", {"prompt": LONG, "return_token_strs": True}).json()
    assert text["tokens"] == processor.tokenizer.encode(LONG) and text["count"] == len(text["tokens"])
    assert text["token_strs"] == processor.tokenizer.convert_ids_to_tokens(text["tokens"])


def test_detokenize_round_trip(server):
    ids = post(server, "/tokenize", {"prompt": LONG}).json()["tokens"]
    assert post(server, "/detokenize", {"tokens": ids}).json() == {"prompt": LONG}
    chat_ids = post(server, "/tokenize", {"messages": user("hi there")}).json()["tokens"]
    text = post(server, "/detokenize", {"tokens": chat_ids}).json()["prompt"]
    assert "<|im_start|>user\nhi there<|im_end|>" in text  # special tokens kept
    assert post(server, "/tokenize", {"prompt": text}).json()["tokens"] == chat_ids


@pytest.mark.parametrize("path, body, param", [
    ("/tokenize", {}, "prompt"),
    ("/tokenize", {"prompt": "a", "messages": user("b")}, "prompt"),
    ("/tokenize", {"prompt": ["a"]}, "prompt"),
    ("/tokenize", {"prompt": "a", "add_special_tokens": "yes"}, "add_special_tokens"),
    ("/tokenize", {"messages": [{"role": "wizard", "content": "x"}]}, "messages"),
    ("/tokenize", {"messages": user("x"), "continue_final_message": True}, "continue_final_message"),
    ("/tokenize", {"messages": user("x"), "chat_template": "{{ 'x' }}"}, "chat_template"),
    ("/detokenize", {"tokens": "1 2"}, "tokens"),
    ("/detokenize", {"tokens": [1, -1]}, "tokens"),
    ("/detokenize", {"tokens": [1, 10 ** 9]}, "tokens"),
])
def test_bad_tokenize_bodies_are_400s(server, path, body, param):
    r = post(server, path, body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_tokenize_follows_the_body_and_key_rules(engine):
    srv = serve_in_thread(engine, ServerSettings(served_model_name=MODEL, api_key="k"))
    try:
        key = {"Authorization": "Bearer k"}
        assert post(srv, "/tokenize", {"prompt": "a"}).status_code == 401
        assert post(srv, "/detokenize", {"tokens": [1]}).status_code == 401
        assert post(srv, "/tokenize", {"prompt": "a"}, headers=key).status_code == 200
        plain = httpx.post(srv.base_url + "/tokenize", content=b'{"prompt": "a"}',
                           headers={**key, "Content-Type": "text/plain"})
        assert plain.status_code == 415
        assert post(srv, "/tokenize", {"prompt": "a", "model": "other"}, headers=key).status_code == 404
        for probe in ("/ping", "/version", "/health"):  # probes need no key
            assert httpx.get(srv.base_url + probe).status_code == 200
    finally:
        srv.stop()
    wait_until_idle(engine)


def test_generation_config_defaults_reach_the_server(qwen3_vl_dir, tmp_path):
    """--generation-config auto (the default): a request that leaves max_tokens or temperature out gets
    the checkpoint's generation_config.json values (max_new_tokens caps the length); vllm: none."""
    import json
    import shutil

    model = tmp_path / "model"
    shutil.copytree(qwen3_vl_dir, model)
    config = json.loads((model / "generation_config.json").read_text())
    (model / "generation_config.json").write_text(json.dumps({**config, "max_new_tokens": 3, "temperature": 0.01}))
    body = {"model": "m", "messages": user("Describe the sea at dawn, slowly."), "ignore_eos": True}
    lengths = {}
    for mode in ("auto", "vllm"):
        args = serve_args(model, "--served-model-name", "m", "--generation-config", mode)
        eng = build_engine(engine_config(args))
        srv = serve_in_thread(eng, server_settings(args))
        try:
            defaults = eng.engine.model_config.sampling_defaults
            assert defaults == ({"max_tokens": 3, "temperature": 0.01} if mode == "auto" else {})
            answer = post(srv, "/v1/chat/completions", body).json()
            lengths[mode] = answer["usage"]["completion_tokens"]
            given = post(srv, "/v1/chat/completions", {**body, "max_tokens": 5}).json()  # the request's own wins
            assert given["usage"]["completion_tokens"] == 5
        finally:
            srv.stop()
            eng.shutdown()
    assert lengths["auto"] == 3 and lengths["vllm"] > 3
