"""vLLM's output fields and SamplingParams fields (issue 30), each asserted by its effect or its refusal.

`RequestOutput.prompt`, `.metrics`, `CompletionOutput.cumulative_logprob` and `.stop_reason`;
`truncate_prompt_tokens`, `output_kind`, `detokenize`, `spaces_between_special_tokens`. The server's
fields (`prompt_logprobs`, `return_token_ids` collected and streamed, `stream_options.continuous_usage_stats`,
chat `echo` with `continue_final_message`, completions `echo` with `logprobs`, `return_tokens_as_token_ids`,
`request_id`, `include_reasoning`, and the 400s naming what it refuses, vLLM's fields without a
counterpart here included) are driven with the `openai` client.
"""

from __future__ import annotations

import math

import openai
import pytest

from vlmrun import LLM, SamplingParams
from vlmrun.sampling_params import RequestOutputKind

CHAT = [{"role": "user", "content": "Tell me about the sea."}]


@pytest.fixture(scope="module")
def llm(qwen3_dir) -> LLM:
    return LLM(str(qwen3_dir), dtype="float32", device="cpu", max_model_len=256, max_num_seqs=4)


def greedy(**kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=kwargs.pop("max_tokens", 6), **kwargs)


def test_cumulative_logprob_is_the_sum_of_the_sampled_tokens(llm):
    plain, asked = llm.chat([CHAT, CHAT], [greedy(), greedy(logprobs=2)], use_tqdm=False)
    assert plain.outputs[0].cumulative_logprob is None  # vLLM: None when logprobs were not asked
    out = asked.outputs[0]
    expected = sum(lp[t] for t, lp in zip(out.token_ids, out.logprobs))
    assert out.cumulative_logprob == pytest.approx(expected) and out.cumulative_logprob < 0


def test_stop_reason_names_the_stop_string_or_token(llm):
    free = llm.chat(CHAT, greedy(max_tokens=8), use_tqdm=False)[0].outputs[0]
    assert free.finish_reason == "length" and free.stop_reason is None
    token = free.token_ids[2]
    by_id = llm.chat(CHAT, greedy(max_tokens=8, stop_token_ids=[token]), use_tqdm=False)[0].outputs[0]
    assert by_id.finish_reason == "stop" and by_id.stop_reason == token
    stop = free.text[len(free.text) // 2:][:2]
    by_text = llm.chat(CHAT, greedy(max_tokens=8, stop=[stop]), use_tqdm=False)[0].outputs[0]
    assert by_text.finish_reason == "stop" and by_text.stop_reason == stop


def test_prompt_and_metrics(llm):
    out = llm.chat(CHAT, greedy(), use_tqdm=False)[0]
    assert out.prompt == llm.tokenizer.decode(out.prompt_token_ids)  # the rendered chat template
    assert "Tell me about the sea." in out.prompt
    m = out.metrics
    assert m.arrival_time <= m.first_token_time <= m.finished_time


def test_truncate_prompt_tokens_keeps_the_last_tokens(llm):
    whole = llm.chat(CHAT, greedy(), use_tqdm=False)[0]
    cut = llm.chat(CHAT, greedy(truncate_prompt_tokens=5), use_tqdm=False)[0]
    assert cut.prompt_token_ids == whole.prompt_token_ids[-5:]
    assert llm.chat(CHAT, greedy(truncate_prompt_tokens=-1), use_tqdm=False)[0].prompt_token_ids == \
        whole.prompt_token_ids  # -1: max_model_len, longer than the prompt
    with pytest.raises(ValueError, match="truncate_prompt_tokens"):
        SamplingParams(truncate_prompt_tokens=0)


def test_truncation_may_not_cut_an_image(qwen2_5_vl_dir, sample_images):
    llm = LLM(str(qwen2_5_vl_dir), dtype="float32", device="cpu", max_model_len=2048, max_num_seqs=2)
    chat = [{"role": "user", "content": [{"type": "image", "image": sample_images[0]},
                                         {"type": "text", "text": "What is it?"}]}]
    out = llm.chat(chat, greedy(truncate_prompt_tokens=4), use_tqdm=False)[0]
    assert out.error is not None and "truncate_prompt_tokens" in out.error


def test_output_kind(llm):
    final = llm.chat(CHAT, greedy(output_kind=RequestOutputKind.FINAL_ONLY), use_tqdm=False)[0]
    assert final.text == llm.chat(CHAT, greedy(), use_tqdm=False)[0].text  # the whole output either way
    assert SamplingParams(output_kind=2).output_kind is RequestOutputKind.FINAL_ONLY
    with pytest.raises(ValueError, match="output_kind"):
        SamplingParams(output_kind=RequestOutputKind.DELTA)


def test_detokenize_false_gives_token_ids_only(llm):
    ids = llm.chat(CHAT, greedy(), use_tqdm=False)[0].outputs[0].token_ids
    out = llm.chat(CHAT, greedy(detokenize=False), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == ids and out.text == ""
    with pytest.raises(ValueError, match="detokenize"):
        SamplingParams(detokenize=False, stop=["x"])


def test_spaces_between_special_tokens_reaches_the_tokenizer(llm, monkeypatch):
    seen = []
    decode = llm.tokenizer.decode

    def spy(ids, **kwargs):
        seen.append(kwargs.get("spaces_between_special_tokens"))
        return decode(ids, **kwargs)

    monkeypatch.setattr(llm.tokenizer, "decode", spy)
    llm.chat(CHAT, greedy(max_tokens=2, spaces_between_special_tokens=False), use_tqdm=False)
    assert seen and set(seen) == {False}
    with pytest.raises(ValueError, match="spaces_between_special_tokens"):
        SamplingParams(spaces_between_special_tokens="no")


def test_no_logprobs_is_not_nan(llm):
    out = llm.chat(CHAT, greedy(logprobs=0), use_tqdm=False)[0].outputs[0]
    assert math.isfinite(out.cumulative_logprob)


# ---------------------------------------------------------------------------- the server, with the openai client


@pytest.fixture(scope="module")
def served_engine(qwen3_vl_dir):
    from tests.test_server import tiny_engine

    engine = tiny_engine(qwen3_vl_dir)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def client(served_engine):
    from tests.test_server import MODEL
    from vlmrun.server.launch import serve_in_thread
    from vlmrun.server.settings import ServerSettings

    server = serve_in_thread(served_engine, ServerSettings(served_model_name=MODEL))
    yield openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=60)
    server.stop()


def server_chat(client, messages=None, **kwargs):
    from tests.test_server import MODEL

    kwargs = {"temperature": 0, "max_tokens": 4, **kwargs}
    messages = messages or [{"role": "user", "content": "Name a colour."}]
    return client.chat.completions.create(model=MODEL, messages=messages, **kwargs)


def server_completion(client, **kwargs):
    from tests.test_server import MODEL

    kwargs = {"temperature": 0, "max_tokens": 4, **kwargs}
    return client.completions.create(model=MODEL, prompt="Once upon a time", **kwargs)


def streamed(create, client, **kwargs) -> list[dict]:
    """The chunks of a streamed answer, as dicts (vLLM's extra fields kept)."""
    return [chunk.model_dump() for chunk in create(client, stream=True, **kwargs)]


def check_prompt_logprobs(prompt_logprobs, prompt_ids: list[int], k: int) -> None:
    assert len(prompt_logprobs) == len(prompt_ids) and prompt_logprobs[0] is None
    for pos in range(1, len(prompt_ids)):
        entries = prompt_logprobs[pos]
        assert str(prompt_ids[pos]) in entries and len(entries) in (k, k + 1)
        ranks = sorted(e["rank"] for e in entries.values() if e["rank"] is not None)
        assert ranks == list(range(1, k + 1))
        assert all(e["logprob"] <= 0 and isinstance(e["decoded_token"], str) for e in entries.values())


def test_server_prompt_logprobs_and_token_ids(client):
    out = server_chat(client, extra_body={"prompt_logprobs": 2, "return_token_ids": True})
    body = out.model_dump()
    check_prompt_logprobs(body["prompt_logprobs"], body["prompt_token_ids"], 2)
    assert len(body["prompt_token_ids"]) == out.usage.prompt_tokens
    assert len(body["choices"][0]["token_ids"]) == out.usage.completion_tokens
    done = server_completion(client, extra_body={"prompt_logprobs": 1, "return_token_ids": True}).model_dump()
    choice = done["choices"][0]
    check_prompt_logprobs(choice["prompt_logprobs"], choice["prompt_token_ids"], 1)
    plain = server_chat(client).model_dump()
    assert plain.get("prompt_logprobs") is None and plain.get("prompt_token_ids") is None


def test_server_truncate_prompt_tokens(client):
    whole = server_completion(client)
    cut = server_completion(client, extra_body={"truncate_prompt_tokens": 2, "return_token_ids": True})
    assert cut.usage.prompt_tokens == 2 < whole.usage.prompt_tokens
    assert len(cut.model_dump()["choices"][0]["prompt_token_ids"]) == 2


@pytest.mark.parametrize("create", [server_chat, server_completion], ids=["chat", "completions"])
def test_server_streams_token_ids_as_collected(client, create):
    """Streamed return_token_ids: the prompt's ids once (chat: beside the first chunk's choices;
    completions: on the first chunk's choice) and each chunk's own ids, adding up to the collected ones."""
    whole = create(client, n=2, temperature=1.0, seed=3, extra_body={"return_token_ids": True}).model_dump()
    chunks = streamed(create, client, n=2, temperature=1.0, seed=3, extra_body={"return_token_ids": True})
    for index, expected in enumerate(whole["choices"]):
        mine = [c for chunk in chunks for c in chunk["choices"] if c["index"] == index]
        assert sum((c["token_ids"] for c in mine), []) == expected["token_ids"] and expected["token_ids"]
        if create is server_chat:
            prompt_ids = [chunk["prompt_token_ids"] for chunk in chunks
                          if chunk.get("prompt_token_ids") and chunk["choices"][0]["index"] == index]
            assert prompt_ids == [whole["prompt_token_ids"]]
        else:
            assert [c["prompt_token_ids"] for c in mine if c.get("prompt_token_ids")] == [expected["prompt_token_ids"]]


@pytest.mark.parametrize("create", [server_chat, server_completion], ids=["chat", "completions"])
def test_server_continuous_usage_stats(client, create):
    """Every chunk carries the usage so far (vLLM's counts: the choice's tokens up to that chunk); the
    last usage-only chunk stays; without include_usage vLLM sends none."""
    chunks = streamed(create, client, stream_options={"include_usage": True, "continuous_usage_stats": True},
                      extra_body={"return_token_ids": True})
    *per_chunk, last = chunks
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 4
    prompt_tokens, seen = last["usage"]["prompt_tokens"], 0
    for chunk in per_chunk:
        seen += len(chunk["choices"][0]["token_ids"])
        usage = chunk["usage"]
        assert (usage["prompt_tokens"], usage["completion_tokens"], usage["total_tokens"]) == (
            prompt_tokens, seen, prompt_tokens + seen)
    assert seen == 4
    quiet = streamed(create, client, stream_options={"continuous_usage_stats": True})
    assert all(chunk.get("usage") is None for chunk in quiet)


def test_server_continue_final_message_and_chat_echo(client, served_engine):
    """continue_final_message leaves the assistant's text open (the prompt ends in it, as the processor
    renders it); echo puts that text before the answer, collected and streamed; the role follows vLLM's
    rule (the last message's role without a generation prompt)."""
    chat = [{"role": "user", "content": "Tell me about the sea."}, {"role": "assistant", "content": "The sea is"}]
    cont = dict(extra_body={"add_generation_prompt": False, "continue_final_message": True, "return_token_ids": True})
    plain = server_chat(client, chat, **cont).model_dump()
    expected = served_engine.engine.processor.process_chat(chat, add_generation_prompt=False,
                                                          continue_final_message=True)
    assert plain["prompt_token_ids"] == list(expected.token_ids) and expected.text.endswith("The sea is")
    answer = plain["choices"][0]["message"]["content"]
    echo = dict(extra_body={**cont["extra_body"], "echo": True})
    echoed = server_chat(client, chat, **echo).choices[0].message
    assert echoed.content == "The sea is" + answer and echoed.role == "assistant"
    chunks = streamed(server_chat, client, messages=chat, **echo)
    assert "".join(c["delta"]["content"] or "" for chunk in chunks for c in chunk["choices"]) == echoed.content
    user_last = [{"role": "user", "content": "Tell me about the sea."}]
    reply = server_chat(client, user_last, extra_body={"echo": True}).choices[0].message  # not the reply's role
    assert reply.content == server_chat(client, user_last).choices[0].message.content
    as_user = server_chat(client, user_last, extra_body={"add_generation_prompt": False, "echo": True})
    assert as_user.choices[0].message.role == "user"
    assert as_user.choices[0].message.content.startswith("Tell me about the sea.")


def test_server_completions_echo_with_logprobs(client):
    """echo with logprobs: the prompt's tokens and logprobs (the first null) before the answer's, equal to
    prompt_logprobs and to the answer's own; streamed alike; max_tokens 0: the prompt alone."""
    plain = server_completion(client, logprobs=2, extra_body={"prompt_logprobs": 2, "return_token_ids": True})
    plain = plain.model_dump()["choices"][0]
    prompt_ids = plain["prompt_token_ids"]
    n = len(prompt_ids)
    echoed = server_completion(client, echo=True, logprobs=2).model_dump()["choices"][0]
    lp = echoed["logprobs"]
    assert echoed["text"] == "Once upon a time" + plain["text"]
    assert "".join(lp["tokens"][:n]) == "Once upon a time" and len(lp["tokens"]) == n + len(plain["token_ids"])
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    from_prompt = [plain["prompt_logprobs"][i][str(prompt_ids[i])]["logprob"] for i in range(1, n)]
    assert lp["token_logprobs"][1:n] == pytest.approx(from_prompt, abs=1e-4)
    assert lp["token_logprobs"][n:] == pytest.approx(plain["logprobs"]["token_logprobs"], abs=1e-4)
    assert all(len(top) <= 2 for top in lp["top_logprobs"][1:])
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(len(lp["tokens"]))]
    check_prompt_logprobs(echoed["prompt_logprobs"], prompt_ids, 2)  # vLLM also returns them on the choice
    chunks = streamed(server_completion, client, echo=True, logprobs=2)
    pieces = [c for chunk in chunks for c in chunk["choices"]]
    assert "".join(c["text"] for c in pieces) == echoed["text"]
    assert sum((c["logprobs"]["tokens"] for c in pieces if c["logprobs"]), []) == lp["tokens"]
    only = server_completion(client, echo=True, logprobs=1, max_tokens=0).choices[0]
    assert only.text == "Once upon a time" and len(only.logprobs.tokens) == n
    with pytest.raises(openai.BadRequestError) as err:
        server_completion(client, max_tokens=0)  # without echo there is nothing to answer
    assert err.value.body["param"] == "max_tokens"


@pytest.mark.parametrize("field, value", [("chat_template", "{{ messages }}"), ("continue_final_message", True),
                                          ("mm_processor_kwargs", {"crop": 1}), ("mm_processor_kwargs", {"fps": 0}),
                                          ("echo", "yes"), ("return_token_ids", 1),
                                          ("best_of", 3), ("prompt_logprobs", 25), ("truncate_prompt_tokens", 0),
                                          ("spaces_between_special_tokens", "yes")])
def test_server_refuses_chat_fields_it_cannot_act_on(client, field, value):
    """A 400 naming the field: a per-request template on a server started without
    --trust-request-chat-template, continue_final_message beside the default add_generation_prompt,
    processor options this engine lacks, and bad values."""
    with pytest.raises(openai.BadRequestError) as err:
        server_chat(client, extra_body={field: value})
    assert err.value.body["param"] == field


def test_server_refuses_streamed_prompt_logprobs(client):
    """As vLLM: prompt_logprobs are for collected answers only."""
    for create in (server_chat, server_completion):
        with pytest.raises(openai.BadRequestError) as err:
            create(client, stream=True, extra_body={"prompt_logprobs": 1})
        assert err.value.body["param"] == "prompt_logprobs"


@pytest.mark.parametrize("field, value", [
    ("use_beam_search", "yes"), ("priority", 1), ("logits_processors", ["my.Processor"]), ("cache_salt", ""),
    ("kv_transfer_params", {"do_remote_decode": True}), ("vllm_xargs", {"x": 1}), ("structural_tag", "{}"),
    ("guided_decoding_backend", "outlines"), ("guided_whitespace_pattern", " "),
    ("media_io_kwargs", {"video": {"num_frames": 2}}), ("prompt_embeds", "AAAA"), ("request_id", ""),
    ("return_tokens_as_token_ids", "yes"), ("include_reasoning", 1), ("documents", "text"),
    ("add_special_tokens", "no")])
def test_server_refuses_vllm_fields_it_has_no_counterpart_for(client, field, value):
    """vLLM's fields this server does not implement (or a bad value of one it does): a 400 naming the
    field, on both routes."""
    for create in (server_chat, server_completion):
        if create is server_completion and field in ("include_reasoning", "documents"):
            continue  # chat fields
        with pytest.raises(openai.BadRequestError) as err:
            create(client, extra_body={field: value})
        assert err.value.body["param"] == field


def test_server_refuses_stream_options_without_stream(client):
    """stream_options asks for streaming behaviour: without stream true it is a 400 (vLLM, OpenAI), not ignored."""
    for create in (server_chat, server_completion):
        with pytest.raises(openai.BadRequestError) as err:
            create(client, stream_options={"include_usage": True})
        assert err.value.body["param"] == "stream_options"


def test_server_accepts_the_values_that_ask_for_nothing(client):
    neutral = {"use_beam_search": False, "priority": 0, "logits_processors": [], "vllm_xargs": {},
               "kv_transfer_params": {}, "guided_decoding_backend": "xgrammar", "add_special_tokens": True}
    assert server_completion(client, extra_body=neutral).choices[0].text == server_completion(client).choices[0].text


def test_server_tokens_as_token_ids_and_request_id(client):
    """return_tokens_as_token_ids names logprob tokens "token_id:<id>" (prompt_logprobs keep their text);
    request_id becomes the answer's id, as in vLLM."""
    fields = {"return_tokens_as_token_ids": True, "return_token_ids": True}
    chat = server_chat(client, logprobs=True, top_logprobs=2, extra_body={**fields, "request_id": "abc"}).model_dump()
    assert chat["id"] == "chatcmpl-abc"
    content = chat["choices"][0]["logprobs"]["content"]
    assert [c["token"] for c in content] == [f"token_id:{t}" for t in chat["choices"][0]["token_ids"]]
    assert all(top["token"].startswith("token_id:") for c in content for top in c["top_logprobs"])
    done = server_completion(client, logprobs=1, extra_body={**fields, "request_id": "xyz", "prompt_logprobs": 1})
    choice = done.model_dump()["choices"][0]
    assert done.id == "cmpl-xyz" and choice["logprobs"]["tokens"] == [f"token_id:{t}" for t in choice["token_ids"]]
    assert not any(e["decoded_token"].startswith("token_id:") for p in choice["prompt_logprobs"][1:] for e in p.values())
    assert {chunk["id"] for chunk in streamed(server_chat, client, extra_body={"request_id": "abc"})} == {"chatcmpl-abc"}
    assert server_chat(client).id.startswith("chatcmpl-") and server_chat(client).id != server_chat(client).id


def test_server_include_reasoning_false_drops_the_reasoning(client):
    """An answer that continues an open <think> is reasoning; include_reasoning false leaves it out,
    collected and streamed."""
    thinking = [{"role": "user", "content": "Why?"}, {"role": "assistant", "content": "<think>\n"}]
    fields = {"add_generation_prompt": False, "continue_final_message": True}
    kept = server_chat(client, thinking, extra_body=fields).choices[0].message.model_dump()
    assert kept.get("reasoning_content")
    dropped = server_chat(client, thinking, extra_body={**fields, "include_reasoning": False}).choices[0].message
    assert dropped.model_dump().get("reasoning_content") is None
    chunks = streamed(server_chat, client, messages=thinking, extra_body={**fields, "include_reasoning": False})
    assert not any(c["delta"].get("reasoning_content") for chunk in chunks for c in chunk["choices"])
    assert any(c["delta"].get("reasoning_content")
               for chunk in streamed(server_chat, client, messages=thinking, extra_body=fields)
               for c in chunk["choices"])
