"""Structured outputs with speculative decoding: each verified position is masked by the grammar after
the drafts before it, a draft the grammar forbids is rejected, and the request's grammar advances only
over the tokens the step gives.

JSON schema, JSON object, regex and choice requests, and one that reasons freely before its grammar
(a thinking budget), greedy and seeded, give plain decode's tokens with n-gram drafts, with drafts
from reference runs (`OracleDrafts`: accepted whole, in part and not at all, every third one a token
the grammar mostly forbids) and with MTP drafts (the tiny random MTP layer's own, then reference runs'
put in its place on the device). `DraftGrammar` is checked on its own against matchers advanced by
hand.
"""

from __future__ import annotations

import shutil

import pytest
import torch

from testing.tiny_mtp import add_mtp_layer
from tests.test_async_scheduling import assert_pools_empty, assert_same, engine_options
from tests.test_spec_decode import SPEC, OracleDrafts, run, total
from tests.test_spec_decode_mtp import MTP, mtp_options
from tests.test_structured_outputs import check_text
from tests.test_structured_reasoning import THINKING_PROMPT, replay
from vlmrun import LLM, SamplingParams
from vlmrun.structured import StructuredOutputsParams
from vlmrun.structured.compiler import bitmask_words
from vlmrun.structured.reasoning import Phase, ReasoningGate
from vlmrun.spec_decode.grammar import DraftGrammar, FilledDraftGrammar

TAGS = {"type": "object", "properties": {"tags": {"type": "array", "items": {"enum": ["red", "blue"]},
                                                  "maxItems": 8}}, "required": ["tags"], "additionalProperties": False}
SPECS = [StructuredOutputsParams(json=TAGS), StructuredOutputsParams(regex="(abc-[0-9] ){2,6}"),
         StructuredOutputsParams(choice=["red blue red blue red blue", "one two one two"]),
         StructuredOutputsParams(json_object=True)]
PROMPTS = ["red blue red blue red blue red blue", "abc-1 abc-2 abc-1 abc-2 abc-1", "one two one two one two",
           '{"a": 1, "a": 1, "a": 1, "a": 1}']


def structured_scenario() -> tuple[list, list]:
    """Each spec greedy and seeded (temperature, top-k), a thinking request with an after-reasoning choice."""
    prompts, params = [], []
    for prompt, spec in zip(PROMPTS, SPECS):
        prompts += [prompt, prompt]
        params += [SamplingParams(max_tokens=24, temperature=0.0, structured_outputs=spec, logprobs=1),
                   SamplingParams(max_tokens=24, temperature=0.9, top_k=30, seed=11, structured_outputs=spec)]
    prompts.append(THINKING_PROMPT.format(q="red blue red blue red blue"))
    params.append(SamplingParams(max_tokens=24, temperature=0.0, thinking_token_budget=6,
                                 structured_outputs=StructuredOutputsParams(choice=["red blue red", "blue"],
                                                                            after_reasoning=True)))
    return prompts, params


def check_outputs(outputs: list, params: list) -> None:
    """Every output that its grammar ended satisfies it (the grammar saw every token it got)."""
    for out, p in zip(outputs, params):
        spec = p.structured_outputs
        if out.finish_reason == "stop" and not spec.after_reasoning:
            check_text(spec, out.text)


def references_of(outputs: list) -> list[list[int]]:
    return [out.prompt_token_ids + c.token_ids for out in outputs for c in out.outputs]


def test_structured_requests_with_ngram_and_reference_drafts(qwen3_dir):
    prompts, params = structured_scenario()
    plain, _ = run(qwen3_dir, prompts, params, None)
    check_outputs(plain, params)
    spec, _ = run(qwen3_dir, prompts, params, SPEC)
    assert_same(plain, spec)
    assert total(spec).num_drafts > 0

    llm = LLM(str(qwen3_dir), **engine_options(qwen3_dir, speculative_config=SPEC))
    llm.engine.scheduler.proposer = OracleDrafts(references_of(plain), 3, llm.engine.model_config.text_config.vocab_size)
    oracle = llm.generate(prompts, params, use_tqdm=False)
    assert_pools_empty(llm.engine)
    assert_same(plain, oracle)
    for out in oracle:
        stats = out.metrics.spec_decode
        assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens, out.text


@pytest.fixture(scope="module")
def qwen3_5_mtp_dir(qwen3_5_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("mtp_structured") / "model"
    shutil.copytree(qwen3_5_dir, out)
    return add_mtp_layer(out)


def test_structured_requests_with_mtp_drafts(qwen3_5_mtp_dir):
    """The tiny MTP layer's own drafts (rejected), then reference runs' drafts written over them on the
    device: the masks are made from the drafts read back from the device."""
    model_dir = qwen3_5_mtp_dir
    prompts, params = structured_scenario()
    plain, _ = run(model_dir, prompts, params, None, **mtp_options(model_dir))
    spec, _ = run(model_dir, prompts, params, MTP, **mtp_options(model_dir))
    assert_same(plain, spec)
    assert total(spec).num_draft_tokens > 0

    llm = LLM(str(model_dir), **mtp_options(model_dir, speculative_config=MTP))
    engine, drafter = llm.engine, llm.engine.executor.drafter
    oracle = OracleDrafts(references_of(plain), 3, engine.model_config.text_config.vocab_size)
    draft = drafter.draft

    def reference_drafts(chunks, backend, device):
        drafts = draft(chunks, backend, device)
        for i, c in enumerate(chunks):
            req = next(r for r in engine.requests.values() if r.req_pool_idx == c.row)
            tokens = req.prompt_token_ids + req.output_token_ids
            assert len(tokens) == c.start + 1
            wanted = oracle.propose(tokens, c.num_drafts)
            drafts[i, :len(wanted)] = torch.tensor(wanted, dtype=torch.int64)
        return drafts

    drafter.draft = reference_drafts
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert_pools_empty(engine)
    assert_same(plain, outputs)
    stats = total(outputs)
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens


def masks_by_hand(engine, spec, prefix: list[int], drafts: list[int]) -> list:
    """The mask after each draft from a fresh matcher fed prefix + the drafts (None once one is refused)."""
    state = engine.grammars.new_state(spec)
    for token in prefix:
        assert state.accept(token)
    masks, reachable = [], True
    for token in drafts:
        reachable = reachable and state.accept(token) and not state.is_terminated
        masks.append(state.filled().words if reachable else None)
    return masks


def test_draft_grammar_masks_follow_the_drafts(qwen3_dir):
    llm = LLM(str(qwen3_dir), dtype="float32", device="cpu", max_model_len=256)
    engine, tokenizer = llm.engine, llm.engine.tokenizer
    spec = StructuredOutputsParams(regex="(abc-[0-9] ){2,6}")
    valid = tokenizer.encode("abc-1 abc-2 abc-3 ", add_special_tokens=False)
    forbidden = tokenizer.encode("x", add_special_tokens=False)[0]
    state = engine.grammars.new_state(spec)
    assert state.accept(valid[0])
    before = state.filled().words
    for drafts in (valid[1:4], valid[1:2] + [forbidden] + valid[2:3], [forbidden] + valid[1:3]):
        masks = DraftGrammar(state).after_drafts(drafts)
        expected = masks_by_hand(engine, spec, valid[:1], drafts)
        assert len(masks) == len(drafts)
        for mask, words in zip(masks, expected):
            assert (mask is None) == (words is None)
            if mask is not None:
                assert torch.equal(mask.words, words)
        assert torch.equal(state.filled().words, before)  # the request's own state did not move
    assert DraftGrammar(state).after_drafts([forbidden, valid[1]]) == [None, None]
    filled = DraftGrammar(state).filled(valid[1:3])
    assert isinstance(filled, FilledDraftGrammar) and len(filled.after_drafts([0, 0])) == 2
    with pytest.raises(ValueError, match="2 drafts"):
        filled.after_drafts([0])
    # the walks were rolled back exactly: the request's own state goes on as an untouched one would
    for token, words in zip(valid[1:4], masks_by_hand(engine, spec, valid[:1], valid[1:4])):
        assert state.accept(token) and torch.equal(state.filled().words, words)

    # drafts that end the grammar (its EOS accepted): rolled back too
    red = StructuredOutputsParams(choice=["red", "blue"])
    ended = engine.grammars.new_state(red)
    finish = tokenizer.encode("red", add_special_tokens=False) + [engine.model_config.eos_token_ids[0]]
    masks = DraftGrammar(ended).after_drafts(finish)
    assert masks[-1] is None and not ended.is_terminated
    for token in finish:
        assert ended.accept(token)
    assert ended.is_terminated

    # a reasoning gate: no mask while thinking, the close forced at the budget, then the grammar's masks
    choice = StructuredOutputsParams(choice=["red", "blue"], after_reasoning=True)
    prompt = THINKING_PROMPT.format(q="q")
    gate = ReasoningGate.for_prompt(engine.reasoning_markers, engine.grammars.new_state(choice),
                                    engine.grammars.vocab_size, prompt, budget=2)
    thoughts = tokenizer.encode(" a b", add_special_tokens=False)[:2]
    drafts = thoughts + list(engine.reasoning_markers.close_ids) + tokenizer.encode("red", add_special_tokens=False)
    masks = DraftGrammar(gate).after_drafts(drafts)
    assert gate.phase == Phase.THINKING and gate.num_reasoning_tokens == 0  # untouched
    assert masks[0] is None  # still thinking after one token
    for j, mask in enumerate(masks[1:], start=2):  # the forced close, then the grammar's
        assert mask is not None and torch.equal(mask.words, gate_words(replay(llm, choice, prompt, drafts[:j], budget=2))), j
    # the gate goes on as an untouched one would (its phase, forced tokens and grammar rolled back)
    for j, token in enumerate(drafts, start=1):
        assert gate.accept(token)
        assert torch.equal(gate_words(gate), gate_words(replay(llm, choice, prompt, drafts[:j], budget=2))), j
    assert gate.phase == Phase.CONSTRAINED


def gate_words(gate: ReasoningGate) -> torch.Tensor:
    """The gate's next-token bitmask row (all ones while it thinks freely)."""
    words = torch.full((1, bitmask_words(gate.vocab_size)), -1, dtype=torch.int32)
    gate.fill_bitmask(words, 0)
    return words[0]
