"""Speculative decoding with n-gram drafts gives plain decode's tokens (greedy and seeded) and keeps
the sampled distribution (unseeded).

Every full-attention architecture runs one scenario with and without `speculative_config`: a batch
whose prompts repeat themselves (so drafts are proposed, accepted and rejected), cut into chunks
(image spans included), preempted (a KV pool too small for the batch), with prefix hits, greedy,
seeded (temperature, top-p, top-k, min-p, penalties, min_tokens), n > 1, stop strings that end a
request inside an accepted run, logprobs, and a structured-output row (which does not speculate).
Tokens, texts and finish reasons are equal; logprobs within 1e-5 (the verify pass's logits come from
an extend over 1 + k positions, plain decode's from a decode step: measured differences up to 4.5e-6).
After each run the pools are empty.

The statistical test samples many unseeded requests (temperature 1, top-k 5) whose n-gram drafts are
accepted about two times in three, and checks, by a chi-square test against the model's exact
distributions, the first two tokens a verify pass gives.
"""

from __future__ import annotations

import argparse
import math
import random
from collections import Counter

import pytest

from tests.test_async_scheduling import assert_pools_empty, engine_options, scenario
from vlmrun import LLM, SamplingParams
from vlmrun.config import EngineConfig
from vlmrun.spec_decode.config import SpeculativeConfig
from vlmrun.spec_decode.metrics import SpecDecodeStats
from vlmrun.spec_decode.ngram import NgramProposer
from vlmrun.structured import StructuredOutputsParams

FULL_ATTENTION = ["qwen3", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe"]
VL_ARCHS = {"qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe"}
SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
LOGPROB_TOL = 1e-5


def spec_scenario(with_images: bool) -> tuple[list, list]:
    """The async-scheduling scenario plus repeating prompts, a seeded row with every sampling knob and
    a structured-output row."""
    prompts, params = scenario(with_images)
    prompts += ["one two three four one two three four one two three four one two three",
                "abc abc abc abc abc abc abc abc",
                "Describe the scene.",
                "red green blue red green blue red green blue red"]
    params += [SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=3),
               SamplingParams(max_tokens=16, temperature=0.9, top_p=0.95, top_k=40, min_p=0.02, seed=5,
                              repetition_penalty=1.1, presence_penalty=0.2, frequency_penalty=0.1, min_tokens=6,
                              logprobs=1),
               SamplingParams(max_tokens=30, temperature=0.0,
                              structured_outputs=StructuredOutputsParams(regex="[a-c]{3}-[0-9]{2}")),
               SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, logprobs=2)]
    return prompts, params


def run(model_dir, prompts: list, params: list, speculative_config, **overrides) -> tuple[list, object]:
    """One call; returns the outputs and the engine's stats. The engine is left empty."""
    llm = LLM(str(model_dir), **engine_options(model_dir, speculative_config=speculative_config, **overrides))
    try:
        outputs = llm.generate(prompts, params, use_tqdm=False)
        stats = llm.engine.stats()
        assert_pools_empty(llm.engine)
    finally:
        llm.engine.shutdown()
    return outputs, stats


def assert_same(plain: list, spec: list, logprob_tol: float = LOGPROB_TOL) -> None:
    assert len(plain) == len(spec)
    for p, s in zip(plain, spec):
        assert p.error is None and s.error is None
        assert len(p.outputs) == len(s.outputs)
        for cp, cs in zip(p.outputs, s.outputs):
            assert cs.token_ids == cp.token_ids and cs.text == cp.text
            assert cs.finish_reason == cp.finish_reason and cs.stop_reason == cp.stop_reason
            assert (cs.logprobs is None) == (cp.logprobs is None)
            for step, (lp, ref) in enumerate(zip(cs.logprobs or [], cp.logprobs or [])):
                assert lp.keys() == ref.keys(), step
                assert all(abs(lp[t] - ref[t]) <= logprob_tol for t in lp), (step, lp, ref)


def total(outputs: list) -> SpecDecodeStats:
    stats = SpecDecodeStats()
    for out in outputs:
        assert out.metrics.spec_decode is not None
        stats = stats.merged(out.metrics.spec_decode)
    return stats


@pytest.mark.parametrize("arch", FULL_ATTENTION)
def test_speculation_equals_plain_decode_on_every_full_attention_architecture(arch, request):
    model_dir = request.getfixturevalue(f"{arch}_dir")
    prompts, params = spec_scenario(arch in VL_ARCHS)
    plain, plain_stats = run(model_dir, prompts, params, None)
    spec, spec_stats = run(model_dir, prompts, params, SPEC)
    assert_same(plain, spec)
    assert all(out.metrics.spec_decode is None for out in plain)
    stats = total(spec)
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens  # drafts were accepted and rejected
    structured = spec[len(prompts) - 2].metrics.spec_decode
    assert structured.num_drafts == 0  # a structured-output row decodes plainly
    # the scenario chunks, preempts and hits the prefix cache with speculation on
    assert spec_stats.num_preemptions > 0 and spec_stats.prefix_hit_tokens > 0
    assert plain_stats.prefix_hit_tokens > 0


def test_stops_inside_an_accepted_run(qwen3_dir):
    """A run of accepted drafts is cut where plain decode stops: at max_tokens, at a stop token id, at
    EOS (this model's, reached once min_tokens keeps the repeated token from ending the request) and at
    a stop string; the run's tokens after it are dropped."""
    prompt = "red green blue red green blue red green blue red"
    greedy = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    reference, _ = run(qwen3_dir, [prompt], [greedy], None)
    text, tokens = reference[0].text, reference[0].token_ids
    repeated = Counter(tokens).most_common(1)[0][0]  # the token the drafts keep proposing
    assert tokens.count(repeated) > 10
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (5, 6, 17)]
    later = next(t for i, t in enumerate(tokens) if i >= 6 and t not in tokens[:i])  # first seen after a run
    params += [SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, stop_token_ids=[later]),
               SamplingParams(max_tokens=40, temperature=0.0, min_tokens=6, stop_token_ids=[repeated]),
               SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, stop=[text[6:9]])]
    plain, _ = run(qwen3_dir, [prompt] * len(params), params, None)
    spec, _ = run(qwen3_dir, [prompt] * len(params), params, SPEC)
    assert_same(plain, spec)
    assert [len(o.token_ids) for o in spec[:3]] == [5, 6, 17]
    assert spec[3].outputs[0].stop_reason == later and spec[3].token_ids == tokens[:tokens.index(later) + 1]
    assert spec[4].finish_reason == "stop" and spec[4].outputs[0].stop_reason is None  # EOS
    assert spec[5].outputs[0].stop_reason == text[6:9] and spec[5].finish_reason == "stop"
    assert all(o.metrics.spec_decode.num_accepted_tokens > 0 for o in spec[2:])


def test_chunked_budget_smaller_than_the_drafts(qwen3_vl_dir):
    """A token budget of 2: a decode has room for one draft at most, prompts are cut into 2-token chunks."""
    prompts, params = spec_scenario(True)
    plain, _ = run(qwen3_vl_dir, prompts[-4:], params[-4:], None, max_num_batched_tokens=2)
    spec, _ = run(qwen3_vl_dir, prompts[-4:], params[-4:], SPEC, max_num_batched_tokens=2)
    assert_same(plain, spec)
    stats = total(spec)
    assert stats.num_draft_tokens == stats.num_drafts > 0  # one draft per verify step


def test_padded_decode_path(qwen3_dir):
    """Plain decode steps padded to their buckets between verify steps (enforce_eager=False)."""
    prompts, params = spec_scenario(False)
    plain, _ = run(qwen3_dir, prompts, params, None, enforce_eager=False)
    spec, _ = run(qwen3_dir, prompts, params, SPEC, enforce_eager=False)
    assert_same(plain, spec)


def test_seeded_sampling_gives_plain_decodes_tokens(qwen3_dir):
    """Many seeds: a seeded request's generator draws for the emitted positions only, so each seed
    gives the tokens it gives without speculation, rejections included."""
    prompt = "one two three four one two three four one two three four one two three"
    params = [SamplingParams(max_tokens=12, temperature=0.8, top_k=8, seed=seed, ignore_eos=True) for seed in range(48)]
    plain, _ = run(qwen3_dir, [prompt] * len(params), params, None)
    spec, _ = run(qwen3_dir, [prompt] * len(params), params, SPEC)
    assert_same(plain, spec)
    stats = total(spec)
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens


# ------------------------------------------------------------------------------------ the sampled distribution

TOP_K = 5
NUM_SAMPLES = 1500


def chi2_critical(df: int, z: float = 3.09) -> float:
    """The chi-square quantile of `df` degrees of freedom at the normal quantile z (3.09: p = 0.001),
    by Wilson and Hilferty's cube-root approximation."""
    a = 2.0 / (9.0 * df)
    return df * (1.0 - a + z * math.sqrt(a)) ** 3


def top_k_distribution(logprobs: dict[int, float], chosen: int) -> dict[int, float]:
    """The sampling distribution at temperature 1 with top-k TOP_K, from the TOP_K raw logprobs (the
    chosen token, outside the top-k only if it was not sampled, is dropped)."""
    top = sorted(logprobs.items(), key=lambda kv: -kv[1])[:TOP_K]
    norm = sum(math.exp(v) for _, v in top)
    return {t: math.exp(v) / norm for t, v in top}


def chi2_statistic(samples: list[tuple[tuple, int]], exact: dict[tuple, dict[int, float]],
                   min_expected: float = 5.0) -> tuple[float, int]:
    """Chi-square of (context, token) samples against each context's exact distribution, cells with an
    expected count under `min_expected` pooled per context; returns the statistic and its degrees of freedom."""
    by_context: dict[tuple, Counter] = {}
    for context, token in samples:
        by_context.setdefault(context, Counter())[token] += 1
    stat, df = 0.0, 0
    for context, counts in by_context.items():
        n = sum(counts.values())
        cells = [(counts[t], n * p) for t, p in exact[context].items()]
        rare = [(o, e) for o, e in cells if e < min_expected]
        cells = [(o, e) for o, e in cells if e >= min_expected]
        if rare:
            cells.append((sum(o for o, _ in rare), sum(e for _, e in rare)))
        outside = n - sum(o for o, _ in cells)
        assert outside == 0, f"sampled a token outside the top-{TOP_K} after {context}"
        if len(cells) > 1:
            stat += sum((o - e) ** 2 / e for o, e in cells)
            df += len(cells) - 1
    return stat, df


def test_sampled_distribution_of_the_verified_tokens(qwen3_dir):
    """Unseeded requests at temperature 1, top-k 5, one draft per verify step (max_tokens 3): the
    token at the draft's position (output 2) and the token after it (output 3, the bonus when the
    draft is accepted) follow the model's exact distributions given the tokens before them, by a
    chi-square test at p = 0.001 (the engine's seed is fixed, so the run is deterministic). A sampler
    that accepted drafts without the residual rule, or always, or read the wrong position, lands far
    beyond the bound."""
    base = LLM(str(qwen3_dir), **engine_options(qwen3_dir, max_num_seqs=64, max_num_batched_tokens=2048,
                                                kv_cache_memory_bytes=1 << 27))
    # the prompt ends with the model's own greedy loop, so that n-gram drafts are often likely tokens
    loop = base.generate(["red green blue red green blue red green blue red"],
                         SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True), use_tqdm=False)[0]
    prompt = {"prompt_token_ids": loop.prompt_token_ids + loop.token_ids}
    params = SamplingParams(max_tokens=3, temperature=1.0, top_k=TOP_K, ignore_eos=True)
    llm = LLM(str(qwen3_dir), **engine_options(qwen3_dir, speculative_config=SPEC, max_num_seqs=256,
                                               max_num_batched_tokens=4096, kv_cache_memory_bytes=1 << 28))
    outputs = llm.generate([prompt] * NUM_SAMPLES, params, use_tqdm=False)
    assert_pools_empty(llm.engine)
    stats = total(outputs)
    assert stats.num_drafts > NUM_SAMPLES // 3 and 0.3 < stats.acceptance_rate < 0.8, stats
    samples = [tuple(o.token_ids) for o in outputs]

    contexts = sorted({s[:1] for s in samples} | {s[:2] for s in samples})
    exact_outputs = base.generate([{"prompt_token_ids": prompt["prompt_token_ids"] + list(c)} for c in contexts],
                                  SamplingParams(max_tokens=1, temperature=0.0, logprobs=TOP_K), use_tqdm=False)
    exact = {c: top_k_distribution(o.logprobs[0], o.token_ids[0]) for c, o in zip(contexts, exact_outputs)}
    for position in (1, 2):
        stat, df = chi2_statistic([(s[:position], s[position]) for s in samples], exact)
        assert df >= 8 and stat < chi2_critical(df), (position, stat, df)

    # The same bound rejects wrong samplers, simulated from these samples at the draft's position:
    # one that always accepts the draft, and one that on rejection draws again from p (draft included)
    # instead of from the residual (p(draft) + (1 - p(draft)) p(draft) for the draft).
    first = [(s[:1], s[1]) for s in samples]
    proposer = NgramProposer(1, SPEC["prompt_lookup_min"], SPEC["prompt_lookup_max"])
    draft_after = {c: proposer.propose(prompt["prompt_token_ids"] + list(c), 1) for c, _ in first}
    rng = random.Random(0)
    always = [(c, draft_after[c][0] if draft_after[c] else t) for c, t in first]
    no_residual = [(c, d[0] if d and t != d[0] and rng.random() < exact[c].get(d[0], 0.0) else t)
                   for c, t in first for d in [draft_after[c]]]
    df = chi2_statistic(first, exact)[1]
    for wrong in (always, no_residual):
        assert chi2_statistic(wrong, exact)[0] > 2 * chi2_critical(df)


# ------------------------------------------------------------------------------------ the parts


def test_ngram_proposer():
    proposer = NgramProposer(3, 1, 3)
    assert proposer.propose([1, 2, 3, 4, 1, 2], 5) == [3, 4, 1]  # suffix 1 2 after its earlier occurrence
    assert proposer.propose([1, 2, 3, 4, 1, 2], 2) == [3, 4]  # at most max_drafts
    assert proposer.propose([5, 1, 2, 9, 7, 1, 2, 8, 1, 2], 3) == [8, 1, 2]  # the latest occurrence
    assert proposer.propose([1, 2, 3, 9, 2, 3, 5, 1, 2, 3], 3) == [9, 2, 3]  # the longest n-gram wins
    assert proposer.propose([7, 7, 7], 3) == [7]  # what follows the latest occurrence, up to the end
    assert proposer.propose([1, 2, 3, 4], 3) == []  # no earlier occurrence
    assert NgramProposer(3, 2, 3).propose([1, 5, 2, 1], 3) == []  # [1] alone is shorter than the minimum
    assert proposer.propose([1, 2, 1], 0) == []


def test_speculative_config_follows_vllm_names_and_defaults():
    assert SpeculativeConfig.of(None) is None
    spec = SpeculativeConfig.of({"method": "ngram", "num_speculative_tokens": 2})
    assert (spec.prompt_lookup_min, spec.prompt_lookup_max) == (5, 5)
    spec = SpeculativeConfig.of({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 4})
    assert (spec.prompt_lookup_min, spec.prompt_lookup_max) == (4, 4)
    assert EngineConfig(speculative_config=SPEC).speculative_config == SpeculativeConfig(**SPEC)
    bad = [({"method": "eagle", "num_speculative_tokens": 2}, "method"),
           ({"method": "ngram"}, "num_speculative_tokens"),
           ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
           ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2}, "exceeds"),
           ({"method": "ngram", "num_speculative_tokens": 2, "draft_model": "x"}, "draft_model"),
           ("ngram", "object")]
    for value, named in bad:
        with pytest.raises(ValueError, match=named):
            SpeculativeConfig.of(value)
    with pytest.raises(ValueError, match="async_scheduling"):
        EngineConfig(speculative_config=SPEC, async_scheduling=True)


def test_refused_where_it_cannot_verify(qwen3_5_dir):
    with pytest.raises(ValueError, match="hybrid"):
        LLM(str(qwen3_5_dir), **engine_options(qwen3_5_dir, speculative_config=SPEC))


def test_command_line_flag():
    from vlmrun.cli_options import add_kernel_args, kernel_options

    parser = argparse.ArgumentParser()
    add_kernel_args(parser)
    args = parser.parse_args(["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}'])
    assert kernel_options(args)["speculative_config"] == {"method": "ngram", "num_speculative_tokens": 2}
    assert kernel_options(parser.parse_args([]))["speculative_config"] is None
    for text in ("[1, 2]", "{method"):
        with pytest.raises(SystemExit):
            parser.parse_args(["--speculative-config", text])
