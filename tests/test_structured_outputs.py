"""Structured outputs on tiny random checkpoints, whose unconstrained output is noise.

Property tests: random JSON schemas, regexes and choice lists, at temperature 0 and > 0, batched
with unconstrained requests, with chunked prefill, preemption and prefix-cache hits. Every output
that ends by its grammar ("stop") parses / matches; one cut by max_tokens ("length") is a prefix
the grammar accepts, token by token. Plus: the compile errors, the cache, the sampler's bitmask.
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vlmrun.api import LLM
from vlmrun.layers.logit_transforms import apply_token_bitmask
from vlmrun.layers.sampler import Sampler
from vlmrun.layers.sampling_batch import SamplingBatch, SamplingRow
from vlmrun.sampling_params import SamplingParamError, SamplingParams
from vlmrun.structured import StructuredOutputError, StructuredOutputsParams
from tests.test_engine_parity import llm_kv_bytes_per_token

MAX_TOKENS = 40
PROPERTY = settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                           HealthCheck.too_slow])


@pytest.fixture(scope="module")
def llm(qwen3_dir):
    return LLM(str(qwen3_dir), dtype="float32", device="cpu")


@pytest.fixture(scope="module")
def tight(qwen3_dir):
    """Chunks of 8 tokens, pages of 4, and a KV pool of 96 tokens (~2 requests): chunked prefill, preemption."""
    budget = 24 * 4 * llm_kv_bytes_per_token(qwen3_dir)
    return LLM(str(qwen3_dir), dtype="float32", device="cpu", page_size=4, max_num_batched_tokens=8,
               max_num_seqs=8, kv_cache_memory_bytes=budget)


# ---------------------------------------------------------------------------- strategies

TEXT = st.text(alphabet='abcXYZ019 "\\/é😀\n{}', min_size=1, max_size=6)
KEYS = st.from_regex(r"[a-z]{1,5}", fullmatch=True)


def _object(props: dict) -> dict:
    return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}


LEAF_SCHEMAS = st.one_of(
    st.builds(lambda lo, span: {"type": "integer", "minimum": lo, "maximum": lo + span},
              st.integers(-50, 50), st.integers(0, 100)),
    st.just({"type": "boolean"}),
    st.just({"type": "null"}),
    st.lists(st.one_of(TEXT, st.integers(-5, 5)), min_size=1, max_size=4, unique=True).map(lambda v: {"enum": v}),
    st.integers(1, 6).map(lambda n: {"type": "string", "maxLength": n}),
)
SCHEMAS = st.recursive(LEAF_SCHEMAS, lambda children: st.one_of(
    st.builds(lambda items, n: {"type": "array", "items": items, "maxItems": n}, children, st.integers(1, 3)),
    st.dictionaries(KEYS, children, min_size=1, max_size=3).map(_object),
), max_leaves=5)

_ATOMS = st.sampled_from(["a", "b", "z", "0", "7", "[a-c]", "[0-9]", "[xyz]", r"\.", "-"])
_PIECES = st.tuples(_ATOMS, st.sampled_from(["", "?", "{1,3}", "{2}", "+"])).map("".join)
_SEQUENCES = st.lists(_PIECES, min_size=1, max_size=4).map("".join)
REGEXES = st.lists(_SEQUENCES, min_size=1, max_size=2).map("|".join)
CHOICES = st.lists(TEXT, min_size=1, max_size=5, unique=True)
SPECS = st.one_of(SCHEMAS.map(lambda s: StructuredOutputsParams(json=s)),
                  REGEXES.map(lambda r: StructuredOutputsParams(regex=r)),
                  CHOICES.map(lambda c: StructuredOutputsParams(choice=c)),
                  st.just(StructuredOutputsParams(json_object=True)))
SAMPLING = st.fixed_dictionaries({
    "temperature": st.sampled_from([0.0, 0.7, 1.5]),
    "top_p": st.sampled_from([1.0, 0.9]),
    "top_k": st.sampled_from([0, 20]),
    "seed": st.one_of(st.none(), st.integers(0, 1000)),
})
PROMPTS = st.text(alphabet="abcdefgh ijk", min_size=1, max_size=40)


# ---------------------------------------------------------------------------- checks


def check_output(llm: LLM, spec: StructuredOutputsParams, out) -> None:
    """Replays the tokens through a fresh matcher; a grammar-ended output parses / matches."""
    completion = out.outputs[0]
    state = llm.engine.grammars.new_state(spec)
    for token in completion.token_ids:
        assert state.accept(token), f"token {token} breaks the grammar of {spec} in {completion.text!r}"
    assert completion.finish_reason in ("stop", "length")
    if completion.finish_reason == "length":
        assert len(completion.token_ids) == MAX_TOKENS
        return
    assert state.is_terminated
    check_text(spec, completion.text)


def check_text(spec: StructuredOutputsParams, text: str) -> None:
    if spec.kind == "json":
        jsonschema.validate(json.loads(text), spec.json)
    elif spec.kind == "json_object":
        assert isinstance(json.loads(text), dict)
    elif spec.kind == "regex":
        assert re.fullmatch(spec.regex, text), (spec.regex, text)
    else:
        assert text in spec.choice


def run_mixed(llm: LLM, prompts: list[str], specs: list[StructuredOutputsParams], sampling: dict) -> None:
    """The constrained requests plus one unconstrained one per batch; all checked."""
    params = [SamplingParams(max_tokens=MAX_TOKENS, structured_outputs=s, **sampling) for s in specs]
    params.append(SamplingParams(max_tokens=MAX_TOKENS, **sampling))
    outs = llm.generate(prompts + [prompts[0]], params, use_tqdm=False)
    for spec, out in zip(specs, outs):
        assert out.error is None, out.error
        check_output(llm, spec, out)
    assert outs[-1].error is None and len(outs[-1].token_ids) > 0


# ---------------------------------------------------------------------------- property tests


@PROPERTY
@given(specs=st.lists(SPECS, min_size=1, max_size=4), prompt=PROMPTS, sampling=SAMPLING)
def test_every_output_follows_its_grammar(llm, specs, prompt, sampling):
    # One prompt repeated: the later requests hit the prefix cache.
    run_mixed(llm, [prompt * 3] * len(specs), specs, sampling)


@PROPERTY
@given(specs=st.lists(SPECS, min_size=2, max_size=5), prompt=PROMPTS, sampling=SAMPLING)
def test_grammar_holds_under_chunked_prefill_and_preemption(tight, specs, prompt, sampling):
    run_mixed(tight, [f"{i} {prompt}" for i in range(len(specs))], specs, sampling)


def test_the_tight_engine_does_preempt(tight):
    spec = StructuredOutputsParams(regex="[a-c]{30,40}")
    outs = tight.generate([f"{i} prompt {i}" * 4 for i in range(6)],
                          SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, structured_outputs=spec),
                          use_tqdm=False)
    assert tight.engine.scheduler.num_preemptions > 0
    for out in outs:
        check_output(tight, spec, out)
    allocator = tight.engine.caches.allocator
    assert allocator.num_free_pages() == allocator.num_usable_pages()


def test_greedy_constrained_output_does_not_depend_on_the_batch_or_preemption(llm, tight):
    spec = StructuredOutputsParams(json={"type": "object", "properties": {"k": {"type": "string", "maxLength": 8},
                                                                          "n": {"type": "integer"}},
                                         "required": ["k", "n"]})
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, structured_outputs=spec)
    alone = llm.generate(["the same prompt"], params, use_tqdm=False)[0].token_ids
    plain = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    mixed = llm.generate(["other", "the same prompt", "more"], [plain, params, plain], use_tqdm=False)
    assert mixed[1].token_ids == alone
    squeezed = tight.generate([f"filler {i} " * 6 for i in range(4)] + ["the same prompt"],
                              [plain] * 4 + [params], use_tqdm=False)
    assert squeezed[-1].token_ids == alone


# ---------------------------------------------------------------------------- interplay with sampling options


def test_logprobs_are_raw_and_include_the_chosen_token(llm):
    spec = StructuredOutputsParams(choice=["yes", "no"])
    out = llm.generate(["q"], SamplingParams(max_tokens=8, temperature=0.0, logprobs=3, structured_outputs=spec),
                       use_tqdm=False)[0]
    assert out.text in ("yes", "no") and out.finish_reason == "stop"
    assert len(out.logprobs) == len(out.token_ids)
    for token, lp in zip(out.token_ids, out.logprobs):
        assert token in lp and len(lp) in (3, 4)


def test_stop_strings_min_tokens_and_ignore_eos(llm):
    spec = StructuredOutputsParams(regex="abcabc")
    cut = llm.generate(["q"], SamplingParams(max_tokens=20, temperature=0.0, stop=["ca"], structured_outputs=spec),
                       use_tqdm=False)[0]
    assert cut.text == "ab" and cut.finish_reason == "stop"
    for extra in ({"min_tokens": 15}, {"ignore_eos": True}):
        out = llm.generate(["q"], SamplingParams(max_tokens=20, temperature=0.0, structured_outputs=spec, **extra),
                           use_tqdm=False)[0]
        assert out.text == "abcabc" and out.finish_reason == "stop", extra


def test_n_choices_each_follow_the_grammar(llm):
    spec = StructuredOutputsParams(choice=["red", "green", "blue"])
    out = llm.generate(["colour?"], SamplingParams(n=4, seed=3, temperature=1.0, max_tokens=8,
                                                   structured_outputs=spec), use_tqdm=False)[0]
    assert len(out.outputs) == 4 and all(c.text in spec.choice for c in out.outputs)


# ---------------------------------------------------------------------------- errors and the cache


@pytest.mark.parametrize("spec", [{"json": "{not json"}, {"json": {"type": "nonsense"}}, {"regex": "(abc"},
                                  {"grammar": "root ::= undefined_rule"}])
def test_bad_specs_fail_at_add_request_and_the_engine_keeps_serving(llm, spec):
    bad = SamplingParams(max_tokens=4, structured_outputs=spec)
    with pytest.raises(StructuredOutputError, match="does not compile"):
        llm.engine.add_request("bad", llm.engine.process("q"), bad)
    assert "bad" not in llm.engine.requests and not llm.engine.has_unfinished()
    outs = llm.generate(["a", "b"], [bad, SamplingParams(max_tokens=4)], use_tqdm=False)
    assert "does not compile" in outs[0].error and outs[1].error is None


@pytest.mark.parametrize("spec", [{}, {"json": {}, "regex": "a"}, {"choice": []}, {"regex": 3},
                                  {"choice": ["a", 1]}, {"schema": "x"}, "json"])
def test_malformed_params_are_refused_when_built(spec):
    with pytest.raises(SamplingParamError) as info:
        SamplingParams(structured_outputs=spec)
    assert info.value.field == "structured_outputs"


def test_grammars_compile_once_per_text(llm):
    grammars = llm.engine.grammars
    spec = {"type": "object", "properties": {"unique_key_for_cache_test": {"type": "boolean"}}}
    first = grammars.compile(StructuredOutputsParams(json=spec))
    size = grammars.num_cached
    assert grammars.compile(StructuredOutputsParams(json=dict(spec))) is first
    assert grammars.num_cached == size


# ---------------------------------------------------------------------------- the sampler's mask


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """int32 [n, words] -> bool [n, vocab_size]: token 32 w + j is allowed when bit j of word w is set."""
    bits = (bitmask.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1  # [n, words, 32]
    return bits.view(bitmask.shape[0], -1)[:, :vocab_size].bool()


def test_the_mask_reaches_grammar_rows_only_and_leaves_the_logits_alone():
    vocab = 150  # not a multiple of 32
    logits = torch.randn(4, vocab)
    before = logits.clone()
    batch = SamplingBatch(batch_size=4, vocab_size=vocab, all_greedy=True, grammar_rows=[1, 3],
                          token_bitmask=torch.randint(-2**31, 2**31 - 1, (4, 5), dtype=torch.int32))
    masked = apply_token_bitmask(logits, batch)
    assert torch.equal(logits, before)
    allowed = unpack_bitmask(batch.token_bitmask, vocab)
    for r in range(4):
        expect = before[r].masked_fill(~allowed[r], float("-inf")) if r in (1, 3) else before[r]
        assert torch.equal(masked[r], expect)


class _OnlyToken:
    """A grammar stand-in that allows one token."""

    def __init__(self, token: int):
        self.token = token

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        bitmask[row] = 0
        bitmask[row, self.token // 32] = 1 << (self.token % 32)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_sampler_masks_only_grammar_rows_even_on_padded_logits(temperature):
    vocab = 600  # wider than a 512-token tokenizer, as padded embeddings are
    logits = torch.randn(3, vocab)
    logits[:, 7] = 50.0  # everyone's favourite
    params = SamplingParams(temperature=temperature)
    rows = [SamplingRow(params, [1], [], None, (), _OnlyToken(530)), SamplingRow(params, [1], []),
            SamplingRow(params, [1], [], None, (), _OnlyToken(3))]
    tokens = Sampler().sample(logits, SamplingBatch.build(rows, vocab)).to_host().token_ids
    assert tokens == [530, 7, 3]


def test_a_grammar_never_allows_ids_past_the_tokenizer(llm):
    from vlmrun.structured.compiler import GrammarCompiler

    tokenizer = llm.engine.tokenizer
    grammars = GrammarCompiler(tokenizer, len(tokenizer) + 88, llm.engine.model_config.eos_token_ids)
    state = grammars.new_state(StructuredOutputsParams(json_object=True))
    bitmask = torch.full((1, (len(tokenizer) + 88 + 31) // 32), -1, dtype=torch.int32)
    state.fill_bitmask(bitmask, 0)
    allowed = unpack_bitmask(bitmask, len(tokenizer) + 88)[0]
    assert allowed[:len(tokenizer)].any() and not allowed[len(tokenizer):].any()


def test_generate_takes_structured_outputs(qwen3_dir):
    import vlmrun

    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    text = vlmrun.generate(None, "answer", model=str(qwen3_dir), dtype="float32", device="cpu", max_tokens=20,
                           structured_outputs=vlmrun.StructuredOutputsParams(json=schema))
    assert isinstance(json.loads(text)["ok"], bool)
    with pytest.raises(ValueError, match="does not compile"):
        vlmrun.generate(None, "answer", model=str(qwen3_dir), dtype="float32", device="cpu",
                        structured_outputs={"regex": "(unclosed"})


def test_length_limited_strings_refuse_control_characters(llm):
    # xgrammar 0.2.8 lets raw control characters into minLength / maxLength strings; the compiler
    # gives such strings a pattern instead (a hypothesis example found this).
    tokenizer = llm.engine.tokenizer
    quote, ctrl = tokenizer.convert_tokens_to_ids('"'), tokenizer.convert_tokens_to_ids("ă")  # byte 0x03
    for schema in ({"type": "string", "maxLength": 3}, {"type": "string", "minLength": 1}):
        state = llm.engine.grammars.new_state(StructuredOutputsParams(json=schema))
        assert state.accept(quote) and not state.accept(ctrl), schema


def test_concurrent_compiles_of_one_text_compile_it_once(llm):
    from concurrent.futures import ThreadPoolExecutor

    grammars = llm.engine.grammars
    specs = [StructuredOutputsParams(regex=f"(x|y){{{n}}}z") for n in range(8)] * 4
    with ThreadPoolExecutor(8) as pool:
        compiled = list(pool.map(grammars.compile, specs))
    for spec, grammar in zip(specs, compiled):
        assert grammar is grammars.compile(spec)
    cached = grammars.num_cached
    with pytest.raises(StructuredOutputError):
        grammars.compile(StructuredOutputsParams(regex="(bad"))
    assert grammars.num_cached == cached  # errors are not cached as grammars
    with pytest.raises(StructuredOutputError):
        grammars.compile(StructuredOutputsParams(regex="(bad"))
