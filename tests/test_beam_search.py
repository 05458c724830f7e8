"""Beam search (`vlmrun/beam_search.py`, `LLM.beam_search`): HF's search where it is the same search, and
vLLM's scoring and EOS rule where HF's differs.

With no EOS inside the budget (`ignore_eos`, HF's `eos_token_id=None`) both keep, per round, the best
`beam_width` of all one-token extensions, so the best beams and their summed logprobs are HF
`generate(num_beams=...)`'s on the tiny checkpoint. The scoring (vLLM's length penalty over prompt +
output tokens, a final EOS not counted) and the EOS rule (a beam ending in EOS is complete and leaves
the live beams) are checked on the state machine with given candidates.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from vlmrun import LLM
from vlmrun.beam_search import BeamSearch, BeamSearchParams, beam_score
from vlmrun.logprobs import Logprob
from vlmrun.processors import ProcessedPrompt

PROMPTS = ["The cat sat on", "Hello world, this is"]


@pytest.fixture(scope="module")
def text_llm(qwen3_dir):
    return LLM(str(qwen3_dir), dtype="float32", device="cpu", max_num_seqs=16)


@pytest.mark.parametrize("length_penalty", [0.0, 1.0])
def test_best_beams_equal_hf(text_llm, qwen3_dir, length_penalty):
    """No EOS inside the budget: the beams, best first, and their cum_logprob are HF's."""
    width, steps = 3, 6
    hf = AutoModelForCausalLM.from_pretrained(qwen3_dir, dtype=torch.float32).eval()
    tokenizer = text_llm.get_tokenizer()
    outs = text_llm.beam_search(PROMPTS, BeamSearchParams(beam_width=width, max_tokens=steps, ignore_eos=True,
                                                          length_penalty=length_penalty))
    for prompt, out in zip(PROMPTS, outs):
        ids = torch.tensor([tokenizer.encode(prompt)])
        ref = hf.generate(ids, num_beams=width, num_return_sequences=width, do_sample=False, max_new_tokens=steps,
                          eos_token_id=None, pad_token_id=0, early_stopping=True, length_penalty=length_penalty,
                          output_scores=True, return_dict_in_generate=True, temperature=None, top_p=None, top_k=None,
                          repetition_penalty=1.0)
        assert [s.tokens for s in out.sequences] == ref.sequences.tolist()
        sums = (ref.sequences_scores * steps ** length_penalty).tolist()  # HF divides by the output length
        assert [s.cum_logprob for s in out.sequences] == pytest.approx(sums, abs=1e-4)
        for seq in out.sequences:
            assert seq.text == tokenizer.decode(seq.tokens)  # vLLM's text: prompt and output
            assert len(seq.logprobs) == steps and seq.finish_reason == "length"
            assert all(isinstance(lp, Logprob) for d in seq.logprobs for lp in d.values())


def test_bad_prompt_fails_alone(text_llm, caplog):
    """vLLM raises; vlmrun searches the others and names the failed input in one warning."""
    good, bad = text_llm.beam_search(["Hi", {"prompt": "x", "multi_modal_data": {"image": "missing.png"}}],
                                     BeamSearchParams(beam_width=2, max_tokens=2))
    assert len(good.sequences) == 2 and good.error is None
    assert bad.sequences == [] and "images" in bad.error
    assert "LLM.beam_search: 1 input(s) failed" in caplog.text and "input 1: " in caplog.text


def test_concurrency_limit_searches_in_batches_with_the_same_result(text_llm):
    params = BeamSearchParams(beam_width=2, max_tokens=3)
    together = text_llm.beam_search(PROMPTS + ["Third one"], params)
    batched = text_llm.beam_search(PROMPTS + ["Third one"], params, concurrency_limit=2)
    assert [[s.tokens for s in o.sequences] for o in together] == [[s.tokens for s in o.sequences] for o in batched]
    with pytest.raises(ValueError, match="concurrency_limit"):
        text_llm.beam_search(PROMPTS, params, concurrency_limit=0)


class _Tokenizer:
    eos_token_id = 9

    def decode(self, ids):
        return " ".join(map(str, ids))


def test_score_counts_the_prompt_and_not_a_final_eos():
    assert beam_score([1, 2, 3, 4], -2.0, eos_token_id=9, length_penalty=1.0) == -0.5
    assert beam_score([1, 2, 3, 9], -2.0, eos_token_id=9, length_penalty=1.0) == pytest.approx(-2.0 / 3)
    assert beam_score([1, 2, 3, 4], -2.0, eos_token_id=9, length_penalty=0.0) == -2.0


def test_eos_completes_a_beam_and_it_competes_at_the_end():
    """A candidate ending in EOS leaves the live beams (they refill from the others) and is ranked with
    them at the end, by vLLM's score."""
    search = BeamSearch(BeamSearchParams(beam_width=2, max_tokens=2, length_penalty=1.0), _Tokenizer())
    search.start(ProcessedPrompt(token_ids=[1, 2]))
    assert [p.token_ids for p, _ in search.round_prompts()] == [[1, 2]]
    search.advance([{9: Logprob(-0.1), 5: Logprob(-0.5), 6: Logprob(-0.7), 7: Logprob(-3.0)}])
    inst = search.instances[0]
    assert [b.tokens for b in inst.completed] == [[1, 2, 9]]
    assert [b.tokens for b in inst.beams] == [[1, 2, 5], [1, 2, 6]]
    search.advance([{4: Logprob(-2.0)}, {4: Logprob(-0.2)}])
    assert search.done
    out = search.outputs()[0]
    # scores: [1,2,9] -0.1/2 = -0.05; [1,2,6,4] -0.9/4; [1,2,5,4] -2.5/4
    assert [s.tokens for s in out.sequences] == [[1, 2, 9], [1, 2, 6, 4]]
    assert [s.finish_reason for s in out.sequences] == ["stop", "length"]
    assert out.sequences[1].output_token_ids == [6, 4] and out.sequences[1].text == "1 2 6 4"


def test_ignore_eos_keeps_eos_beams_live():
    search = BeamSearch(BeamSearchParams(beam_width=1, max_tokens=1, ignore_eos=True), _Tokenizer())
    search.start(ProcessedPrompt(token_ids=[1]))
    search.advance([{9: Logprob(-0.1), 5: Logprob(-0.5)}])
    assert search.instances[0].completed == [] and [b.tokens for b in search.instances[0].beams] == [[1, 9]]


def test_a_beam_the_engine_could_not_extend_is_dropped():
    search = BeamSearch(BeamSearchParams(beam_width=2, max_tokens=3), _Tokenizer())
    search.start(ProcessedPrompt(token_ids=[1]))
    search.advance([None])
    assert search.done and search.outputs()[0].sequences == []


@pytest.mark.parametrize("fields, name", [
    (dict(beam_width=0, max_tokens=4), "beam_width"), (dict(beam_width=11, max_tokens=4), "beam_width"),
    (dict(beam_width=2, max_tokens=0), "max_tokens"), (dict(beam_width=2, max_tokens=4, temperature=-1.0), "temperature"),
    (dict(beam_width=2, max_tokens=4, length_penalty=float("nan")), "length_penalty"),
])
def test_params_refused_naming_the_field(fields, name):
    with pytest.raises(ValueError, match=name):
        BeamSearchParams(**fields)


def test_round_params_read_two_candidates_per_beam():
    params = BeamSearchParams(beam_width=4, max_tokens=8, temperature=0.5).round_params()
    assert (params.logprobs, params.max_tokens, params.temperature) == (8, 1, 0.5)
