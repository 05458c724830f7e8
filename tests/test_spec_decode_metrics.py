"""Speculative decoding's counters outside `RequestOutput.metrics`: the engine's totals
(`Engine.stats().spec_decode`), the server's `/metrics` (vLLM's `spec_decode_*` counters) and the
caption job's summary line."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from testing.image_folders import write_images
from tests.test_async_scheduling import engine_options
from tests.test_server import tiny_engine
from tests.test_spec_decode import SPEC, run
from vlmrun import LLM, SamplingParams
from vlmrun.cli import main
from vlmrun.jobs.progress import JobSummary, describe_spec_decode
from vlmrun.server.launch import serve_in_thread
from vlmrun.server.settings import ServerSettings
from vlmrun.spec_decode.metrics import SpecDecodeStats

REPEATING = "one two three four one two three four one two three four one two three"


def test_stats_count_accepted_drafts_by_position():
    stats = SpecDecodeStats()
    for drafts, accepted in ((3, 2), (3, 0), (2, 2), (3, 3)):
        stats.record(drafts, accepted)
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (4, 11, 7)
    assert stats.num_accepted_tokens_per_pos == [3, 3, 1]
    assert stats.acceptance_rate == 7 / 11 and stats.mean_accepted_length == 1 + 7 / 4
    other = SpecDecodeStats(1, 1, 1, [1])
    assert stats.merged(other).num_accepted_tokens_per_pos == [4, 3, 1]
    assert other.merged(stats) == stats.merged(other)
    copy = stats.copy()
    copy.record(1, 1)
    assert stats.num_accepted_tokens_per_pos == [3, 3, 1]  # a copy shares no list


def test_engine_totals_are_the_sum_of_the_requests(qwen3_dir):
    """The engine's counters are its requests' counters summed (by hand here, not with `merged`), and a
    request's per-position counts are its verify steps' accepted drafts counted by position (the steps
    as `Scheduler.settle` saw them)."""
    llm = LLM(str(qwen3_dir), **engine_options(qwen3_dir, speculative_config=SPEC))
    steps: dict[str, list[tuple[int, int]]] = {}  # request id -> (drafts fed, drafts accepted) per verify step
    settle = llm.engine.scheduler.settle

    def recording_settle(chunk, num_accepted):
        if chunk.draft_token_ids:
            steps.setdefault(chunk.request.request_id, []).append((len(chunk.draft_token_ids), num_accepted))
        return settle(chunk, num_accepted)

    llm.engine.scheduler.settle = recording_settle
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (24, 17, 12)]
    prompts = [REPEATING, REPEATING[:-6], "one two one two three one two three four one two"]
    try:
        outputs = llm.generate(prompts, params, use_tqdm=False)
        engine = llm.engine.stats().spec_decode
    finally:
        llm.engine.shutdown()
    k = SPEC["num_speculative_tokens"]
    summed = [0] * k
    for out in outputs:
        mine = out.metrics.spec_decode
        verify_steps = steps[f"{out.request_id}-0"]  # (n = 1: choice 0; each request speculated)
        assert (mine.num_drafts, mine.num_draft_tokens, mine.num_accepted_tokens) == (
            len(verify_steps), sum(d for d, _ in verify_steps), sum(a for _, a in verify_steps))
        by_position = [sum(a > j for _, a in verify_steps) for j in range(max(d for d, _ in verify_steps))]
        assert mine.num_accepted_tokens_per_pos == by_position
        for j, count in enumerate(mine.num_accepted_tokens_per_pos):
            summed[j] += count
    assert engine.num_accepted_tokens_per_pos == summed and sum(summed) == engine.num_accepted_tokens > 0
    assert len({tuple(out.metrics.spec_decode.num_accepted_tokens_per_pos) for out in outputs}) == 3  # all differ
    for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
        assert getattr(engine, name) == sum(getattr(out.metrics.spec_decode, name) for out in outputs), name
    _, plain = run(qwen3_dir, [REPEATING], params[:1], None)
    assert plain.spec_decode is None


def counters(text: str) -> dict[str, float]:
    """`name{labels} value` lines of a Prometheus scrape, keyed by name and labels."""
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            values[key] = float(value)
    return values


def test_server_metrics_show_the_engine_counters(qwen3_dir):
    engine = tiny_engine(qwen3_dir, speculative_config=SPEC)
    server = serve_in_thread(engine, ServerSettings(served_model_name="tiny"))
    try:
        for max_tokens in (12, 20):
            reply = httpx.post(server.base_url + "/v1/completions", timeout=60, json={
                "model": "tiny", "prompt": REPEATING, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True})
            assert reply.status_code == 200, reply.text
        scraped = counters(httpx.get(server.base_url + "/metrics").text)
        spec = engine.stats.spec_decode
    finally:
        server.stop()
        engine.shutdown()
    label = '{model_name="tiny"}'
    assert spec.num_accepted_tokens > 0
    assert scraped["vlmrun_spec_decode_num_drafts_total" + label] == spec.num_drafts
    assert scraped["vlmrun_spec_decode_num_draft_tokens_total" + label] == spec.num_draft_tokens
    assert scraped["vlmrun_spec_decode_num_accepted_tokens_total" + label] == spec.num_accepted_tokens
    for position, value in enumerate(spec.num_accepted_tokens_per_pos):
        key = f'vlmrun_spec_decode_num_accepted_tokens_per_pos_total{{model_name="tiny",position="{position}"}}'
        assert scraped[key] == value
    assert len(spec.num_accepted_tokens_per_pos) == SPEC["num_speculative_tokens"]


def test_caption_summary_reports_acceptance(qwen3_vl_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture):
    write_images(tmp_path / "imgs", 2, size=(48, 40))
    args = ["caption", str(tmp_path / "imgs"), "--model", str(qwen3_vl_dir), "--max-tokens", "16",
            "--no-progress", "--out"]
    assert main(args + [str(tmp_path / "plain.jsonl")]) == 0
    assert "speculative decoding" not in capsys.readouterr().err
    assert main(args + [str(tmp_path / "spec.jsonl"), "--speculative-config", json.dumps(SPEC)]) == 0
    (line,) = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("speculative decoding")]
    assert " draft tokens accepted (" in line and "mean accepted length" in line and "verify step" in line
    plain = [json.loads(r)["caption"] for r in (tmp_path / "plain.jsonl").read_text().splitlines()]
    spec = [json.loads(r)["caption"] for r in (tmp_path / "spec.jsonl").read_text().splitlines()]
    assert sorted(plain) == sorted(spec)  # greedy: the same captions


def test_summary_line_of_the_counters():
    spec = SpecDecodeStats(4, 11, 7, [3, 3, 1])
    assert describe_spec_decode(spec) == ("speculative decoding: 7/11 draft tokens accepted (63.6 %), mean accepted "
                                          "length 2.75 over 4 verify steps; accepted by position 3, 3, 1")
    summary = JobSummary(written=2, elapsed_s=1.0, spec_decode=spec)
    assert describe_spec_decode(spec) in summary.lines()
    assert not any("speculative" in line for line in JobSummary(written=2, elapsed_s=1.0).lines())
