"""Issue 30's conformance run: what a vLLM user ports, item by item, each asserting its effect.

The Python API is called as vLLM scripts call `vllm.LLM`; the server is driven with the official
`openai` client (vLLM's own fields in `extra_body`), started as `vllm serve` starts it; `run-batch`
takes vLLM's batch file. One test per item of the issue: prompt forms, SamplingParams fields,
RequestOutput fields, LLM.chat's keywords, generation_config defaults, the server's fields, the serve
flags, run-batch. The detailed checks of each live beside its code (tests/test_vllm_api.py,
test_vllm_fields.py, test_logits_processors.py, test_prompt_logprobs.py, test_server_vllm_cli.py,
test_run_batch.py); these fixtures are theirs.
"""

from __future__ import annotations

import json
import shutil

import httpx
import openai
import pytest

from tests.test_engine_parity import make_image
from tests.test_run_batch import (ENGINE_FLAGS, _chat_line, _completion_line, _outputs, _write_lines,
                                  assert_same_answer)
from tests.test_server import MODEL, engine, server, client, tiny_engine  # noqa: F401 (fixtures)
from tests.test_server_vllm_cli import (LARGE_IMAGE, MARK, flagged, post, serve_args,  # noqa: F401 (fixture)
                                        user)
from tests.test_vllm_api import llm  # noqa: F401 (fixture)
from tests.test_vllm_fields import check_prompt_logprobs, server_chat, server_completion, streamed
from vlmrun import LLM, SamplingParams
from vlmrun.cli import main
from vlmrun.sampling_params import RequestOutputKind
from vlmrun.server.cli import engine_config, server_settings
from vlmrun.server.launch import serve_in_thread
from vlmrun.server.settings import ServerSettings

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
STORY = [{"role": "user", "content": "Tell me a story."}]


def templated(llm: LLM, messages: list) -> str:
    return llm.get_tokenizer().apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


# ---------------------------------------------------------------------------- Python API


def test_prompt_forms(llm):
    """A string is the raw prompt; {"prompt", "multi_modal_data"} and {"prompt_token_ids"} are vLLM's
    forms and run what LLM.chat runs; a dict of no form is a ValueError naming its key."""
    tokenizer = llm.get_tokenizer()
    image = make_image(64, 48, 1)
    chat = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe."}]}]
    text = templated(llm, chat)
    raw, by_ids, plain = llm.generate([{"prompt": text, "multi_modal_data": {"image": image}},
                                       {"prompt_token_ids": tokenizer.encode(text),
                                        "multi_modal_data": {"image": [image]}},
                                       "Tell me a story."], GREEDY, use_tqdm=False)
    by_chat = llm.chat(user([{"type": "image", "image": image}, {"type": "text", "text": "Describe."}]), GREEDY,
                       use_tqdm=False)[0]
    assert raw.prompt_token_ids == by_ids.prompt_token_ids == by_chat.prompt_token_ids
    assert raw.outputs[0].token_ids == by_ids.outputs[0].token_ids == by_chat.outputs[0].token_ids
    assert plain.prompt_token_ids == tokenizer.encode("Tell me a story.")  # no chat template
    with pytest.raises(ValueError, match="promt"):
        llm.generate({"promt": "a typo"}, GREEDY, use_tqdm=False)


def test_sampling_params_fields(llm):
    """logit_bias, allowed_token_ids, bad_words, prompt_logprobs, truncate_prompt_tokens, output_kind,
    detokenize, spaces_between_special_tokens: each changes what comes back as in vLLM."""
    tokenizer = llm.get_tokenizer()
    plain = llm.chat(STORY, GREEDY, use_tqdm=False)[0].outputs[0]
    forced = next(t for t in range(100, 200) if t not in plain.token_ids)
    banned = next(t for t in plain.token_ids if tokenizer.encode(tokenizer.decode([t]).strip()) == [t])
    allowed = sorted(set(plain.token_ids[:2]) | {forced})
    params = [SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, **fields) for fields in (
        {"logit_bias": {forced: 100.0}}, {"allowed_token_ids": allowed},
        {"bad_words": [tokenizer.decode([banned]).strip()]}, {"prompt_logprobs": 2}, {"truncate_prompt_tokens": 4},
        {"output_kind": RequestOutputKind.FINAL_ONLY}, {"detokenize": False},
        {"spaces_between_special_tokens": False})]
    biased, bounded, unbanned, scored, cut, final, ids_only, spaced = llm.chat([STORY] * 8, params, use_tqdm=False)
    assert biased.outputs[0].token_ids == [forced] * 6
    assert set(bounded.outputs[0].token_ids) <= set(allowed)
    assert banned not in unbanned.outputs[0].token_ids
    assert scored.prompt_logprobs[0] is None and len(scored.prompt_logprobs) == len(scored.prompt_token_ids)
    assert all(t in p and len(p) in (2, 3) for t, p in zip(scored.prompt_token_ids[1:], scored.prompt_logprobs[1:]))
    assert cut.prompt_token_ids == scored.prompt_token_ids[-4:]
    assert final.outputs[0].text == plain.text and spaced.outputs[0].token_ids == plain.token_ids
    assert ids_only.outputs[0].token_ids == plain.token_ids and ids_only.outputs[0].text == ""


def test_request_output_fields(llm):
    """prompt, prompt_logprobs, metrics, and each completion's cumulative_logprob and stop_reason."""
    out = llm.chat(STORY, SamplingParams(temperature=0.0, max_tokens=6, logprobs=1, prompt_logprobs=0),
                   use_tqdm=False)[0]
    assert out.prompt == templated(llm, STORY) and out.prompt_token_ids == llm.get_tokenizer().encode(out.prompt)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(out.prompt_token_ids)
    assert out.metrics.arrival_time <= out.metrics.first_token_time <= out.metrics.finished_time
    completion = out.outputs[0]
    assert completion.cumulative_logprob == pytest.approx(sum(lp[t] for t, lp in zip(completion.token_ids,
                                                                                    completion.logprobs)))
    stop_at = completion.token_ids[2]
    stopped = llm.chat(STORY, SamplingParams(temperature=0.0, max_tokens=6, stop_token_ids=[stop_at]),
                       use_tqdm=False)[0].outputs[0]
    assert (stopped.finish_reason, stopped.stop_reason) == ("stop", stop_at)


def test_llm_chat_keywords(llm, qwen3_vl_dir):
    """tools, chat_template, add_generation_prompt, continue_final_message, mm_processor_kwargs, an
    image_pil part; get_tokenizer / get_default_sampling_params; LLM(limit_mm_per_prompt=)."""
    tokenizer = llm.get_tokenizer()
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    opened = STORY + [{"role": "assistant", "content": "Once upon"}]
    image = make_image(256, 192, 2)
    listing = "{% for tool in tools %}{{ tool.function.name }}: {% endfor %}{{ messages[0]['content'] }}"
    with_tools, continued, small, as_pil = (llm.chat(messages, SamplingParams(max_tokens=1), use_tqdm=False,
                                                     **options)[0] for messages, options in (
        (STORY, {"tools": tools, "chat_template": listing}),
        (opened, {"add_generation_prompt": False, "continue_final_message": True}),
        (user([{"type": "image", "image": image}, "Hi"]), {"mm_processor_kwargs": {"max_pixels": 20000}}),
        (user([{"type": "image_pil", "image_pil": image}, "Hi"]), {})))
    assert with_tools.prompt_token_ids == tokenizer.encode("get_weather: Tell me a story.")
    assert continued.prompt.endswith("Once upon")
    pad = llm.engine.processor.image_token_id
    assert small.prompt_token_ids.count(pad) < as_pil.prompt_token_ids.count(pad) == 48
    assert llm.get_default_sampling_params() == SamplingParams()  # the tiny checkpoint sets no sampling default
    limited = LLM(str(qwen3_vl_dir), dtype="float32", device="cpu", max_model_len=512, limit_mm_per_prompt={"image": 1},
                  mm_processor_kwargs={"max_pixels": 20000})  # vLLM's engine-wide default
    two = limited.chat(user([{"type": "image", "image": image}] * 2 + ["Hi"]), use_tqdm=False)[0]
    assert "the limit is 1" in two.error
    one_image = user([{"type": "image", "image": image}, "Hi"])
    sized = limited.chat(one_image, SamplingParams(max_tokens=1), use_tqdm=False)[0]
    own = limited.chat(one_image, SamplingParams(max_tokens=1), use_tqdm=False,
                       mm_processor_kwargs={"max_pixels": 1 << 20})[0]  # the call's own wins
    assert sized.prompt_token_ids.count(pad) == small.prompt_token_ids.count(pad) < own.prompt_token_ids.count(pad) == 48


def test_generation_config_defaults(qwen3_dir, tmp_path):
    """The checkpoint's generation_config.json sampling fields are the defaults (vLLM's --generation-config
    auto) of the Python API and of the server, for what a request leaves out; 'vllm' turns them off."""
    model = shutil.copytree(qwen3_dir, tmp_path / "model")
    config = json.loads((model / "generation_config.json").read_text())
    (model / "generation_config.json").write_text(json.dumps({**config, "temperature": 0.01, "max_new_tokens": 3}))
    llm = LLM(str(model), dtype="float32", device="cpu", max_model_len=256)
    defaults = llm.get_default_sampling_params()
    assert (defaults.temperature, defaults.max_tokens) == (0.01, 3)
    assert len(llm.generate("Tell me a story.", use_tqdm=False)[0].outputs[0].token_ids) <= 3
    assert LLM(str(model), dtype="float32", device="cpu", max_model_len=256,
               generation_config="vllm").get_default_sampling_params() == SamplingParams()
    eng = tiny_engine(model)
    srv = serve_in_thread(eng, ServerSettings(served_model_name="m"))
    try:
        body = {"messages": STORY, "ignore_eos": True}
        assert post(srv, "/v1/chat/completions", body).json()["usage"]["completion_tokens"] == 3
        assert post(srv, "/v1/chat/completions", {**body, "max_tokens": 5}).json()["usage"]["completion_tokens"] == 5
    finally:
        srv.stop()
        eng.shutdown()


# ---------------------------------------------------------------------------- the server, with the openai client


def test_server_sampling_fields(client, engine):
    """logit_bias, allowed_token_ids, bad_words, truncate_prompt_tokens act; chat best_of other than n
    is a 400 naming it."""
    tokenizer = engine.tokenizer
    plain = server_chat(client, max_tokens=6, extra_body={"ignore_eos": True, "return_token_ids": True})
    plain_ids = plain.model_dump()["choices"][0]["token_ids"]
    forced = next(t for t in range(100, 200) if t not in plain_ids)
    biased = server_chat(client, max_tokens=4, logit_bias={str(forced): 100},
                         extra_body={"ignore_eos": True, "return_token_ids": True})
    assert biased.model_dump()["choices"][0]["token_ids"] == [forced] * 4
    allowed = sorted(set(plain_ids[:2]) | {forced})
    bounded = server_completion(client, temperature=1.0, seed=4,
                                extra_body={"allowed_token_ids": allowed, "return_token_ids": True})
    assert set(bounded.model_dump()["choices"][0]["token_ids"]) <= set(allowed)
    banned = next(t for t in plain_ids if tokenizer.encode(tokenizer.decode([t]).strip()) == [t])
    unbanned = server_chat(client, max_tokens=6, extra_body={"ignore_eos": True, "return_token_ids": True,
                                                             "bad_words": [tokenizer.decode([banned]).strip()]})
    assert banned not in unbanned.model_dump()["choices"][0]["token_ids"]
    cut = server_completion(client, extra_body={"truncate_prompt_tokens": 2})
    assert cut.usage.prompt_tokens == 2
    with pytest.raises(openai.BadRequestError) as err:
        server_chat(client, n=1, extra_body={"best_of": 2})
    assert err.value.body["param"] == "best_of"


def test_server_prompt_logprobs_and_token_ids(client):
    """prompt_logprobs (chat: on the response; completions: on each choice; a 400 when streamed, as vLLM)
    and return_token_ids, collected and streamed."""
    chat = server_chat(client, extra_body={"prompt_logprobs": 1, "return_token_ids": True}).model_dump()
    check_prompt_logprobs(chat["prompt_logprobs"], chat["prompt_token_ids"], 1)
    done = server_completion(client, extra_body={"prompt_logprobs": 2, "return_token_ids": True}).model_dump()
    check_prompt_logprobs(done["choices"][0]["prompt_logprobs"], done["choices"][0]["prompt_token_ids"], 2)
    chunks = streamed(server_chat, client, extra_body={"return_token_ids": True})
    assert chunks[0]["prompt_token_ids"] == chat["prompt_token_ids"]
    assert sum((c["token_ids"] for chunk in chunks for c in chunk["choices"]), []) == chat["choices"][0]["token_ids"]
    with pytest.raises(openai.BadRequestError) as err:
        server_chat(client, stream=True, extra_body={"prompt_logprobs": 1})
    assert err.value.body["param"] == "prompt_logprobs"


def test_server_chat_template_fields(client, flagged, engine):
    """continue_final_message with chat echo, a per-request chat_template (only with
    --trust-request-chat-template) reading chat_template_kwargs, mm_processor_kwargs."""
    opened = STORY + [{"role": "assistant", "content": "Once upon"}]
    fields = {"add_generation_prompt": False, "continue_final_message": True}
    answer = server_chat(client, opened, extra_body=fields).choices[0].message.content
    echoed = server_chat(client, opened, extra_body={**fields, "echo": True}).choices[0].message.content
    assert echoed == "Once upon" + answer
    template = {"chat_template": "{{ greeting }}, {{ messages[0]['content'] }}", "return_token_ids": True,
                "chat_template_kwargs": {"greeting": "Hello"}}
    own = post(flagged, "/v1/chat/completions", {"messages": STORY, "max_tokens": 1, **template}).json()
    assert own["prompt_token_ids"] == engine.tokenizer.encode("Hello, Tell me a story.")
    with pytest.raises(openai.BadRequestError) as err:
        server_chat(client, extra_body=template)  # a server started without the flag
    assert err.value.body["param"] == "chat_template"
    sized = post(flagged, "/v1/chat/completions", {"messages": user([LARGE_IMAGE, "What is it?"]), "max_tokens": 1,
                                                   "mm_processor_kwargs": {"max_pixels": 1 << 20}}).json()
    full = post(flagged, "/v1/chat/completions", {"messages": user([LARGE_IMAGE, "What is it?"]), "max_tokens": 1}).json()
    assert sized["usage"]["prompt_tokens"] - full["usage"]["prompt_tokens"] == 48 - 15  # over its --mm-processor-kwargs
    with pytest.raises(openai.BadRequestError) as err:  # a server started without --trust-request-mm-kwargs
        server_chat(client, user([LARGE_IMAGE, "What is it?"]), extra_body={"mm_processor_kwargs": {"max_pixels": 1}})
    assert err.value.body["param"] == "mm_processor_kwargs"


def test_server_continuous_usage_stats(client):
    """stream_options.continuous_usage_stats (with include_usage): the usage so far on every chunk."""
    chunks = streamed(server_completion, client, stream_options={"include_usage": True, "continuous_usage_stats": True})
    *per_chunk, last = chunks
    assert all(chunk["usage"] is not None for chunk in per_chunk)
    assert per_chunk[-1]["usage"] == last["usage"] and last["usage"]["completion_tokens"] == 4


def test_server_completions_echo_with_logprobs(client):
    """echo with logprobs: the prompt's tokens and logprobs (the first null) before the answer's."""
    answer = server_completion(client, logprobs=1)
    echoed = server_completion(client, echo=True, logprobs=1).choices[0]
    n = answer.usage.prompt_tokens
    assert echoed.text == "Once upon a time" + answer.choices[0].text
    assert echoed.logprobs.token_logprobs[0] is None and len(echoed.logprobs.tokens) == n + 4
    assert echoed.logprobs.token_logprobs[n:] == pytest.approx(answer.choices[0].logprobs.token_logprobs, abs=1e-4)


def test_server_small_endpoints(server):
    """/tokenize, /detokenize, /version, /ping in vLLM's shapes."""
    ids = post(server, "/tokenize", {"prompt": "Once upon a time"}).json()
    assert ids["count"] == len(ids["tokens"]) and ids["max_model_len"] == 1024
    assert post(server, "/detokenize", {"tokens": ids["tokens"]}).json() == {"prompt": "Once upon a time"}
    assert httpx.get(server.base_url + "/version").json()["version"]
    assert httpx.get(server.base_url + "/ping").status_code == 200


# ---------------------------------------------------------------------------- the command line


def test_serve_flags(qwen3_vl_dir, flagged, server):
    """`vlmrun serve MODEL` with vLLM's flags: each reaches the engine or the server and has its effect."""
    args = serve_args(qwen3_vl_dir, "--revision", "main", "--seed", "7", "--no-enable-prefix-caching",
                      "--generation-config", "vllm", "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                      "--limit-mm-per-prompt", '{"image": 2, "video": 0}', "--trust-request-chat-template",
                      "--mm-processor-kwargs", '{"max_pixels": 20000}', "--chat-template", "{{ 'x' }}")
    config, settings = engine_config(args), server_settings(args)
    assert (config.model, config.revision, config.seed, config.enable_prefix_caching, config.generation_config,
            config.chat_template, config.max_images_per_request, config.max_videos_per_request,
            config.mm_processor_kwargs) == (str(qwen3_vl_dir), "main", 7, False, "vllm", "{{ 'x' }}", 2, 0,
                                            {"max_pixels": 20000})
    assert (settings.enable_auto_tool_choice, settings.tool_call_parser, settings.trust_request_chat_template) == (
        True, "hermes", True)
    # the flagged server: --chat-template, --limit-mm-per-prompt, --mm-processor-kwargs,
    # --no-enable-prefix-caching, no --enable-auto-tool-choice
    flagged_ids = post(flagged, "/tokenize", {"messages": user([LARGE_IMAGE, "hi"])}).json()["tokens"]
    pad = flagged.engine.engine.processor.image_token_id
    assert post(flagged, "/detokenize", {"tokens": flagged_ids}).json()["prompt"].startswith(MARK)
    assert flagged_ids.count(pad) == 15
    two = post(flagged, "/v1/chat/completions", {"messages": user([LARGE_IMAGE, LARGE_IMAGE, "hi"]), "max_tokens": 1})
    assert two.status_code == 400 and "the limit is 1" in two.json()["error"]["message"]
    assert flagged.engine.engine.prefix_cache is None
    tools = {"messages": user("weather?"), "max_tokens": 2, "tools": [{"type": "function", "function": {
        "name": "get_weather", "parameters": {"type": "object"}}}]}
    assert post(flagged, "/v1/chat/completions", tools).json()["error"]["param"] == "tool_choice"
    assert post(server, "/v1/chat/completions", tools).status_code == 200


# ---------------------------------------------------------------------------- run-batch


def test_run_batch(qwen3_vl_dir, tmp_path, server):
    """vLLM's batch file: each line answered as the server answers its body (vLLM's fields included),
    once; a rerun skips what is written."""
    lines = [_chat_line("chat", "Tell me a story.", MODEL, return_token_ids=True, logprobs=True),
             _completion_line("echo", "Once upon a time", MODEL, echo=True, logprobs=1)]
    src = _write_lines(tmp_path / "in.jsonl", lines)
    out = tmp_path / "out.jsonl"
    flags = ["--model", str(qwen3_vl_dir), "--served-model-name", MODEL, *ENGINE_FLAGS]
    assert main(["run-batch", "-i", str(src), "-o", str(out), *flags]) == 0
    answers = {o["custom_id"]: o for o in _outputs(out)}
    assert set(answers) == {"chat", "echo"} and all(o["error"] is None for o in answers.values())
    for line in lines:
        got = answers[line["custom_id"]]["response"]["body"]
        want = post(server, line["url"], line["body"]).json()
        assert_same_answer(got, want, 1e-4, line["custom_id"])
    assert answers["echo"]["response"]["body"]["choices"][0]["text"].startswith("Once upon a time")
    before = out.read_bytes()
    assert main(["run-batch", "-i", str(src), "-o", str(out), *flags]) == 0
    assert out.read_bytes() == before
