"""Structured outputs after reasoning: free `<think>…</think>`, then the grammar (engine and gate).

The tiny random checkpoint writes noise, so its reasoning never closes by itself: the tests give
prompts that end inside `<think>` (as thinking templates do) and a `thinking_token_budget`, which
forces `</think>` after that many noise tokens; the gate's own paths (a natural `</think>` however
it is tokenized, `<think>` opened by the model, text carried past the marker) are driven with token
sequences. Checked: every output that ends by its grammar parses after a free reasoning part;
reasoning tokens escape the grammar (no mask while thinking); a fresh gate replays an output to the
same state (preemption, prefix hits); thinking turned off constrains from the first token.
"""

from __future__ import annotations

import shutil

import pytest
from hypothesis import given
from hypothesis import strategies as st

from vlmrun.api import LLM
from vlmrun.sampling_params import SamplingParamError, SamplingParams
from vlmrun.structured import StructuredOutputsParams
from vlmrun.structured.reasoning import Phase, ReasoningGate, ReasoningMarkers, split_reasoning
from tests.test_structured_outputs import MAX_TOKENS, PROPERTY, SPECS, check_text, tight, unpack_bitmask  # noqa: F401

THINKING_PROMPT = "<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n<think>\n"
NO_THINKING_PROMPT = "<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
SHAPE = {"type": "object", "properties": {"colour": {"enum": ["red", "blue"]}, "n": {"type": "integer"}},
         "required": ["colour", "n"], "additionalProperties": False}


@pytest.fixture(scope="module")
def llm(qwen3_dir):
    return LLM(str(qwen3_dir), dtype="float32", device="cpu")


def after_reasoning(spec: StructuredOutputsParams) -> StructuredOutputsParams:
    return StructuredOutputsParams(**{**spec.__dict__, "after_reasoning": True})


def replay(llm: LLM, spec, prompt: str, token_ids: list[int], budget=None) -> ReasoningGate:
    """A fresh gate for the prompt fed the output: every token accepted (what preemption relies on)."""
    engine = llm.engine
    gate = ReasoningGate.for_prompt(engine.reasoning_markers, engine.grammars.new_state(spec),
                                    engine.grammars.vocab_size, prompt, budget)
    for token in token_ids:
        assert gate.accept(token), f"token {token} breaks the gate in phase {gate.phase}"
    return gate


def check_reasoned(llm: LLM, spec, prompt: str, out, budget) -> str:
    """The output thought (at most `budget` tokens), closed its think, then followed its grammar."""
    completion = out.outputs[0]
    assert out.error is None, out.error
    gate = replay(llm, spec, prompt, completion.token_ids, budget)
    reasoning, content = split_reasoning(completion.text, prompt)
    assert gate.num_reasoning_tokens <= budget
    if completion.finish_reason == "length":
        assert len(completion.token_ids) == MAX_TOKENS
        return reasoning
    assert completion.finish_reason == "stop" and gate.is_terminated
    constrained = completion.text.split("</think>", 1)[1]  # the grammar's part, exactly
    assert content == constrained.lstrip("\n")  # the parsers drop the newlines after </think>
    check_text(spec, constrained)
    return reasoning


# ---------------------------------------------------------------------------- the engine


@PROPERTY
@given(specs=st.lists(SPECS, min_size=1, max_size=3), budget=st.integers(0, 8),
       temperature=st.sampled_from([0.0, 0.8]), question=st.text(alphabet="abc xyz", min_size=1, max_size=12))
def test_constrained_output_after_free_reasoning_parses(llm, specs, budget, temperature, question):
    prompt = THINKING_PROMPT.format(q=question)
    specs = [after_reasoning(s) for s in specs]
    params = [SamplingParams(max_tokens=MAX_TOKENS, temperature=temperature, seed=i, structured_outputs=s,
                             thinking_token_budget=budget) for i, s in enumerate(specs)]
    outs = llm.generate([prompt] * len(specs) + [question], params + [SamplingParams(max_tokens=5)],
                        use_tqdm=False)
    for spec, out in zip(specs, outs):
        check_reasoned(llm, spec, prompt, out, budget)
    assert outs[-1].error is None


def test_no_mask_while_thinking(llm):
    # The reasoning is free: its tokens include ones the grammar would refuse at its start.
    spec = StructuredOutputsParams(choice=["yes", "no"], after_reasoning=True)
    prompt = THINKING_PROMPT.format(q="yes or no?")
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, structured_outputs=spec,
                            thinking_token_budget=12)
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    reasoning = check_reasoned(llm, spec, prompt, out, 12)
    assert out.outputs[0].text.endswith(("yes", "no"))
    refused = [t for t in out.token_ids[:12] if not llm.engine.grammars.new_state(spec).accept(t)]
    assert refused and reasoning, "the reasoning tokens all fit the grammar: was it masked?"


def test_thinking_turned_off_constrains_from_the_first_token(llm):
    spec = StructuredOutputsParams(json=SHAPE, after_reasoning=True)
    prompt = NO_THINKING_PROMPT.format(q="shape?")
    out = llm.generate([prompt],
                       SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, structured_outputs=spec),
                       use_tqdm=False)[0]
    assert out.finish_reason == "stop"
    check_text(spec, out.text)
    gate = replay(llm, spec, prompt, out.token_ids)
    assert gate.num_reasoning_tokens == 0 and gate.is_terminated


def test_budget_without_a_grammar_closes_the_think(llm):
    prompt = THINKING_PROMPT.format(q="think briefly")
    out = llm.generate([prompt],
                       SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, thinking_token_budget=5),
                       use_tqdm=False)[0]
    close = llm.engine.reasoning_markers.close_ids
    assert tuple(out.token_ids[5:5 + len(close)]) == close  # 5 free tokens, then the forced </think>


def test_reasoning_replays_under_preemption_and_chunked_prefill(llm, tight):
    spec = StructuredOutputsParams(json=SHAPE, after_reasoning=True)
    prompts = [THINKING_PROMPT.format(q=f"filler {i} " * 4) for i in range(6)]
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, structured_outputs=spec,
                            thinking_token_budget=10)
    before = tight.engine.scheduler.num_preemptions
    squeezed = tight.generate(prompts, params, use_tqdm=False)
    assert tight.engine.scheduler.num_preemptions > before
    alone = llm.generate([prompts[-1]], params, use_tqdm=False)[0]
    for prompt, out in zip(prompts, squeezed):
        check_reasoned(tight, spec, prompt, out, 10)
    assert squeezed[-1].token_ids == alone.token_ids


def test_the_model_may_open_a_think_when_it_is_one_token(llm):
    # Stand-in single-token markers (the tiny tokenizer spells <think> in several tokens): with the
    # grammar's first tokens the model may also pick the opening one; either way the output is valid.
    engine = llm.engine
    markers = ReasoningMarkers.from_tokenizer(engine.tokenizer, "<|vision_start|>", "<|vision_end|>")
    assert len(markers.open_ids) == 1 and len(markers.close_ids) == 1
    saved, engine.reasoning_markers = engine.reasoning_markers, markers
    try:
        spec = StructuredOutputsParams(choice=["ab", "cd"], after_reasoning=True)
        params = [SamplingParams(max_tokens=MAX_TOKENS, temperature=1.5, seed=s, structured_outputs=spec,
                                 thinking_token_budget=3) for s in range(24)]
        outs = llm.generate(["q"] * len(params), params, use_tqdm=False)
    finally:
        engine.reasoning_markers = saved
    opened = 0
    for out in outs:
        ids = out.token_ids
        if ids[0] == markers.open_ids[0]:
            opened += 1
            assert ids[4] == markers.close_ids[0]  # 3 reasoning tokens, then the forced close
            ids = ids[5:]
        assert engine.tokenizer.decode(ids, skip_special_tokens=True) in spec.choice and out.finish_reason == "stop"
    assert opened, "no sample opened a think"


def test_llm_chat_with_a_thinking_template(qwen3_dir, tmp_path):
    from tests.test_server_reasoning_tools import THINKING_TEMPLATE

    model_dir = tmp_path / "thinking"
    shutil.copytree(qwen3_dir, model_dir)
    (model_dir / "chat_template.jinja").write_text(THINKING_TEMPLATE, encoding="utf-8")
    llm = LLM(str(model_dir), dtype="float32", device="cpu")
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, thinking_token_budget=4,
                            structured_outputs={"json": SHAPE, "after_reasoning": True})
    conversation = [{"role": "user", "content": "shape?"}]
    thought = llm.chat(conversation, params, use_tqdm=False)[0]
    reasoning, content = split_reasoning(thought.text)
    assert reasoning and thought.finish_reason == "stop"
    check_text(params.structured_outputs, content)
    direct = llm.chat(conversation, params, use_tqdm=False, chat_template_kwargs={"enable_thinking": False})[0]
    assert "</think>" not in direct.text and direct.finish_reason == "stop"
    check_text(params.structured_outputs, direct.text)


# ---------------------------------------------------------------------------- the gate, token by token


def test_where_an_output_starts():
    markers = ReasoningMarkers((1,), (2,), str)
    assert markers.start_phase("...assistant\n<think>\n") == Phase.THINKING
    assert markers.start_phase("...assistant\n<think>\n\n</think>\n\n") == Phase.CONSTRAINED
    assert markers.start_phase("...assistant\n") == Phase.OPENING
    several = ReasoningMarkers((1, 3), (2, 4), str)
    assert several.start_phase("...assistant\n") == Phase.CONSTRAINED


@pytest.mark.parametrize("pieces", [["hm", "m </", "think", ">"], ["</think>"], ["a<", "/th", "ink", ">\n\n"]])
def test_a_natural_close_is_found_however_it_is_tokenized(llm, pieces):
    engine = llm.engine
    texts = dict(enumerate(pieces, start=1000))
    markers = ReasoningMarkers((1,), (2,), lambda t: texts.get(t, engine.tokenizer.decode([t])))
    spec = StructuredOutputsParams(choice=["ab", "cd"])
    gate = ReasoningGate.for_prompt(markers, engine.grammars.new_state(spec), engine.grammars.vocab_size,
                                    "<think>\n")
    for token in texts:
        assert not gate.reasoning_ended and not gate.constraining
        assert gate.accept(token)
    assert gate.reasoning_ended and gate.constraining and gate.num_reasoning_tokens == len(pieces)
    for token in engine.tokenizer.encode("cd") + engine.model_config.eos_token_ids[:1]:
        assert gate.accept(token)
    assert gate.is_terminated


def test_text_carried_past_the_close_is_fed_to_the_grammar(llm):
    engine = llm.engine
    markers = ReasoningMarkers((1,), (2,), lambda t: {7000: "</think>\n\nc"}.get(t, engine.tokenizer.decode([t])))
    gate = ReasoningGate.for_prompt(markers, engine.grammars.new_state(StructuredOutputsParams(choice=["cd"])),
                                    engine.grammars.vocab_size, "<think>")
    assert gate.accept(7000) and gate.reasoning_ended
    assert gate.accept(engine.tokenizer.encode("d")[0]) and gate.accept(engine.model_config.eos_token_ids[0])
    assert gate.is_terminated


def test_opening_allows_the_grammar_and_the_think_token(llm):
    engine = llm.engine
    tokenizer = engine.tokenizer
    markers = ReasoningMarkers.from_tokenizer(tokenizer, "<|vision_start|>", "<|vision_end|>")
    spec = StructuredOutputsParams(choice=["ab"])
    vocab = engine.grammars.vocab_size

    def allowed(gate: ReasoningGate) -> set[int]:
        return set(unpack_bitmask(gate.filled().words[None], vocab)[0].nonzero().flatten().tolist())

    gate = ReasoningGate.for_prompt(markers, engine.grammars.new_state(spec), vocab, "user: hi\nassistant\n")
    grammar_only = allowed(ReasoningGate(markers, engine.grammars.new_state(spec), vocab))
    assert gate.phase == Phase.OPENING and allowed(gate) == grammar_only | {markers.open_ids[0]}
    assert gate.accept(markers.open_ids[0]) and gate.phase == Phase.THINKING and not gate.constraining
    other = ReasoningGate.for_prompt(markers, engine.grammars.new_state(spec), vocab, "assistant\n")
    assert not other.accept(markers.close_ids[0])  # neither the grammar nor a think
    assert other.accept(tokenizer.encode("ab")[0]) and other.phase == Phase.CONSTRAINED


def test_the_budget_forces_the_close_token_by_token(llm):
    engine = llm.engine
    markers = ReasoningMarkers((1,), (5, 6, 7), engine.reasoning_markers.token_text)
    gate = ReasoningGate.for_prompt(markers, None, engine.grammars.vocab_size, "<think>", budget=2)
    assert gate.accept(100) and gate.accept(101) and gate.phase == Phase.FORCING
    for token in (5, 6, 7):
        assert gate.constraining
        assert allowed_only(gate, engine.grammars.vocab_size) == [token]
        assert not gate.accept(token + 1) and gate.accept(token)
    assert gate.reasoning_ended and not gate.constraining and gate.num_reasoning_tokens == 2


def allowed_only(gate: ReasoningGate, vocab: int) -> list[int]:
    return unpack_bitmask(gate.filled().words[None], vocab)[0].nonzero().flatten().tolist()


# ---------------------------------------------------------------------------- params and helpers


def test_params():
    assert not StructuredOutputsParams(regex="a").after_reasoning
    assert StructuredOutputsParams.of({"regex": "a", "after_reasoning": True}).after_reasoning
    assert StructuredOutputsParams(regex="a").cache_key == StructuredOutputsParams(regex="a",
                                                                                   after_reasoning=True).cache_key
    for bad in ({"regex": "a", "after_reasoning": "yes"}, {"regex": "a", "reasoning": True}):
        with pytest.raises(SamplingParamError):
            SamplingParams(structured_outputs=bad)
    with pytest.raises(SamplingParamError) as info:
        SamplingParams(thinking_token_budget=-1)
    assert info.value.field == "thinking_token_budget"
    assert SamplingParams(thinking_token_budget=0).gates_reasoning
    assert not SamplingParams(structured_outputs={"regex": "a"}).gates_reasoning


def test_split_reasoning():
    assert split_reasoning("<think>a</think>\n\n{}") == ("a", "{}")
    assert split_reasoning("b</think>\n{}", prompt_text="x<think>\n") == ("b", "{}")
    assert split_reasoning("{}") == ("", "{}")
    assert split_reasoning("c</think>\n\n{}") == ("c", "{}")  # the think began in the prompt
    assert split_reasoning("<think>unclosed") == ("unclosed", "")
