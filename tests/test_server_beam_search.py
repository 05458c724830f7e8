"""`use_beam_search` on the server (vLLM's request field): the search `LLM.beam_search` runs, as choices.

The width is `best_of` (else `n`), `n` sequences come back best first with their output text and
logprobs; streaming it, a `best_of` below `n` and per-sequence constraints are 400s naming the field.
"""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.test_server import MODEL, client, engine, server  # noqa: F401 (fixtures)
from tests.test_vllm_api import llm  # noqa: F401 (fixture)
from vlmrun.beam_search import BeamSearchParams

BEAM = {"use_beam_search": True, "best_of": 3, "length_penalty": 0.5, "ignore_eos": True, "return_token_ids": True}


def _best(llm, prompt, n: int) -> list:
    out = llm.beam_search([prompt], BeamSearchParams(beam_width=3, max_tokens=5, ignore_eos=True, length_penalty=0.5))
    return out[0].sequences[:n]


def test_completions_beams_equal_llm_beam_search(client, llm):
    prompts = ["Tell me a story.", "Once upon a time"]
    answer = client.completions.create(model=MODEL, prompt=prompts, n=2, max_tokens=5, temperature=0, logprobs=2,
                                       extra_body=BEAM)
    assert len(answer.choices) == 4
    for p, prompt in enumerate(prompts):
        want = _best(llm, prompt, 2)
        got = [c for c in answer.choices if c.index // 2 == p]
        assert [c.model_extra["token_ids"] for c in got] == [s.output_token_ids for s in want]
        assert [c.text for c in got] == [llm.get_tokenizer().decode(s.output_token_ids) for s in want]
        assert all(c.finish_reason == "length" and len(c.logprobs.tokens) == 5 for c in got)
    assert answer.usage.completion_tokens == 20


def test_chat_beams_equal_llm_beam_search(client, llm):
    messages = [{"role": "user", "content": "Name a colour."}]
    answer = client.chat.completions.create(model=MODEL, messages=messages, n=2, max_tokens=5, temperature=0,
                                            extra_body=BEAM)
    templated = llm.get_tokenizer().apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    want = _best(llm, templated, 2)
    assert [c.model_extra["token_ids"] for c in answer.choices] == [s.output_token_ids for s in want]
    assert [c.message.content for c in answer.choices] == [llm.get_tokenizer().decode(s.output_token_ids)
                                                           for s in want]


@pytest.mark.parametrize("extra, param", [
    ({"stream": True}, "stream"), ({"best_of": 1, "n": 2}, "best_of"), ({"stop": ["x"]}, "stop"),
    ({"best_of": 11}, "best_of"), ({"use_beam_search": "yes"}, "use_beam_search"),
])
def test_refused_naming_the_field(server, extra, param):
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 3, "use_beam_search": True, **extra}
    answer = httpx.post(server.base_url + "/v1/completions", json=body, timeout=60)
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["param"] == param


def test_without_beam_search_nothing_changes(client):
    """use_beam_search false (vLLM's default) is a plain request."""
    plain = client.completions.create(model=MODEL, prompt="Hi", max_tokens=3, temperature=0)
    off = client.completions.create(model=MODEL, prompt="Hi", max_tokens=3, temperature=0,
                                    extra_body={"use_beam_search": False})
    assert plain.choices[0].text == off.choices[0].text
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="Hi", max_tokens=3, extra_body={"best_of": 2})
