"""The caption job's progress and summary: one rate in bar and summary, a sane first ETA, failed inputs
named, the preprocessing rate shown and a slow input reported as it happens."""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from testing.image_folders import write_images
from vlmrun.jobs import progress
from vlmrun.jobs.progress import JobCounters, JobSummary, ProgressBar, render_line


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_the_bar_shows_the_summarys_rate(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = _Clock()
    monkeypatch.setattr(progress.time, "monotonic", clock)
    counters = JobCounters(total=500, started=0.0)
    stream = io.StringIO()
    bar = ProgressBar(counters, stream, interval=0.0, log_interval=0.0)
    for t, done in ((1.0, 0), (30.0, 100), (60.0, 110)):  # a fast start, then a slow stretch
        clock.now = t
        while counters.done < done:
            counters.count(False, 3)
        bar.refresh(force=True)
    summary = JobSummary(written=counters.done, tokens=counters.tokens, elapsed_s=counters.elapsed())
    last = stream.getvalue().splitlines()[-1]
    assert f"{summary.images_per_s:.1f} img/s" in last and f"{summary.images_per_s:.2f} inputs/s" in summary.lines()[0]


def test_the_first_eta_waits_for_the_fill_then_follows_the_pace_since_the_first_record() -> None:
    counters = JobCounters(total=1000, started=0.0)
    counters.count(False, 1)
    counters.first_record_at = 10.0  # the pipeline's fill: 10 s to the first record
    assert counters.eta(10.5) is None and "ETA ?" in render_line(counters, 10.5)
    while counters.done < 101:
        counters.count(False, 1)
    assert counters.eta(20.0) == pytest.approx(899 * 10 / 101)  # 100 records in 10 s: ~89 s left, not 178
    assert "ETA 1:29" in render_line(counters, 20.0)
    counters.preprocessed = 150
    assert "prep 7.5/s" in render_line(counters, 20.0)


def test_the_summary_names_the_failed_inputs_and_where_the_rest_are() -> None:
    failures = [(f"img_{i}.png", f"broken {i}") for i in range(5)]
    lines = JobSummary(written=9, failed=7, elapsed_s=1.0, out="out.jsonl", failures=failures).lines()
    assert "failed (the first 5 of 7):" in lines and "  img_0.png: broken 0" in lines
    assert 'all of them: the records in out.jsonl whose "error" is set' in lines[-2]
    few = JobSummary(written=3, failed=1, elapsed_s=1.0, out="out.jsonl", failures=failures[:1]).lines()
    assert "failed (1):" in few and not any("all of them" in line for line in few)
    counters = JobCounters()
    for i in range(7):
        counters.count(True, 0, key=f"k{i}", error="bad")
    assert counters.failures == [(f"k{i}", "bad") for i in range(5)]


def test_a_slow_input_is_reported_as_it_is_preprocessed(qwen3_vl_dir: Path, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    from vlmrun.jobs import pipeline
    from vlmrun.jobs.config import CaptionJobConfig
    from vlmrun.jobs.runner import run_caption_job
    from vlmrun.sampling_params import SamplingParams

    monkeypatch.setattr(pipeline, "SLOW_PREPROCESS_S", 0.0)  # every input counts as slow here
    write_images(tmp_path / "imgs", 7)
    err = io.StringIO()
    config = CaptionJobConfig(inputs=[str(tmp_path / "imgs")], model=str(qwen3_vl_dir), out=str(tmp_path / "o.jsonl"),
                              sampling=SamplingParams(temperature=0.0, max_tokens=1), progress=False, workers=2,
                              engine_options={"dtype": "float32", "device": "cpu"})
    summary = run_caption_job(config, stderr=err)
    assert summary.written == 7 and summary.failed == 0
    warnings = [line for line in err.getvalue().splitlines() if line.startswith("warning: preprocessing")]
    assert len(warnings) == 5 and "img_0000" in warnings[0] and "not reported" in warnings[-1]
