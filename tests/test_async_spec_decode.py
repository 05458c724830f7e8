"""Async scheduling with speculative decoding gives the synchronous engine's tokens, and plain decode's.

With `async_scheduling=True` the engine plans step N+1 while step N runs. A verify step's accepted
length is known only once it is collected, so a request whose launched step verifies drafts waits one
step (`Scheduler.must_wait`) while the others run ahead; an n-gram request also waits for its last
token (its drafts are looked up from it), an MTP request drafts on the device after a placeholder.
What acceptance decides on the device (GDN slots, MTP outputs, each row's last token) is queued by the
step's launch (`ModelRunner.settle_on_device`), never at collect.

Each scenario runs three ways: plain decode, synchronous speculation and async speculation; tokens,
texts and finish reasons are equal, logprobs within `assert_same`'s 5e-5. The async runs go both
ways the overlapped runner can order steps: on a worker thread (the CPU), and on the engine's thread
with step N+1 launched before step N is collected (`stream_order`: the order CUDA's stream gives, so
a device write made at collect would land after the next step's cache writes). After each run the
pools are empty.
"""

from __future__ import annotations

import pytest
import torch

from tests.test_async_scheduling import assert_pools_empty, assert_same, engine_options
from tests.test_spec_decode import SPEC, OracleDrafts, run, spec_scenario, total
from tests.test_spec_decode_mtp import MTP, generate, mtp_dirs, mtp_options  # noqa: F401 (mtp_dirs: a fixture)
from tests.test_spec_decode_structured import references_of, structured_scenario
from vlmrun import LLM, SamplingParams
from vlmrun.config import EngineConfig
from vlmrun.engine.engine import Engine


def stream_order(engine: Engine) -> None:
    """The overlapped runner without its worker thread: `launch` runs the step at once on the engine's
    thread and `collect` reads it later, after the next step's launch (as on CUDA, in program order)."""
    engine.executor.shutdown()
    engine.executor._worker = None


class RanAhead:
    """Counts the steps planned while a request waited for its launched verify step."""

    def __init__(self, engine: Engine):
        self.count, scheduler = 0, engine.scheduler
        schedule = scheduler.schedule

        def counting_schedule():
            waiting = any(r.num_launched_drafts for r in scheduler.running)
            chunks, decodes, too_long = schedule()
            self.count += bool(waiting and (chunks or decodes))
            return chunks, decodes, too_long

        scheduler.schedule = counting_schedule


def run_async(model_dir, prompts: list, params: list, spec, ordered: bool, references=None,
              **options) -> tuple[list, object, int]:
    """One async call (`options`: the engine's); outputs, the engine's stats, steps that ran ahead."""
    llm = LLM(str(model_dir), **{**options, "speculative_config": spec, "async_scheduling": True})
    try:
        if ordered:
            stream_order(llm.engine)
        if references is not None:
            llm.engine.scheduler.proposer = OracleDrafts(references, 3, llm.engine.model_config.text_config.vocab_size)
        ran_ahead = RanAhead(llm.engine)
        outputs = llm.generate(prompts, params, use_tqdm=False)
        stats = llm.engine.stats()
        assert_pools_empty(llm.engine)
    finally:
        llm.engine.shutdown()
    return outputs, stats, ran_ahead.count


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_5"])
def test_ngram_with_async_scheduling(arch, request):
    """The n-gram scenario (images, chunked prompts, preemption, prefix hits, greedy, seeded, n > 1, stop
    strings, penalties, a regex row); the hybrid model with reference drafts, accepted whole, in part
    and not at all (its own n-gram drafts are all rejected)."""
    model_dir = request.getfixturevalue(f"{arch}_dir")
    prompts, params = spec_scenario(arch == "qwen3_5")
    plain, _ = run(model_dir, prompts, params, None)
    references = references_of(plain) if arch == "qwen3_5" else None
    for ordered in (False, True):
        spec, stats, ran_ahead = run_async(model_dir, prompts, params, SPEC, ordered, references,
                                           **engine_options(model_dir))
        assert_same(plain, spec)
        counters = total(spec)
        assert 0 < counters.num_accepted_tokens < counters.num_draft_tokens
        assert stats.num_preemptions > 0 and stats.prefix_hit_tokens > 0 and ran_ahead > 0


def test_mtp_with_async_scheduling(mtp_dirs):
    """MTP drafts (made on the device, also right after a placeholder for the last token), the n-gram
    scenario with images on Qwen3.5: plain decode's tokens, and the synchronous MTP engine's."""
    model_dir = mtp_dirs["qwen3_5"]
    prompts, params = spec_scenario(True)
    plain, _ = generate(model_dir, prompts, params, None)
    sync, _ = generate(model_dir, prompts, params, MTP)
    for ordered in (False, True):
        spec, stats, ran_ahead = run_async(model_dir, prompts, params, MTP, ordered, **mtp_options(model_dir))
        assert_same(plain, spec)
        assert_same(sync, spec)
        assert total(spec).num_draft_tokens > 3 * len(prompts)
        assert stats.num_preemptions > 0 and stats.prefix_hit_tokens > 0 and ran_ahead > 0


def test_structured_outputs_with_async_scheduling(qwen3_dir, mtp_dirs):
    """JSON schema, JSON object, regex, choice and a thinking budget, greedy and seeded, with n-gram
    drafts, reference drafts (partly forbidden by the grammar) and MTP drafts."""
    prompts, params = structured_scenario()
    plain, _ = run(qwen3_dir, prompts, params, None)
    for references in (None, references_of(plain)):
        spec, _, _ = run_async(qwen3_dir, prompts, params, SPEC, True, references, **engine_options(qwen3_dir))
        assert_same(plain, spec)
        assert total(spec).num_drafts > 0
    model_dir = mtp_dirs["qwen3_5"]
    plain, _ = generate(model_dir, prompts, params, None)
    spec, _, _ = run_async(model_dir, prompts, params, MTP, True, **mtp_options(model_dir))
    assert_same(plain, spec)


def test_stops_and_seeds_with_async_scheduling(qwen3_dir):
    """Runs of accepted drafts cut at max_tokens, a stop token, EOS and a stop string; seeded rows (their
    generators wound back after rejections) give plain decode's tokens."""
    prompt = "red green blue red green blue red green blue red"
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (5, 6, 17)]
    params += [SamplingParams(max_tokens=40, temperature=0.0, min_tokens=6),
               SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, stop=[" blue red"])]
    params += [SamplingParams(max_tokens=12, temperature=0.8, top_k=8, seed=seed, ignore_eos=True) for seed in range(12)]
    plain, _ = run(qwen3_dir, [prompt] * len(params), params, None)
    spec, _, _ = run_async(qwen3_dir, [prompt] * len(params), params, SPEC, True, **engine_options(qwen3_dir))
    assert_same(plain, spec)
    assert all(o.metrics.spec_decode.num_accepted_tokens > 0 for o in spec[2:5])


@pytest.mark.parametrize("ordered", [False, True], ids=["worker", "stream_order"])
def test_abort_during_a_verify_step_frees_its_slot_for_the_next(qwen3_5_dir, ordered):
    """A hybrid request aborted while its verify step runs; the waiting request admitted in the next
    step takes its row and GDN slot. The verify step's GDN writes land before that request's zeroed
    slot and prefill: every request left gives plain decode's tokens, and the pools end empty."""
    texts = [f"Request {i}: one two three one two three one two three one two" for i in range(3)]
    greedy = SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True)
    plain, _ = run(qwen3_5_dir, texts, [greedy] * 3, None, max_num_seqs=2)
    config = EngineConfig(model=str(qwen3_5_dir), **engine_options(qwen3_5_dir, max_num_seqs=2, async_scheduling=True,
                                                                   speculative_config=SPEC))
    engine = Engine(config)
    if ordered:
        stream_order(engine)
    for i, text in enumerate(texts):
        engine.add_request(f"r{i}", engine.process(text), greedy)
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(3)}
    aborted_row, reused = None, False
    while engine.has_unfinished():
        r1 = engine.requests.get("r1")
        if aborted_row is None and r1 is not None and r1.num_launched_drafts:
            aborted_row = r1.req_pool_idx
            engine.abort("r1")
        for update in engine.step():
            tokens[update.request_id] += update.new_token_ids
        r2 = engine.requests.get("r2")
        reused = reused or (aborted_row is not None and r2 is not None and r2.req_pool_idx == aborted_row)
    assert reused
    assert_pools_empty(engine)
    engine.shutdown()
    assert tokens["r0"] == plain[0].token_ids and tokens["r2"] == plain[2].token_ids
    assert tokens["r1"] == plain[1].token_ids[:len(tokens["r1"])] and len(tokens["r1"]) < 14


def test_tensor_parallel_with_async_scheduling(mtp_dirs):
    """TP=2 (the ranks run their steps in order; launch and collect are async already): reference drafts
    with structured rows, and MTP drafts, give TP=1's tokens without speculation."""
    from tests.test_spec_decode_tp import PROMPTS, params_list
    from tests.test_tensor_parallel import engine_options as tp_options

    model_dir, params = mtp_dirs["qwen3_5"], params_list()
    plain, _ = run(model_dir, PROMPTS, params, None, **tp_options(model_dir, 1))
    oracle, _, _ = run_async(model_dir, PROMPTS, params, SPEC, False, references_of(plain), **tp_options(model_dir, 2))
    assert_same(plain, oracle)
    assert 0 < total(oracle).num_accepted_tokens < total(oracle).num_draft_tokens
    spec, _, _ = run_async(model_dir, PROMPTS[:2], params[:2], MTP, False, **tp_options(model_dir, 2))
    assert_same(plain[:2], spec)
    assert total(spec).num_draft_tokens > 0


def test_asked_for_it_runs_with_speculation():
    """None stays off with speculative decoding (no gain measured: a speculating request waits for each
    verify step); asked for, it runs."""
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    for spec in ({"method": "ngram", "num_speculative_tokens": 2}, MTP):
        assert not EngineConfig(speculative_config=spec).overlaps_steps(cuda)
        assert EngineConfig(speculative_config=spec, async_scheduling=True).overlaps_steps(cpu)


@pytest.mark.gpu
def test_async_speculation_on_cuda(qwen3_5_dir):
    """On CUDA the stream orders the steps: the n-gram scenario with reference drafts on the hybrid
    model, logprobs within the CUDA float32 budget of tests/test_async_scheduling.py's CUDA test."""
    prompts, params = spec_scenario(True)
    plain, _ = run(qwen3_5_dir, prompts, params, None, device="cuda")
    options = engine_options(qwen3_5_dir, device="cuda")
    spec, _, ran_ahead = run_async(qwen3_5_dir, prompts, params, SPEC, False, references_of(plain), **options)
    assert_same(plain, spec, logprob_tol=2e-4)
    assert ran_ahead > 0
