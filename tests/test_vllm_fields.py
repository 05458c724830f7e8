"""vLLM's output fields and SamplingParams fields (issue 30), each asserted by its effect or its refusal.

`RequestOutput.prompt`, `.metrics`, `CompletionOutput.cumulative_logprob` and `.stop_reason`;
`truncate_prompt_tokens`, `output_kind`, `detokenize`, `spaces_between_special_tokens`. The server's
fields (`prompt_logprobs`, `return_token_ids`, `stream_options.continuous_usage_stats`, and the 400s
naming the fields it refuses) are driven with the `openai` client.
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
def client(qwen3_vl_dir):
    from tests.test_server import MODEL, tiny_engine
    from vlmrun.server.launch import serve_in_thread
    from vlmrun.server.settings import ServerSettings

    engine = tiny_engine(qwen3_vl_dir)
    server = serve_in_thread(engine, ServerSettings(served_model_name=MODEL))
    yield openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=60)
    server.stop()
    engine.shutdown()


def server_chat(client, **kwargs):
    from tests.test_server import MODEL

    return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Name a colour."}],
                                          temperature=0, max_tokens=4, **kwargs)


def server_completion(client, **kwargs):
    from tests.test_server import MODEL

    return client.completions.create(model=MODEL, prompt="Once upon a time", temperature=0, max_tokens=4, **kwargs)


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


@pytest.mark.parametrize("field, value", [("echo", True), ("chat_template", "{{ messages }}"),
                                          ("continue_final_message", True), ("mm_processor_kwargs", {"fps": 1}),
                                          ("best_of", 3), ("prompt_logprobs", 25), ("truncate_prompt_tokens", 0),
                                          ("spaces_between_special_tokens", "yes")])
def test_server_refuses_chat_fields_it_does_not_act_on(client, field, value):
    with pytest.raises(openai.BadRequestError) as err:
        server_chat(client, extra_body={field: value})
    assert err.value.body["param"] == field


def test_server_refuses_what_it_cannot_stream(client):
    for field, value in (("prompt_logprobs", 1), ("return_token_ids", True)):
        with pytest.raises(openai.BadRequestError) as err:
            server_chat(client, stream=True, extra_body={field: value})
        assert err.value.body["param"] == field
    with pytest.raises(openai.BadRequestError) as err:
        server_chat(client, stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True})
    assert err.value.body["param"] == "stream_options"
    with pytest.raises(openai.BadRequestError) as err:
        server_completion(client, echo=True, logprobs=1)
    assert err.value.body["param"] == "echo"
