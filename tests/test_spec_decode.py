"""Speculative decoding with n-gram drafts gives plain decode's tokens (greedy and seeded) and keeps
the sampled distribution (unseeded).

Every architecture runs one scenario with and without `speculative_config`: a batch whose prompts
repeat themselves (so drafts are proposed, accepted and rejected), cut into chunks (image spans
included), preempted (a KV pool too small for the batch), with prefix hits (GDN state snapshots for
the hybrid models), greedy, seeded (temperature, top-p, top-k, min-p, penalties, min_tokens), n > 1,
stop strings, logprobs, and a structured-output row (tests/test_spec_decode_structured.py has more).
The same scenario runs again with drafts taken from reference runs (`OracleDrafts`: accepted whole, in part and not at all,
where the tiny hybrid models' n-gram drafts are all rejected). After each run the pools are empty.

Tokens, texts and finish reasons are equal; logprobs within 5e-5 (`assert_same`, the async-scheduling
tests' bound). Why not 1e-5: the float32 CPU engine's logprobs move with the schedule on their own,
and speculation changes the schedule (and computes a verified position in an extend over 1 + k
positions where plain decode computes it in a decode step). Measured on this scenario, the largest
difference over all architectures: plain decode with a token budget of 39 against 40, 1.44e-5 on an
AVX-512 CPU and 1.72e-5 capped at AVX2 (ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2); n-gram
speculation against plain decode, 7.6e-6 and 1.53e-5; `OracleDrafts`, 1.98e-5 and 3.35e-5.

For hybrid models the GDN backend's verify pass is also checked on its own: the states it keeps after
each position, and the slot after `keep_accepted_states`, equal those of plain decode steps, bit for
bit. The statistical test samples many unseeded requests (temperature 1, top-k 5) whose n-gram drafts
are accepted about half the time, and checks, by a chi-square test against the model's exact
distributions, the first two tokens a verify pass gives.
"""

from __future__ import annotations

import argparse
import math
import random
from collections import Counter

import pytest

import torch

from testing.tiny_models import ARCHS, HYBRID_ARCHS
from tests.conftest import make_sample_images
from tests.test_async_scheduling import assert_pools_empty, assert_same, engine_options, scenario
from tests.test_gdn_pool import CONV_DIM, DK, DV, HK, HV, KERNEL, Stream, gdn_batch, make_pool
from vlmrun import LLM, SamplingParams
from vlmrun.config import EngineConfig
from vlmrun.configs.speculative import SpeculativeConfig
from vlmrun.layers.attention import GDNAttention
from vlmrun.layers.attention.factory import GDN_BACKENDS
from vlmrun.layers.attention.torch_gdn_backend import TorchGDNBackend
from vlmrun.spec_decode.metrics import SpecDecodeStats
from vlmrun.spec_decode.ngram import NgramProposer
from vlmrun.structured import StructuredOutputsParams

VL_ARCHS = {"qwen2_5_vl", "qwen3_vl", "qwen3_5", "qwen3_5_moe", "qwen3_vl_moe"}
SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


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


def total(outputs: list) -> SpecDecodeStats:
    stats = SpecDecodeStats()
    for out in outputs:
        assert out.metrics.spec_decode is not None
        stats = stats.merged(out.metrics.spec_decode)
    return stats


@pytest.mark.parametrize("arch", ARCHS)
def test_speculation_equals_plain_decode_on_every_architecture(arch, request):
    model_dir = request.getfixturevalue(f"{arch}_dir")
    prompts, params = spec_scenario(arch in VL_ARCHS)
    plain, plain_stats = run(model_dir, prompts, params, None)
    spec, spec_stats = run(model_dir, prompts, params, SPEC)
    assert_same(plain, spec)
    assert all(out.metrics.spec_decode is None for out in plain)
    stats = total(spec)
    assert stats.num_accepted_tokens < stats.num_draft_tokens  # drafts were rejected
    if arch not in HYBRID_ARCHS:  # (the tiny hybrid models never repeat themselves: OracleDrafts below)
        assert stats.num_accepted_tokens > 0
    # the scenario chunks, preempts and hits the prefix cache with speculation on
    assert spec_stats.num_preemptions > 0 and spec_stats.prefix_hit_tokens > 0
    assert plain_stats.prefix_hit_tokens > 0


class OracleDrafts:
    """Drafts from reference runs: after a context that is a prefix of one of `references` (prompt +
    plain decode's output), the next reference tokens, with every third position of the sequence
    replaced by a wrong token, so that runs are accepted whole, in part and not at all. Tests the
    verify pass where n-gram drafts would all be rejected (the tiny hybrid models never repeat)."""

    drafts_on_device = False
    drafts_grammar_rows = True

    def __init__(self, references: list[list[int]], k: int, vocab_size: int):
        self.references, self.k, self.vocab_size = references, k, vocab_size

    def forget(self, key: object) -> None:
        """Nothing is kept per request."""

    def propose(self, token_ids: list[int], max_drafts: int, key: object = None) -> list[int]:
        n = len(token_ids)
        for ref in self.references:
            if len(ref) > n and ref[:n] == token_ids:
                drafts = ref[n:n + min(self.k, max_drafts)]
                return [(t + 1) % self.vocab_size if (n + j) % 3 == 0 else t for j, t in enumerate(drafts)]
        return []


@pytest.mark.parametrize("arch", ARCHS)
def test_partly_accepted_drafts_on_every_architecture(arch, request):
    """Drafts accepted whole, in part and not at all (OracleDrafts), with images, chunked prompts,
    preemption and prefix hits (GDN snapshots for the hybrid models): plain decode's tokens and logprobs."""
    model_dir = request.getfixturevalue(f"{arch}_dir")
    prompts, params = spec_scenario(arch in VL_ARCHS)
    plain, _ = run(model_dir, prompts, params, None)
    references = [out.prompt_token_ids + c.token_ids for out in plain for c in out.outputs]
    llm = LLM(str(model_dir), **engine_options(model_dir, speculative_config=SPEC))
    llm.engine.scheduler.proposer = OracleDrafts(references, 3, llm.engine.model_config.text_config.vocab_size)
    spec = llm.generate(prompts, params, use_tqdm=False)
    engine_stats = llm.engine.stats()
    assert_pools_empty(llm.engine)
    assert_same(plain, spec)
    stats = total(spec)
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert stats.num_accepted_tokens > stats.num_drafts  # runs of more than one accepted draft
    assert engine_stats.prefix_hit_tokens > 0
    if arch != "qwen3":  # (its text-only batch fits once drafts end requests sooner; its n-gram run preempts)
        assert engine_stats.num_preemptions > 0


@pytest.mark.parametrize("arch, mode", [("qwen3_5", {}), ("qwen3_5", {"enforce_eager": False}),
                                        ("qwen3_5", {"async_scheduling": True}), ("qwen3_5_moe", {})])
def test_partly_rejected_drafts_after_a_snapshot_boundary(arch, mode, request):
    """Hybrid requests with an image: one whose prompt ends on a page boundary (a GDN snapshot point:
    the snapshot is taken from the slot right before the first verify pass), one whose prompt ends one
    token past it (its first chunk is cut there for the snapshot); each decodes with drafts accepted and
    rejected across page boundaries, then runs again: the second restores the snapshot (a prefix hit)
    and verifies from it. Every answer equals plain decode's; eagerly, with verify steps padded (as on
    CUDA) and with async scheduling."""
    model_dir = request.getfixturevalue(f"{arch}_dir")
    options = dict(prefix_snapshot_interval=16, max_num_batched_tokens=64, **mode)
    llm = LLM(str(model_dir), **engine_options(model_dir, **options))
    image = make_sample_images()[0]
    candidates = [{"prompt": "Describe it" + "." * n, "images": [image]} for n in range(20)]
    lengths = [len(llm.engine.process(p).token_ids) for p in candidates]
    prompts = [next(p for p, n in zip(candidates, lengths) if n % 16 == r) for r in (0, 1)]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, logprobs=2)
    plain = [llm.generate([p], params, use_tqdm=False)[0] for p in prompts for _ in range(2)]
    llm.engine.shutdown()
    references = [out.prompt_token_ids + out.token_ids for out in plain]

    llm = LLM(str(model_dir), **engine_options(model_dir, speculative_config=SPEC, **options))
    llm.engine.scheduler.proposer = OracleDrafts(references, 3, llm.engine.model_config.text_config.vocab_size)
    spec = [llm.generate([p], params, use_tqdm=False)[0] for p in prompts for _ in range(2)]
    hits = llm.engine.stats().prefix_hit_tokens
    assert_pools_empty(llm.engine)
    assert_same(plain, spec)
    assert hits == len(plain[2].prompt_token_ids) - 1  # the second prompt's full pages, from their snapshot
    for out in spec:
        stats = out.metrics.spec_decode
        assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens


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


def brute_force_drafts(tokens: list[int], k: int, low: int, high: int) -> list[int]:
    """The rule by its definition: for n from high down to low, the latest earlier occurrence of the last n tokens."""
    for n in range(min(high, len(tokens) - 1), low - 1, -1):
        starts = [i for i in range(len(tokens) - n) if tokens[i:i + n] == tokens[len(tokens) - n:]]
        if starts:
            return tokens[starts[-1] + n:starts[-1] + n + k]
    return []


def test_ngram_proposer_matches_its_definition():
    rng = random.Random(0)
    for _ in range(2000):
        tokens = [rng.randrange(4) for _ in range(rng.randrange(1, 30))]
        k, low = rng.randrange(1, 5), rng.randrange(1, 4)
        high = low + rng.randrange(0, 3)
        assert NgramProposer(k, low, high).propose(tokens, 9) == brute_force_drafts(tokens, k, low, high), tokens


def test_speculative_config_follows_vllm_names_and_defaults():
    assert SpeculativeConfig.of(None) is None
    spec = SpeculativeConfig.of({"method": "ngram", "num_speculative_tokens": 2})
    assert (spec.prompt_lookup_min, spec.prompt_lookup_max) == (5, 5)
    spec = SpeculativeConfig.of({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 4})
    assert (spec.prompt_lookup_min, spec.prompt_lookup_max) == (4, 4)
    assert EngineConfig(speculative_config=SPEC).speculative_config == SpeculativeConfig(**SPEC)
    for alias in ("qwen3_next_mtp", "qwen3_5_mtp"):  # the Qwen model cards' vLLM commands pass the first
        assert SpeculativeConfig.of({"method": alias, "num_speculative_tokens": 2}) == SpeculativeConfig("mtp", 2)
    bad = [({"method": "eagle", "num_speculative_tokens": 2}, "method"),
           ({"method": "ngram"}, "num_speculative_tokens"),
           ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
           ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2}, "exceeds"),
           ({"method": "ngram", "num_speculative_tokens": 2, "draft_model": "x"}, "draft_model"),
           ("ngram", "object")]
    for value, named in bad:
        with pytest.raises(ValueError, match=named):
            SpeculativeConfig.of(value)
    assert EngineConfig(speculative_config=SPEC, async_scheduling=True).async_scheduling  # (test_async_spec_decode)
    assert EngineConfig(speculative_config=SPEC, tensor_parallel_size=2).tensor_parallel_size == 2  # (test_spec_decode_tp)


def test_refused_where_it_cannot_verify(qwen3_5_dir, monkeypatch):
    """A GDN backend that keeps no per-position states (as FLA's) cannot serve a verify pass."""

    class NoVerify(TorchGDNBackend):
        verifies_drafts = False

    monkeypatch.setitem(GDN_BACKENDS, "fla", lambda setup: NoVerify(setup.caches.gdn_pool))
    with pytest.raises(ValueError, match="keeps the state after each draft position"):
        LLM(str(qwen3_5_dir), **engine_options(qwen3_5_dir, speculative_config=SPEC, gdn_backend="fla"))


def test_gdn_verify_pass_keeps_plain_decode_states():
    """Two sequences verify 1 + 3 positions beside a plain decode; the states kept after each position,
    the outputs, and the slots after `keep_accepted_states` (one draft accepted, all three, none) equal
    those of plain decode steps over the same tokens, bit for bit."""
    layer = GDNAttention(1, HK, HV, DK, DV, KERNEL)
    weight = torch.randn(CONV_DIM, KERNEL, generator=torch.Generator().manual_seed(0)) * 0.5
    streams = [Stream(24, 1), Stream(24, 2), Stream(24, 3)]
    slots = [1, 2, 3]

    def prefill(backend: TorchGDNBackend) -> None:
        fb = gdn_batch(backend, [20, 20, 20], [0, 0, 0], slots)
        backend.forward(torch.cat([s.x[:20] for s in streams]), torch.cat([s.g[:20] for s in streams]),
                        torch.cat([s.beta[:20] for s in streams]), weight, layer, fb)

    plain = TorchGDNBackend(make_pool())
    prefill(plain)
    plain_outs, plain_states = [], []  # per decode step: outputs [3, Hv, Dv]; (conv, rec) of every slot
    for t in range(20, 24):
        fb = gdn_batch(plain, [1, 1, 1], [t, t, t], slots)
        plain_outs.append(plain.forward(torch.stack([s.x[t] for s in streams]), torch.stack([s.g[t] for s in streams]),
                                        torch.stack([s.beta[t] for s in streams]), weight, layer, fb))
        plain_states.append((plain.pool.conv_state[1].clone(), plain.pool.recurrent_state[1].clone()))

    spec = TorchGDNBackend(make_pool())
    prefill(spec)
    lens = [4, 4, 1]  # streams 0 and 1 feed their last token and 3 drafts; stream 2 decodes one token
    fb = gdn_batch_with_drafts(spec, lens, [20, 20, 20], slots, [3, 3, 0])
    out = spec.forward(torch.cat([s.x[20:20 + n] for s, n in zip(streams, lens)]),
                       torch.cat([s.g[20:20 + n] for s, n in zip(streams, lens)]),
                       torch.cat([s.beta[20:20 + n] for s, n in zip(streams, lens)]), weight, layer, fb)
    for seq in (0, 1):
        for t in range(4):
            assert torch.equal(out[seq * 4 + t], plain_outs[t][seq])
    assert torch.equal(out[8], plain_outs[0][2])
    (group,) = fb.gdn_metadata.verifies
    for t in range(4):
        assert torch.equal(group.conv_states[1][:, t], plain_states[t][0][[1, 2]])
        assert torch.equal(group.recurrent_states[1][:, t], plain_states[t][1][[1, 2]])

    for accepted in ([1, 3, 0], [0, 0, 0], [3, 2, 0]):
        spec.keep_accepted_states(fb.gdn_metadata, accepted)
        for seq in (0, 1):
            conv, rec = plain_states[accepted[seq]]  # after the last known token and `accepted` drafts
            assert torch.equal(spec.pool.conv_state[1, slots[seq]], conv[slots[seq]])
            assert torch.equal(spec.pool.recurrent_state[1, slots[seq]], rec[slots[seq]])
        assert torch.equal(spec.pool.recurrent_state[1, 3], plain_states[0][1][3])  # the decode row's own step


def gdn_batch_with_drafts(backend: TorchGDNBackend, lens: list[int], prefix: list[int], slots: list[int],
                          num_drafts: list[int]):
    fb = gdn_batch(backend, lens, prefix, slots)
    fb.num_drafts_cpu = num_drafts
    backend.prepare(fb)
    return fb


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
