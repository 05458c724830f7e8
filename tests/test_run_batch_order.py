"""`vlmrun run-batch` writes its lines in input order (vLLM's) through a bounded window, and refuses a line
over its size cap without reading it whole."""

from __future__ import annotations

import io
import json
import tracemalloc
from pathlib import Path

import pytest

from tests.test_run_batch import _chat_line, _completion_line, _flags, _outputs, _write_lines
from vlmrun.cli import main
from vlmrun.jobs.run_batch_reader import LongLine, bounded_lines


def test_output_lines_come_in_input_order(qwen3_vl_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    model = str(qwen3_vl_dir)
    long = dict(max_tokens=40, ignore_eos=True)
    lines = [_completion_line("slow-0", "Once upon a time", model, **long), "{not json",
             *[_completion_line(f"quick-{i}", "Hi", model, max_tokens=1) for i in range(1, 6)],
             _chat_line("slow-7", "Tell me a story.", model, **long), _completion_line("quick-8", "Yo", model, max_tokens=1)]
    src = _write_lines(tmp_path / "in.jsonl", lines)
    out = tmp_path / "out.jsonl"
    assert main(["run-batch", "-i", str(src), "-o", str(out), "--max-in-flight", "4", *_flags(qwen3_vl_dir)]) == 0
    capsys.readouterr()
    got = _outputs(out)
    assert [o["custom_id"] for o in got] == ["slow-0", None, *[f"quick-{i}" for i in range(1, 6)], "slow-7", "quick-8"]
    assert got[1]["id"] == "vlmrun-line-2" and got[1]["response"] is None and "JSON" in got[1]["error"]["error"]["message"]
    assert got[0]["response"]["body"]["usage"]["completion_tokens"] == 40


class _Source(io.RawIOBase):
    """A file of one `size`-byte line and a short one, made as it is read (never held whole)."""

    def __init__(self, size: int):
        self.left = size
        self.tail = b'\n{"custom_id": "after"}\n'

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        if self.left:
            n = min(len(buffer), self.left)
            buffer[:n] = b"x" * n
            self.left -= n
            return n
        n = min(len(buffer), len(self.tail))
        buffer[:n], self.tail = self.tail[:n], self.tail[n:]
        return n


def test_a_line_over_the_cap_is_skipped_in_pieces() -> None:
    cap = 1 << 20
    fh = io.BufferedReader(_Source(40 << 20))
    tracemalloc.start()
    try:
        got = list(bounded_lines(fh, cap))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert got == [(1, LongLine((40 << 20) + 1)), (2, b'{"custom_id": "after"}\n')]
    assert peak < 4 * cap, peak  # the line's first cap bytes, a skip piece: not the 40 MB
    lines = list(bounded_lines(io.BytesIO(b"a\n" + b"b" * 10 + b"\nccc"), cap=10))
    assert lines == [(1, b"a\n"), (2, b"b" * 10 + b"\n"), (3, b"ccc")]  # exactly the cap fits, newline apart


def test_run_batch_answers_an_oversized_line_413_without_reading_it_whole(qwen3_vl_dir: Path, tmp_path: Path,
                                                                          capsys: pytest.CaptureFixture) -> None:
    src = tmp_path / "in.jsonl"
    big = 24 << 20
    with open(src, "wb") as fh:  # a request whose body is far over --max-request-mb 1
        fh.write(b'{"custom_id": "big", "method": "POST", "url": "/v1/completions", "body": {"prompt": "')
        for _ in range(big >> 20):
            fh.write(b"y" * (1 << 20))
        fh.write(b'"}}\n{"custom_id": "no-url"}\n')
    out = tmp_path / "out.jsonl"
    tracemalloc.start()
    try:
        code = main(["run-batch", "-i", str(src), "-o", str(out), "--max-request-mb", "1", *_flags(qwen3_vl_dir)])
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    capsys.readouterr()
    assert code == 0  # the failed lines are in the file (vLLM's status)
    first, second = _outputs(out)
    assert first["id"] == "vlmrun-line-1" and first["response"] is None
    assert first["error"]["error"]["code"] == "request_too_large" and "not read" in first["error"]["error"]["message"]
    assert second["custom_id"] == "no-url" and second["response"] is None and second["error"]["error"]["param"]
    assert peak < 8 << 20, peak  # today's reader held the 24 MB line (and its JSON) before the 413
    # a rerun skips the refused line (recorded by its number)
    assert main(["run-batch", "-i", str(src), "-o", str(out), "--max-request-mb", "1", *_flags(qwen3_vl_dir)]) == 0
    assert len(_outputs(out)) == 2 and json.loads(out.read_text().splitlines()[0])["id"] == "vlmrun-line-1"
