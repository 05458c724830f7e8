"""Tests for SamplingParams and the batched sampler (CPU, crafted logits)."""

from __future__ import annotations

import math

import pytest
import torch

from vlmrun.layers.logit_transforms import apply_penalties
from vlmrun.layers.sampler import Sampler
from vlmrun.layers.sampling_batch import SamplingBatch, SamplingRow
from vlmrun.sampling_params import SamplingParams

VOCAB = 32
EOS = 7


def _row(params: SamplingParams, prompt=(1, 2, 3), output=(), generator=None, eos=(EOS,)) -> SamplingRow:
    return SamplingRow(params, list(prompt), list(output), generator, list(eos))


def _sample(logits: torch.Tensor, rows: list[SamplingRow], sampler: Sampler | None = None):
    batch = SamplingBatch.build(rows, logits.shape[-1], logits.device)
    return (sampler or Sampler()).sample(logits, batch)


def _repeat(logits_row: list[float], n: int) -> torch.Tensor:
    return torch.tensor([logits_row] * n, dtype=torch.float32)  # [n, vocab]


def _log_probs(probs: list[float]) -> list[float]:
    return [math.log(p) for p in probs]


# ------------------------------------------------------------------------------- SamplingParams


def test_params_defaults_and_normalisation():
    p = SamplingParams(stop="###", top_k=-1)
    assert p.stop == ["###"] and p.stop_token_ids == [] and p.top_k == 0
    assert (p.n, p.temperature, p.top_p, p.min_p, p.max_tokens, p.logprobs) == (1, 1.0, 1.0, 0.0, 16, None)
    assert SamplingParams(temperature=0.0).is_greedy and not p.is_greedy
    assert SamplingParams(stop=None).stop == []


@pytest.mark.parametrize("kwargs", [
    dict(max_tokens=-1), dict(max_tokens=0), dict(temperature=-0.1), dict(top_p=0.0), dict(top_p=1.5),
    dict(top_k=-2), dict(min_p=1.5), dict(min_tokens=5, max_tokens=2), dict(min_tokens=-1),
    dict(logprobs=-1), dict(n=0), dict(repetition_penalty=0.0), dict(presence_penalty=3.0),
    dict(frequency_penalty=-2.5), dict(stop=[""]),
])
def test_params_validation(kwargs):
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)


def test_stop_ids_for_respects_ignore_eos():
    assert SamplingParams(stop_token_ids=[5]).stop_ids_for([7]) == [7, 5]
    assert SamplingParams(stop_token_ids=[5], ignore_eos=True).stop_ids_for([7]) == [5]


# ------------------------------------------------------------------------------- greedy


def test_greedy_is_argmax_and_input_untouched():
    torch.manual_seed(0)
    logits = torch.randn(6, VOCAB)
    before = logits.clone()
    rows = [_row(SamplingParams(temperature=0.0)) for _ in range(6)]
    out = _sample(logits, rows)
    assert torch.equal(out.token_ids, logits.argmax(-1))
    assert torch.equal(logits, before)
    host = out.to_host()
    assert host.token_ids == logits.argmax(-1).tolist() and host.logprobs == [None] * 6


def test_all_greedy_batch_skips_sampling_tensors():
    batch = SamplingBatch.build([_row(SamplingParams(temperature=0.0))] * 3, VOCAB)
    assert batch.all_greedy and batch.temperatures is None and batch.seen_mask is None
    assert batch.blocked_rows is None and batch.max_num_logprobs is None


def test_mixed_batch_greedy_rows_take_argmax():
    torch.manual_seed(1)
    logits = torch.randn(8, VOCAB)
    rows = [_row(SamplingParams(temperature=0.0 if i % 2 == 0 else 1.5)) for i in range(8)]
    out = _sample(logits, rows).token_ids
    assert torch.equal(out[0::2], logits[0::2].argmax(-1))


# ------------------------------------------------------------------------------- seeds


SEEDED = SamplingParams(temperature=0.9, top_p=0.95, seed=1234)


def _seeded_run(position: int, batch_size: int, companions: list[SamplingParams], steps: int = 25,
                params: SamplingParams = SEEDED) -> list[int]:
    """Run a seeded request at `position` in a batch of companions; return its tokens."""
    gen = torch.Generator().manual_seed(params.seed)
    logit_rng = torch.Generator().manual_seed(99)
    sampler = Sampler()
    tokens = []
    for step in range(steps):
        seeded_logits = torch.randn(VOCAB, generator=logit_rng)  # same for every run
        logits = torch.randn(batch_size, VOCAB)  # companions: arbitrary noise
        logits[position] = seeded_logits
        rows = [_row(companions[i % len(companions)]) for i in range(batch_size)]
        rows[position] = _row(params, output=tokens, generator=gen)
        out = sampler.sample(logits, SamplingBatch.build(rows, VOCAB))
        tokens.append(out.to_host().token_ids[position])
    return tokens


def test_seeded_request_repeats_across_batches_and_positions():
    torch.manual_seed(5)
    solo = _seeded_run(0, 1, [SamplingParams()])
    again = _seeded_run(0, 1, [SamplingParams()])
    mixed = _seeded_run(3, 5, [SamplingParams(temperature=0.0), SamplingParams(top_k=4, min_p=0.1),
                               SamplingParams(seed=7, temperature=1.2)])
    penalised = _seeded_run(1, 4, [SamplingParams(repetition_penalty=1.3, logprobs=2, min_tokens=3)])
    assert solo == again == mixed == penalised
    assert len(set(solo)) > 3  # it really sampled


def test_seeded_request_same_whichever_truncation_path_the_batch_takes():
    params = SamplingParams(temperature=1.3, top_k=12, min_p=0.02, seed=77)
    alone = _seeded_run(0, 1, [SamplingParams()], params=params)  # top-k via topk()
    with_top_p = _seeded_run(2, 3, [SamplingParams(top_p=0.5)], params=params)  # top-k in the sort path
    assert alone == with_top_p and len(set(alone)) > 3


def test_unseeded_rows_use_sampler_generator():
    logits = torch.zeros(4, VOCAB)
    rows = [_row(SamplingParams()) for _ in range(4)]
    a = _sample(logits, rows, Sampler(torch.Generator().manual_seed(3))).token_ids
    b = _sample(logits, rows, Sampler(torch.Generator().manual_seed(3))).token_ids
    assert torch.equal(a, b)


# ------------------------------------------------------------------------------- truncation


def _draw_many(logits_row: list[float], params: SamplingParams, n: int = 4000) -> torch.Tensor:
    logits = _repeat(logits_row, n)
    rows = [_row(params)] * n
    return _sample(logits, rows, Sampler(torch.Generator().manual_seed(0))).token_ids


PROBS = [0.5, 0.3, 0.15, 0.05]


@pytest.mark.parametrize("params, allowed", [
    (SamplingParams(top_k=2), {0, 1}),
    (SamplingParams(top_k=3), {0, 1, 2}),
    (SamplingParams(top_p=0.75), {0, 1}),
    (SamplingParams(top_p=0.4), {0}),
    (SamplingParams(min_p=0.25), {0, 1, 2}),
    (SamplingParams(min_p=0.5), {0, 1}),
    (SamplingParams(top_k=3, top_p=0.9), {0, 1, 2}),  # renormalised 0.526, 0.316, 0.158: 0.842 < 0.9
    (SamplingParams(top_k=3, top_p=0.8), {0, 1}),  # 0.842 >= 0.8 drops token 2
    (SamplingParams(temperature=0.5, top_p=0.9), {0, 1}),  # sharper: 0.69, 0.25, ...
])
def test_truncation_never_leaves_allowed_set(params, allowed):
    drawn = set(_draw_many(_log_probs(PROBS), params).tolist())
    assert drawn == allowed  # nothing outside; every allowed token shows up in 4000 draws


def test_top_k_top_p_values_when_mixed_in_one_batch():
    logits = torch.tensor([_log_probs(PROBS)] * 3000)
    params = [SamplingParams(top_k=1), SamplingParams(top_p=0.6), SamplingParams()]
    rows = [_row(params[i % 3]) for i in range(3000)]
    out = _sample(logits, rows, Sampler(torch.Generator().manual_seed(1))).token_ids
    assert set(out[0::3].tolist()) == {0}
    assert set(out[1::3].tolist()) == {0, 1}
    assert set(out[2::3].tolist()) == {0, 1, 2, 3}


def test_sampling_frequencies_match_probabilities():
    draws = _draw_many(_log_probs(PROBS), SamplingParams(), n=20000)
    freq = torch.bincount(draws, minlength=4).float() / draws.numel()
    assert torch.allclose(freq, torch.tensor(PROBS), atol=0.015)


def test_temperature_flattens_distribution():
    draws = _draw_many(_log_probs(PROBS), SamplingParams(temperature=100.0), n=20000)
    freq = torch.bincount(draws, minlength=4).float() / draws.numel()
    assert torch.allclose(freq, torch.full((4,), 0.25), atol=0.02)


# ------------------------------------------------------------------------------- penalties


def _penalised(params: SamplingParams, logits_row: list[float], prompt, output) -> list[float]:
    logits = torch.tensor([logits_row])
    batch = SamplingBatch.build([_row(params, prompt=prompt, output=output)], len(logits_row))
    return apply_penalties(logits, batch)[0].tolist()


LOGITS5 = [2.0, -1.0, 0.5, -0.5, 3.0]


def test_repetition_penalty_over_prompt_and_output():
    got = _penalised(SamplingParams(repetition_penalty=2.0), LOGITS5, prompt=[0, 1], output=[1, 2, 2])
    assert got == pytest.approx([1.0, -2.0, 0.25, -0.5, 3.0])


def test_frequency_penalty_over_output_only():
    got = _penalised(SamplingParams(frequency_penalty=0.5), LOGITS5, prompt=[0, 4], output=[1, 2, 2])
    assert got == pytest.approx([2.0, -1.5, -0.5, -0.5, 3.0])


def test_presence_penalty_over_output_only():
    got = _penalised(SamplingParams(presence_penalty=0.3), LOGITS5, prompt=[0, 4], output=[1, 2, 2])
    assert got == pytest.approx([2.0, -1.3, 0.2, -0.5, 3.0])


def test_penalties_combine_repetition_first():
    params = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    got = _penalised(params, LOGITS5, prompt=[4], output=[2, 2])
    # token 2: 0.5 / 2 - 0.5 * 2 - 0.25; token 4 (prompt only): 3 / 2
    assert got == pytest.approx([2.0, -1.0, 0.25 - 1.0 - 0.25, -0.5, 1.5])


def test_penalties_only_touch_rows_that_ask():
    logits = torch.tensor([LOGITS5, LOGITS5])
    rows = [_row(SamplingParams(frequency_penalty=1.0), output=[0]), _row(SamplingParams(), output=[0])]
    got = apply_penalties(logits, SamplingBatch.build(rows, 5))
    assert got[0, 0].item() == pytest.approx(1.0)
    assert torch.equal(got[1], logits[1])


def test_penalty_changes_greedy_choice():
    logits = torch.tensor([[1.0, 0.9, 0.0]])
    rows = [_row(SamplingParams(temperature=0.0, repetition_penalty=1.5), prompt=[], output=[0])]
    assert _sample(logits, rows).token_ids.tolist() == [1]


# ------------------------------------------------------------------------------- min_tokens


def test_min_tokens_blocks_eos_and_stop_ids():
    logits = torch.zeros(1, VOCAB)
    logits[0, EOS] = 10.0
    logits[0, 5] = 9.0
    logits[0, 11] = 8.0
    params = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[5])
    assert _sample(logits, [_row(params, output=[1])]).token_ids.tolist() == [11]
    assert _sample(logits, [_row(params, output=[1, 2])]).token_ids.tolist() == [EOS]


def test_min_tokens_with_ignore_eos_blocks_only_stop_ids():
    logits = torch.zeros(1, VOCAB)
    logits[0, EOS] = 10.0
    logits[0, 5] = 11.0
    params = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[5], ignore_eos=True)
    assert _sample(logits, [_row(params)]).token_ids.tolist() == [EOS]


def test_min_tokens_blocks_in_sampled_rows():
    logits = torch.zeros(500, VOCAB)
    logits[:, EOS] = 5.0
    params = SamplingParams(min_tokens=1)
    out = _sample(logits, [_row(params)] * 500).token_ids
    assert EOS not in out.tolist()


# ------------------------------------------------------------------------------- logprobs


def test_logprobs_are_raw_top_k_plus_chosen():
    torch.manual_seed(2)
    logits = torch.randn(4, VOCAB)
    raw = torch.log_softmax(logits, -1)
    params = [
        SamplingParams(logprobs=3, repetition_penalty=1.7, temperature=0.7),
        SamplingParams(logprobs=None),
        SamplingParams(logprobs=0, temperature=0.0, presence_penalty=1.0),
        SamplingParams(logprobs=5, top_k=2),
    ]
    rows = [_row(p, prompt=list(range(10)), output=[3, 4]) for p in params]
    out = _sample(logits, rows)
    host = out.to_host()
    assert host.token_ids == out.token_ids.tolist()
    assert host.logprobs[1] is None
    for i in (0, 2, 3):
        k = params[i].logprobs
        d = host.logprobs[i]
        chosen = host.token_ids[i]
        top = raw[i].topk(k).indices.tolist() if k else []
        assert set(d) == set(top) | {chosen}
        assert len(d) in (k, k + 1)
        for tok, lp in d.items():
            assert lp == pytest.approx(raw[i, tok].item(), abs=1e-6)
    assert out.logprobs == host.logprobs


def test_logprobs_dict_has_k_entries_when_chosen_is_in_top():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0]])
    out = _sample(logits, [_row(SamplingParams(temperature=0.0, logprobs=2))])
    assert out.logprobs[0].keys() == {0, 1}
