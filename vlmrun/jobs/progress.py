"""Progress of a caption job: counters, a live one-line bar, and the final summary.

On a terminal the bar redraws in place (at most every `interval` seconds); on a pipe or a log
file it prints a plain line every `log_interval` seconds instead, so logs stay readable.

One rate: the bar's img/s and the summary's inputs/s are the same figure (records since the
first input was handed to the engine, over the time since), so the last bar and the summary agree.
The ETA waits until the pipeline's fill (the time to the first record: preprocessing, the first
prefills) is at most half the elapsed time, then forecasts from the pace since the first record,
so neither the fill nor a first lone record makes it wildly long or short.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from typing import IO, Optional

from vlmrun.spec_decode.metrics import SpecDecodeStats

_BAR_WIDTH = 24
FAILURES_NAMED = 5  # failed inputs the summary names


@dataclass
class JobCounters:
    """What this run has done so far. `total` (inputs left to caption) is None until counted."""

    total: Optional[int] = None
    done: int = 0  # records written by this run (successes + failures)
    failed: int = 0
    tokens: int = 0
    videos: int = 0  # of `done`, records of videos
    started: float = field(default_factory=time.monotonic)
    spec_decode: Optional[SpecDecodeStats] = None  # the engine's speculative decoding counters, once it stops
    preprocessed: int = 0  # inputs preprocessed so far (the pipeline's count)
    first_record_at: Optional[float] = None  # time.monotonic() of the first record
    failures: list[tuple[str, str]] = field(default_factory=list)  # the first FAILURES_NAMED (input, error)

    def count(self, failed: bool, tokens: int, video: bool = False, key: str = "", error: Optional[str] = None) -> None:
        self.done += 1
        self.failed += failed
        self.tokens += tokens
        self.videos += video
        if self.first_record_at is None:
            self.first_record_at = time.monotonic()
        if failed and len(self.failures) < FAILURES_NAMED:
            self.failures.append((key, error or ""))

    def eta(self, now: float) -> Optional[float]:
        """Seconds left, once the fill is at most half the elapsed time (module docstring); else None."""
        if not self.total or self.first_record_at is None or self.done >= self.total:
            return None
        since_first = now - self.first_record_at
        if since_first <= 0 or since_first < self.first_record_at - self.started:
            return None
        return (self.total - self.done) * since_first / self.done

    def elapsed(self, now: Optional[float] = None) -> float:
        return max((now if now is not None else time.monotonic()) - self.started, 1e-9)


def _fmt_duration(seconds: float) -> str:
    seconds = int(round(seconds))
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


def render_line(c: JobCounters, now: Optional[float] = None) -> str:
    """`[#####-----] 1,204/2,000  60%  35.1 img/s  prep 41.0/s  412 tok/s  ETA 0:22  failed 3`

    img/s and tok/s: since the start (the summary's figures); prep/s: inputs preprocessed per second."""
    now = now if now is not None else time.monotonic()
    elapsed = c.elapsed(now)
    rate, token_rate = c.done / elapsed, c.tokens / elapsed
    parts = []
    if c.total:
        frac = min(c.done / c.total, 1.0)
        filled = int(frac * _BAR_WIDTH)
        parts.append("[" + "#" * filled + "-" * (_BAR_WIDTH - filled) + "]")
        parts.append(f"{c.done:,}/{c.total:,} {100 * frac:3.0f}%")
    else:
        parts.append(f"{c.done:,}/{'?' if c.total is None else c.total}")
    parts.append(f"{rate:.1f} img/s")
    parts.append(f"prep {c.preprocessed / elapsed:.1f}/s")
    parts.append(f"{token_rate:.0f} tok/s")
    eta = c.eta(now)
    if eta is not None:
        parts.append(f"ETA {_fmt_duration(eta)}")
    elif c.total and c.done < c.total:
        parts.append(f"ETA ? (elapsed {_fmt_duration(elapsed)})")
    else:
        parts.append(f"elapsed {_fmt_duration(elapsed)}")
    parts.append(f"failed {c.failed:,}")
    return "  ".join(parts)


class ProgressBar:
    """Draws `render_line` to `stream` (stderr by default) as the counters change; `note` prints a
    line above it."""

    def __init__(self, counters: JobCounters, stream: Optional[IO[str]] = None, enabled: bool = True,
                 interval: float = 0.25, log_interval: float = 15.0):
        self.counters = counters
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled
        self.tty = enabled and bool(getattr(self.stream, "isatty", lambda: False)())
        self.interval = interval if self.tty else log_interval
        self._last = 0.0 if self.tty else time.monotonic()  # a log gets its first line after log_interval
        self._width = 0

    def note(self, text: str) -> None:
        """Print `text` on its own line (above the bar on a terminal), whether or not the bar is enabled."""
        if self.tty and self._width:
            self.stream.write("\r" + " " * self._width + "\r")
            self._width = 0
        self.stream.write(text + "\n")
        self.stream.flush()

    def refresh(self, force: bool = False) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if not force and now - self._last < self.interval:
            return
        self._last = now
        line = render_line(self.counters, now)
        if self.tty:
            pad = max(self._width - len(line), 0)
            self.stream.write("\r" + line + " " * pad)
            self._width = len(line)
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def close(self) -> None:
        """Draw the final state and end the line."""
        if not self.enabled:
            return
        if self.tty:
            self.refresh(force=True)
            self.stream.write("\n")
            self.stream.flush()
        elif self.counters.done:
            self.refresh(force=True)


def _n(count: int, noun: str) -> str:
    return f"{count:,} {noun}{'' if count == 1 else 's'}"


@dataclass
class JobSummary:
    """The outcome of a job run, for the final report and the exit status."""

    written: int = 0  # records written by this run
    failed: int = 0  # of which errors
    videos: int = 0  # of which videos
    tokens: int = 0
    elapsed_s: float = 0.0  # from the first input to the last record (engine load excluded)
    skipped_done: int = 0  # already in the output
    prior_failed: int = 0  # error records already in the output (and kept)
    duplicates: int = 0
    ignored_files: int = 0
    interrupted: bool = False
    out: Optional[str] = None
    output_error: Optional[str] = None  # the job stopped: its output could not be written
    spec_decode: Optional[SpecDecodeStats] = None  # the engine speculated: its drafts and acceptance
    failures: list[tuple[str, str]] = field(default_factory=list)  # the first failed inputs: (input, error)
    verb: tuple[str, str] = ("caption", "captioned")  # what the job does to an image, and its past (`vlmrun embed`'s)

    @property
    def images_per_s(self) -> float:
        return self.written / self.elapsed_s if self.elapsed_s > 0 else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.elapsed_s if self.elapsed_s > 0 else 0.0

    def exit_code(self) -> int:
        """Of this run: 0 every image it captioned has a caption; 1 some failed; 130 interrupted.
        (Failures kept from earlier runs are reported in `lines`, not in the status.)"""
        if self.interrupted:
            return 130
        return 1 if self.failed or self.output_error else 0

    def lines(self) -> list[str]:
        if self.interrupted and not self.written:  # stopped before the first record: images may remain
            out = [f"interrupted before any image was {self.verb[1]}"]
        elif self.written or not self.skipped_done:
            what = "images" if not self.videos else \
                f"inputs ({_n(self.written - self.videos, 'image')}, {_n(self.videos, 'video')})"
            out = [f"{self.verb[1]} {self.written - self.failed:,}/{self.written:,} {what} in {self.elapsed_s:.2f}s "
                   f"({self.images_per_s:.2f} inputs/s, {self.tokens_per_s:.1f} tokens/s), {self.failed:,} failed"]
        else:
            out = [f"nothing left to {self.verb[0]}"]
        notes = []
        if self.skipped_done:
            notes.append(f"{_n(self.skipped_done, 'image')} already in the output (skipped)")
        if self.prior_failed:
            notes.append(f"{_n(self.prior_failed, 'earlier failure')} kept (--retry-errors redoes them)")
        if self.duplicates:
            notes.append(f"{_n(self.duplicates, 'repeated input')} {self.verb[1]} once")
        if self.ignored_files:
            notes.append(f"{_n(self.ignored_files, 'file')} without an image suffix ignored")
        if notes:
            out.append("; ".join(notes))
        out += self._failure_lines()
        if self.spec_decode is not None:
            out.append(describe_spec_decode(self.spec_decode))
        if self.output_error:
            out.append(f"stopped: {self.output_error}; the {self.written:,} records before it are kept: "
                       "free the space and run the same command again to resume")
        elif self.interrupted:
            out.append("interrupted: run the same command again to resume")
        elif self.out:
            out.append(f"records in {self.out}")
        return out


    def _failure_lines(self) -> list[str]:
        """The failed inputs named (the first few), and where the others are."""
        if not self.failed:
            return []
        shown = self.failures[:self.failed]
        head = f"failed ({'the first ' + str(len(shown)) + ' of ' if len(shown) < self.failed else ''}{self.failed:,}):"
        out = [head] + [f"  {key}: {error}" for key, error in shown]
        if len(shown) < self.failed:
            where = (f"the records in {self.out} whose \"error\" is set" if self.out not in (None, STDOUT_NAME)
                     else "the records above whose \"error\" is set")
            out.append(f"  all of them: {where}")
        return out


STDOUT_NAME = "-"


def describe_spec_decode(spec: SpecDecodeStats) -> str:
    """`speculative decoding: 812/2,000 draft tokens accepted (40.6 %), mean accepted length 2.22 over 664
    verify steps; accepted by position 412, 250, 150`"""
    line = (f"speculative decoding: {spec.num_accepted_tokens:,}/{spec.num_draft_tokens:,} draft tokens accepted "
            f"({100 * spec.acceptance_rate:.1f} %), mean accepted length {spec.mean_accepted_length:.2f} over "
            f"{_n(spec.num_drafts, 'verify step')}")
    if spec.num_drafts:
        line += "; accepted by position " + ", ".join(f"{n:,}" for n in spec.num_accepted_tokens_per_pos)
    return line
