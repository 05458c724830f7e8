"""The logits processors `logit_bias`, `allowed_token_ids` and `bad_words` (vLLM's SamplingParams
fields), through `LLM` and the OpenAI server, asserted by their effect on the tiny qwen3 model's
tokens: a +100 bias forces its token, a -100 bias on the greedy token changes the output, allowed
ids bound every sampled token, a bad word the unconstrained run writes never appears. They hold
beside a JSON-schema constraint, keep raw logprobs, and give the same tokens under preemption,
async scheduling and tensor parallel (TP=2) as the synchronous single-device engine.

What the tiny model writes (greedy, float32, each prompt a user turn in the chat template): "Tell me a story." repeats the one-token word "This";
"Describe the scene." repeats "tto", so the two-token word "ttotto" ([390, 390]) appears.
"""

from __future__ import annotations

import json

import openai
import pytest
import torch

from tests.server_fixtures import served_fixtures, wait_until_idle
from tests.test_tensor_parallel import engine_options
from vlmrun import LLM, SamplingParams
from vlmrun.layers.sampler import Sampler
from vlmrun.layers.sampling_batch import SamplingBatch, SamplingRow
from vlmrun.sampling_params import SamplingParamError
from vlmrun.structured import StructuredOutputsParams

STORY = "Tell me a story."  # greedy: "... This This This ..."
SCENE = "Describe the scene."  # greedy: "... tto tto tto ..."
MODEL = "tiny-qwen3"


@pytest.fixture(scope="module")
def llm(qwen3_dir) -> LLM:
    return LLM(str(qwen3_dir), dtype="float32", device="cpu", max_model_len=512)


def greedy(**kwargs) -> SamplingParams:
    return SamplingParams(**{"temperature": 0.0, "max_tokens": 16, "ignore_eos": True, **kwargs})


def run(llm: LLM, prompts: list[str], params) -> list:
    """Each prompt as one user turn through the chat template."""
    outputs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params, use_tqdm=False)
    assert all(o.error is None for o in outputs), [o.error for o in outputs]
    return outputs


# ---------------------------------------------------------------------------- validation


@pytest.mark.parametrize("field, value", [
    ("logit_bias", {1: float("nan")}), ("logit_bias", {"1": 2.0}), ("logit_bias", {-1: 2.0}), ("logit_bias", [1]),
    ("allowed_token_ids", []), ("allowed_token_ids", [1.0]), ("allowed_token_ids", [-3]),
    ("bad_words", "word"), ("bad_words", [" "]), ("bad_words", [3]),
])
def test_bad_values_name_their_field(field, value):
    with pytest.raises(SamplingParamError) as info:
        SamplingParams(**{field: value})
    assert info.value.field == field


@pytest.mark.parametrize("field, value", [("logit_bias", {512: 1.0}), ("allowed_token_ids", [3, 512])])
def test_add_request_refuses_token_ids_past_the_vocabulary(llm, field, value):
    engine = llm.engine
    assert engine.model_config.text_config.vocab_size == 512
    with pytest.raises(SamplingParamError) as info:
        engine.add_request("outside", engine.process(STORY), greedy(**{field: value}))
    assert info.value.field == field
    assert "outside" not in engine.requests


def test_bad_words_are_tokenized_alone_and_after_a_space_as_vllm_does(llm):
    tokenizer = llm.engine.tokenizer
    params = SamplingParams(bad_words=["ttotto", " This", "at"]).tokenize_bad_words(tokenizer)
    alone = [tokenizer.encode(w, add_special_tokens=False) for w in ("ttotto", "This", "at")]
    spaced_at = tokenizer.encode(" at", add_special_tokens=False)
    # " ttotto" and " This" tokenize to more tokens than alone: vLLM keeps only the bare form then;
    # " at" is one other token: both forms are banned
    assert len(spaced_at) == 1 and spaced_at != alone[2]
    assert params.bad_words_token_ids == [alone[0], alone[1], alone[2], spaced_at]


# ---------------------------------------------------------------------------- effects


def test_plus_100_bias_forces_a_token_and_minus_100_changes_the_greedy_one(llm):
    plain = run(llm, [STORY], greedy())[0]
    forced_token = 263  # "at": not what the model writes
    assert forced_token not in plain.token_ids
    forced = run(llm, [STORY, STORY], [greedy(logit_bias={forced_token: 100.0}),
                                       SamplingParams(max_tokens=16, ignore_eos=True, temperature=1.0, seed=5,
                                                      logit_bias={forced_token: 100.0})])
    assert all(o.token_ids == [forced_token] * 16 for o in forced)
    first = plain.token_ids[0]
    pushed = run(llm, [STORY], greedy(logit_bias={first: -100.0}))[0]
    assert pushed.token_ids[0] != first
    assert pushed.token_ids != plain.token_ids


def test_allowed_token_ids_bound_every_sampled_token(llm):
    allowed = [11, 263, 370, 390, 420]
    params = [greedy(allowed_token_ids=allowed),
              SamplingParams(max_tokens=24, ignore_eos=True, temperature=1.5, seed=11, allowed_token_ids=allowed),
              SamplingParams(max_tokens=24, ignore_eos=True, temperature=1.5, seed=12)]  # unconstrained
    outputs = run(llm, [STORY, SCENE, SCENE], params)
    assert all(set(o.token_ids) <= set(allowed) for o in outputs[:2])
    assert not set(outputs[2].token_ids) <= set(allowed)  # the same sampling without the list leaves it


def test_bad_words_never_appear_while_the_unconstrained_run_writes_them(llm):
    plain = run(llm, [STORY, SCENE], greedy(max_tokens=24))
    assert "This" in plain[0].text and "ttotto" in plain[1].text
    banned = run(llm, [STORY, SCENE, SCENE],
                 [greedy(max_tokens=24, bad_words=["This"]), greedy(max_tokens=24, bad_words=["ttotto"]),
                  SamplingParams(max_tokens=24, ignore_eos=True, temperature=1.0, seed=3, bad_words=["ttotto"])])
    assert "This" not in banned[0].text
    assert "ttotto" not in banned[1].text and "ttotto" not in banned[2].text
    assert 390 in banned[1].token_ids  # "tto" alone is fine; only a second one in a row is banned


def test_logit_bias_with_a_json_schema_still_parses(llm):
    schema = {"type": "object", "properties": {"colour": {"enum": ["red", "green"]}, "n": {"type": "integer"}},
              "required": ["colour", "n"]}
    structured = StructuredOutputsParams(json=schema)
    quote_token = llm.engine.tokenizer.encode('"', add_special_tokens=False)[0]
    outputs = run(llm, [SCENE, SCENE], [
        greedy(max_tokens=60, ignore_eos=False, structured_outputs=structured,
               logit_bias={370: 100.0, 263: 100.0}),  # tokens the grammar never allows first
        greedy(max_tokens=60, ignore_eos=False, structured_outputs=structured, allowed_token_ids=None,
               bad_words=["This"], logit_bias={quote_token: -100.0})])
    for out in outputs:
        value = json.loads(out.text)
        assert set(value) == {"colour", "n"} and value["colour"] in ("red", "green")


def test_logprobs_stay_raw_under_the_processors(llm):
    """As vLLM's default logprobs_mode ("raw_logprobs"): the model's distribution before any processor."""
    plain = run(llm, [STORY], greedy(max_tokens=1, logprobs=3))[0]
    first = plain.token_ids[0]
    pushed = run(llm, [STORY], greedy(max_tokens=1, logprobs=3, logit_bias={first: -100.0}))[0]
    assert pushed.token_ids[0] != first and pushed.token_ids[0] in plain.logprobs[0]  # the raw runner-up
    assert pushed.logprobs[0].keys() == plain.logprobs[0].keys()
    for token, value in plain.logprobs[0].items():
        assert abs(pushed.logprobs[0][token] - value) < 1e-6


def test_the_bias_comes_before_the_penalties_as_in_vllm():
    """Token 0 was generated (repetition penalty 2) and gets a +2 bias: (2 + 2) / 2 = 2 < 2.5, so token 1
    wins; the other order would give 2 / 2 + 2 = 3 and pick token 0."""
    logits = torch.tensor([[2.0, 2.5, -1.0, -1.0]])
    params = greedy(repetition_penalty=2.0, logit_bias={0: 2.0})
    batch = SamplingBatch.build([SamplingRow(params, prompt_token_ids=[3], output_token_ids=[0])], vocab_size=4)
    assert Sampler().sample(logits, batch).token_ids.tolist() == [1]


# ---------------------------------------------------------------------------- schedules


def mixed_batch() -> tuple[list, list]:
    """Every processor, alone and with penalties, greedy and seeded, in one batch."""
    prompts = [STORY, SCENE, SCENE, STORY, "Count from one to ten.", SCENE]
    params = [greedy(max_tokens=30, bad_words=["This"]),
              greedy(max_tokens=30, bad_words=["ttotto"]),  # reads its last output: waits for it (async)
              SamplingParams(max_tokens=30, ignore_eos=True, temperature=1.0, seed=4, bad_words=["ttotto", "ctu"]),
              greedy(max_tokens=30, logit_bias={263: 5.0, 370: -100.0}, frequency_penalty=0.5),
              SamplingParams(max_tokens=30, ignore_eos=True, temperature=0.8, seed=9,
                             allowed_token_ids=[11, 263, 370, 390, 420]),
              greedy(max_tokens=30, bad_words=["ttotto"], repetition_penalty=1.3)]
    return prompts, params


def test_preemption_async_scheduling_and_tp2_give_the_synchronous_tokens(qwen3_dir):
    prompts, params = mixed_batch()
    reference = LLM(str(qwen3_dir), dtype="float32", device="cpu", max_model_len=512)
    expected = [o.token_ids for o in run(reference, prompts, params)]
    assert reference.engine.stats().num_preemptions == 0
    small = engine_options(qwen3_dir, 1)  # a KV pool too small for the batch: requests are preempted
    for options in ({**small, "async_scheduling": False}, {**small, "async_scheduling": True},
                    engine_options(qwen3_dir, 2)):
        llm = LLM(str(qwen3_dir), **options)
        try:
            schedule = {name: options.get(name) for name in ("async_scheduling", "tensor_parallel_size")}
            assert [o.token_ids for o in run(llm, prompts, params)] == expected, schedule
            assert llm.engine.stats().num_preemptions > 0
        finally:
            llm.engine.shutdown()


# ---------------------------------------------------------------------------- server


engine, server, client = served_fixtures("qwen3_dir", served_model_name=MODEL)


def test_server_applies_logit_bias_allowed_token_ids_and_bad_words(client, engine):
    tokenizer = engine.tokenizer
    at = tokenizer.encode("at", add_special_tokens=False)[0]
    forced = client.completions.create(model=MODEL, prompt=STORY, max_tokens=6, temperature=0,
                                       logit_bias={str(at): 250}, extra_body={"ignore_eos": True})
    assert forced.choices[0].text == "at" * 6
    from vlmrun.server.logits_processor_fields import logits_processor_fields
    assert logits_processor_fields({"logit_bias": {str(at): 250, "7": -300}})["logit_bias"] == {at: 100.0, 7: -100.0}
    scene = [{"role": "user", "content": SCENE}]
    plain = client.chat.completions.create(model=MODEL, messages=scene, max_tokens=24, temperature=0,
                                           extra_body={"ignore_eos": True})
    assert "ttotto" in plain.choices[0].message.content
    banned = client.chat.completions.create(model=MODEL, messages=scene, max_tokens=24, temperature=0,
                                            extra_body={"ignore_eos": True, "bad_words": ["ttotto"]})
    assert "ttotto" not in banned.choices[0].message.content
    allowed = [11, 263, 370, 390, 420]
    bounded = client.chat.completions.create(model=MODEL, messages=scene, max_tokens=24, temperature=1.0, seed=2,
                                             logprobs=True, extra_body={"ignore_eos": True,
                                                                        "allowed_token_ids": allowed})
    assert {t.token for t in bounded.choices[0].logprobs.content} <= {tokenizer.decode([t]) for t in allowed}
    wait_until_idle(engine)


@pytest.mark.parametrize("extra, field", [
    ({"logit_bias": {"512": 1}}, "logit_bias"), ({"logit_bias": {"x": 1}}, "logit_bias"),
    ({"logit_bias": {"3": "high"}}, "logit_bias"), ({"allowed_token_ids": [9999]}, "allowed_token_ids"),
    ({"allowed_token_ids": []}, "allowed_token_ids"), ({"bad_words": "word"}, "bad_words"),
])
def test_server_refuses_bad_processor_fields_with_a_400_naming_them(client, engine, extra, field):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt=STORY, max_tokens=2, extra_body=extra)
    assert info.value.body["param"] == field
    wait_until_idle(engine)
