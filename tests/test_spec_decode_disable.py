"""`disable_by_batch_size` (vLLM's `SpeculativeConfig` key): a request added while more than that many
requests are enqueued (running + waiting) never speculates; the others speculate as before.

On a tiny hybrid checkpoint with an MTP layer, n-gram and MTP drafts: the n-gram / MTP scenario of
tests/test_spec_decode.py (images, chunked prompts, preemption, prefix hits, greedy and seeded rows,
n > 1, a structured row), its requests added at once, gives plain decode's tokens; the requests added
above the limit report no drafts, those below do. With MTP the layer never runs over a
non-speculating request's positions (its prompt's excepted while the prefix cache may hand those
pages to a request that drafts), and the speculating requests' drafts, made beside it, still equal
transformers' MTP modules' drafts.
"""

from __future__ import annotations

import argparse

import pytest

from testing.tiny_mtp import MTPReference
from tests.test_async_scheduling import assert_pools_empty, assert_same
from tests.test_spec_decode import SPEC, run, spec_scenario
from tests.test_spec_decode_mtp import MTP, mtp_dirs, mtp_options  # noqa: F401 (mtp_dirs: a fixture)
from vlmrun import LLM, SamplingParams
from vlmrun.cli_options import add_kernel_args, kernel_options
from vlmrun.config import EngineConfig
from vlmrun.configs.speculative import SpeculativeConfig

LIMIT = 5  # requests 0 .. 5 (at most 5 enqueued before them) speculate, the later ones do not


def test_the_key_is_checked_and_passed_through():
    for method in (SPEC, MTP):
        assert SpeculativeConfig.of({**method, "disable_by_batch_size": 4}).disable_by_batch_size == 4
        assert SpeculativeConfig.of(method).disable_by_batch_size is None
        for bad in (0, -2, True, 1.5, "4"):
            with pytest.raises(ValueError, match="disable_by_batch_size must be an integer >= 1"):
                SpeculativeConfig.of({**method, "disable_by_batch_size": bad})
    parser = argparse.ArgumentParser()  # vlmrun serve / caption / chat take --speculative-config through these
    add_kernel_args(parser)
    text = '{"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 8}'
    options = kernel_options(parser.parse_args(["--speculative-config", text]))
    assert EngineConfig(speculative_config=options["speculative_config"]).speculative_config.disable_by_batch_size == 8


@pytest.mark.parametrize("method", ["ngram", "mtp", "ngram-async"])
def test_requests_above_the_limit_never_speculate(method, mtp_dirs):
    model_dir = mtp_dirs["qwen3_5"]
    prompts, params = (items[-4:] + items[:-4] for items in spec_scenario(True))  # its drafting-prone rows first
    config = {**(MTP if method == "mtp" else SPEC), "disable_by_batch_size": LIMIT}
    options = mtp_options(model_dir, async_scheduling=method.endswith("async"))
    plain, _ = run(model_dir, prompts, params, None, **options)
    spec, stats = run(model_dir, prompts, params, config, **options)
    assert_same(plain, spec)
    assert stats.prefix_hit_tokens > 0 and (stats.num_preemptions > 0 or method == "ngram-async")
    first = [sum(p.n for p in params[:i]) for i in range(len(params))]  # each output's first engine request
    above = [out.metrics.spec_decode for out, e in zip(spec, first) if e > LIMIT]
    below = [out.metrics.spec_decode for out, e in zip(spec, first) if e + params[first.index(e)].n - 1 <= LIMIT]
    assert len(above) >= 5 and len(below) == LIMIT + 1
    assert all(s.num_drafts == s.num_draft_tokens == s.num_accepted_tokens == 0 for s in above)
    assert sum(s.num_drafts > 0 for s in below) >= 3
    assert stats.spec_decode.num_draft_tokens == sum(s.num_draft_tokens for s in below)


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_mtp_layer_skips_requests_that_never_draft(prefix_caching, mtp_dirs):
    """Three greedy requests, the last above the limit: the MTP layer catches up over the first two only
    (and over the third's prompt when the prefix cache is on), in steps that run all three; the first
    two's drafts equal transformers' modules' after the same tokens."""
    model_dir = mtp_dirs["qwen3_next"]
    llm = LLM(str(model_dir), **mtp_options(model_dir, speculative_config={**MTP, "disable_by_batch_size": 1},
                                            enable_prefix_caching=prefix_caching, max_num_batched_tokens=64))
    scheduler, drafter = llm.engine.scheduler, llm.engine.executor.drafter
    scheduled: list[dict[int, tuple[str, bool]]] = []  # per step: page-table row -> (request id, feeds its prompt)
    caught_up: list[tuple[int, list[int]]] = []  # (step, rows the MTP layer ran over)
    made: list[tuple[int, int, list[int]]] = []  # (step, first fed token, drafts) per speculating chunk
    schedule, catch_up, draft = scheduler.schedule, drafter.catch_up, drafter.draft

    def recording_schedule():
        chunks, decodes, too_long = schedule()  # (speculating: no plain decode rows)
        scheduled.append({c.request.req_pool_idx: (c.request.request_id, c.start < c.request.num_prompt_tokens)
                          for c in chunks})
        return chunks, decodes, too_long

    def recording_catch_up(hidden, next_ids, fb, backend, chunk_ends):
        caught_up.append((len(scheduled) - 1, fb.req_pool_indices.tolist()))
        return catch_up(hidden, next_ids, fb, backend, chunk_ends)

    def recording_draft(chunks, backend, device):
        drafts = draft(chunks, backend, device)
        made.extend((c.row, c.start, d[:c.num_drafts]) for c, d in zip(chunks, drafts.tolist()))
        return drafts

    scheduler.schedule, drafter.catch_up, drafter.draft = recording_schedule, recording_catch_up, recording_draft
    prompts = ["one two three four one two three four", "Tell me a story about the sea.",
               "Count to ten, slowly, one number at a time, then back down to one again."]
    outputs = llm.generate(prompts, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True), use_tqdm=False)
    assert_pools_empty(llm.engine)
    assert [out.metrics.spec_decode.num_drafts > 0 for out in outputs] == [True, True, False]
    assert len(outputs[2].prompt_token_ids) > 16  # a full page (page_size 16) the prefix cache may share

    mixed = 0
    for step, rows in caught_up:
        expected = [row for row, (rid, in_prompt) in scheduled[step].items()
                    if rid != "2-0" or (prefix_caching and in_prompt)]
        assert sorted(rows) == sorted(expected), (step, rows, scheduled[step])
        mixed += len(rows) < len(scheduled[step])
    assert mixed >= 5  # steps that ran the third request beside the others, without it in the MTP layer

    reference = MTPReference(model_dir)
    sequences = [o.prompt_token_ids + o.outputs[0].token_ids for o in outputs[:2]]
    assert len(made) >= 2 * 6
    for row, start, drafts in made:  # (each chunk's request: whichever of the two its drafts match)
        expected = [reference.drafts(seq[:start + 1], len(drafts)) for seq in sequences if start + 1 < len(seq)]
        assert drafts in expected, (row, start, drafts, expected)
