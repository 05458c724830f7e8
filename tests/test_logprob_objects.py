"""vLLM's `Logprob` objects (`vlmrun/logprobs.py`) and the sorting of vLLM's `LLM` keywords (`llm_options.py`),
as plain functions: ranks from the engine's dict order and `chosen_rank`, pickling (tensor-parallel ranks
send the engine's dicts), and the keyword rules."""

from __future__ import annotations

import copy
import math
import pickle

import pytest

from vlmrun.llm_options import engine_kwargs
from vlmrun.logprobs import Logprob, TokenLogprobs, cumulative_logprob, position_logprobs, prompt_logprobs


def decode(token_id: int) -> str:
    return f"<{token_id}>"


def test_logprob_is_vllms_object_and_a_float():
    lp = Logprob(-0.25, 1, "a")
    assert (lp.logprob, lp.rank, lp.decoded_token) == (-0.25, 1, "a")
    assert lp + 0.25 == 0.0 and math.isfinite(lp) and type(lp.logprob) is float
    assert repr(lp) == "Logprob(logprob=-0.25, rank=1, decoded_token='a')"
    for again in (pickle.loads(pickle.dumps(lp)), copy.deepcopy(lp)):
        assert (again.logprob, again.rank, again.decoded_token) == (-0.25, 1, "a")


def test_ranks_follow_the_top_k_and_the_counted_rank_of_the_chosen_token():
    raw = TokenLogprobs({5: -0.1, 7: -1.0, 9: -4.0}, chosen_rank=12)  # top 2, then the sampled 9
    out = position_logprobs(raw, chosen=9, top_k=2, decode=decode)
    assert [(t, lp.rank, lp.decoded_token) for t, lp in out.items()] == [(5, 1, "<5>"), (7, 2, "<7>"), (9, 12, "<9>")]
    inside = position_logprobs(TokenLogprobs({5: -0.1, 7: -1.0}, chosen_rank=2), chosen=7, top_k=2, decode=decode)
    assert [lp.rank for lp in inside.values()] == [1, 2]
    plain = position_logprobs({5: -0.1, 9: -4.0}, chosen=9, top_k=1, decode=decode)  # no count: None outside
    assert [lp.rank for lp in plain.values()] == [1, None]


def test_token_logprobs_travel_with_their_rank():
    raw = TokenLogprobs({1: -0.5}, chosen_rank=3)
    for again in (pickle.loads(pickle.dumps(raw)), copy.deepcopy(raw)):
        assert again == {1: -0.5} and again.chosen_rank == 3


def test_prompt_and_cumulative():
    raws = [None, TokenLogprobs({4: -2.0, 8: -0.5}, chosen_rank=2)]
    out = prompt_logprobs(raws, [3, 4], top_k=1, decode=decode)
    assert out[0] is None and out[1][4].rank == 2 and out[1][8].rank == 1
    assert cumulative_logprob([{1: -0.5}, {2: -0.25}], [1, 2]) == -0.75 and cumulative_logprob(None, []) is None


FIELDS = {"page_size", "seed", "max_model_len"}


def test_llm_keywords():
    assert engine_kwargs("m", None, {"block_size": 32, "seed": None}, FIELDS) == {"page_size": 32, "seed": 0}
    assert engine_kwargs("m", None, {"trust_remote_code": True, "swap_space": 4, "tokenizer": "m/"}, FIELDS) == {}
    assert engine_kwargs("m", None, {"kv_cache_dtype": "fp8"}, FIELDS | {"kv_cache_dtype"}) == {"kv_cache_dtype": "fp8"}
    assert engine_kwargs("m", None, {"override_pooler_config": {"normalize": False}}, FIELDS) == {
        "pooler_config": {"normalize": False}}  # vLLM's older name
    with pytest.raises(ValueError, match=r"cpu_offload_gb=4\) is not supported"):
        engine_kwargs("m", None, {"cpu_offload_gb": 4}, FIELDS)
    with pytest.raises(ValueError, match="tokenizer_revision"):
        engine_kwargs("m", "main", {"tokenizer_revision": "other"}, FIELDS)
    assert engine_kwargs("m", None, {"unknown_option": 1}, FIELDS) == {"unknown_option": 1}  # EngineConfig refuses it
