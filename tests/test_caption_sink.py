"""Caption-job outputs: the JSONL journal (repair, resume, retry), Parquet via a journal, the lock."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vlmrun.jobs.journal import NotAJournalError, scan_journal
from vlmrun.jobs.records import RECORD_FIELDS, CaptionRecord, key_hash
from vlmrun.jobs.sink import JOURNAL_SUFFIX, OutputError, ParquetOutput, open_output, output_format


def _record(image: str, error: str | None = None) -> CaptionRecord:
    if error is not None:
        return CaptionRecord.failure(image, "m", "p", error)
    return CaptionRecord(image=image, caption=f"caption of {image} — ok", num_tokens=3, model="m", prompt="p",
                         error=None, finish_reason="stop", preprocess_s=0.01, generate_s=0.2)


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def test_output_format_by_suffix() -> None:
    assert output_format("a/b.JSONL") == "jsonl" and output_format("x.parquet") == "parquet"
    with pytest.raises(OutputError, match="name it"):
        output_format("x.csv")


def test_jsonl_records_are_whole_lines_and_resume_sees_them(tmp_path: Path) -> None:
    out = tmp_path / "o.jsonl"
    sink = open_output(str(out))
    sink.write(_record("a.png"))
    sink.write(_record("b.png", error="image file 'b.png' is empty (0 bytes)"))
    assert out.read_bytes().count(b"\n") == 2  # on disk before close: a kill keeps them
    sink.close()
    rows = _lines(out)
    assert [r["image"] for r in rows] == ["a.png", "b.png"] and list(rows[0]) == list(RECORD_FIELDS)
    assert rows[0]["caption"] == "caption of a.png — ok" and rows[1]["caption"] is None
    again = open_output(str(out))
    assert again.state.done == {key_hash("a.png"), key_hash("b.png")}
    assert (again.state.ok, again.state.failed) == (1, 1)
    again.close()


def test_a_torn_last_record_is_cut_and_nothing_else_is_touched(tmp_path: Path) -> None:
    out = tmp_path / "o.jsonl"
    records = json.dumps(_record("a.png").to_dict()) + "\n" + json.dumps(_record("b.png").to_dict()) + "\n"
    out.write_text(records + '{"image": "c.png", "capt')
    state = scan_journal(str(out))
    assert state.dropped_lines == 1
    assert state.done == {key_hash("a.png"), key_hash("b.png")}
    assert _lines(out) == [json.loads(line) for line in records.splitlines()]  # rewritten: whole records only

    for foreign in ("garbage line\n", '{"id": 7}\n', "a torn line of something else"):
        out.write_text(records + foreign)
        with pytest.raises(NotAJournalError, match="line 3 is not a caption record"):
            scan_journal(str(out))
        assert out.read_text() == records + foreign


def test_retry_errors_drops_error_records(tmp_path: Path) -> None:
    out = tmp_path / "o.jsonl"
    sink = open_output(str(out))
    for r in (_record("a.png"), _record("b.png", "boom"), _record("c.png")):
        sink.write(r)
    sink.close()
    sink = open_output(str(out), retry_errors=True)
    assert sink.state.done == {key_hash("a.png"), key_hash("c.png")} and sink.state.retried == 1
    sink.write(_record("b.png"))
    sink.close()
    assert sorted(r["image"] for r in _lines(out)) == ["a.png", "b.png", "c.png"]
    assert all(r["error"] is None for r in _lines(out))


def test_overwrite_starts_afresh_at_the_first_record(tmp_path: Path) -> None:
    out = tmp_path / "o.jsonl"
    out.write_text(json.dumps(_record("old.png").to_dict()) + "\n")
    sink = open_output(str(out), overwrite=True)
    assert not sink.state.done
    sink.write(_record("new.png"))
    sink.close()
    assert [r["image"] for r in _lines(out)] == ["new.png"]


def test_second_writer_is_refused(tmp_path: Path) -> None:
    out = tmp_path / "o.jsonl"
    first = open_output(str(out))
    with pytest.raises(OutputError, match="another job"):
        open_output(str(out))
    first.close()
    open_output(str(out)).close()  # free again once the first job ended


def test_parquet_output_goes_through_a_journal(tmp_path: Path) -> None:
    pq = pytest.importorskip("pyarrow.parquet")
    out = tmp_path / "o.parquet"
    journal = Path(str(out) + JOURNAL_SUFFIX)
    sink = open_output(str(out))
    assert isinstance(sink, ParquetOutput)
    sink.write(_record("a.png"))
    sink.write(_record("b.png", "bad"))
    assert journal.exists() and not out.exists()  # what a kill leaves
    sink.close()
    assert not journal.exists()
    table = pq.read_table(out)
    assert table.column_names == list(RECORD_FIELDS)
    assert table.column("image").to_pylist() == ["a.png", "b.png"]
    assert table.column("error").to_pylist() == [None, "bad"]

    # resume from the finished Parquet: its rows seed a new journal, new records are appended
    sink = open_output(str(out), retry_errors=True)
    assert sink.state.done == {key_hash("a.png")}
    sink.write(_record("b.png"))
    sink.write(_record("c.png"))
    sink.close()
    table = pq.read_table(out)
    assert sorted(table.column("image").to_pylist()) == ["a.png", "b.png", "c.png"]
    assert table.column("error").to_pylist() == [None, None, None]


def test_parquet_resume_after_a_kill_uses_the_journal(tmp_path: Path) -> None:
    pq = pytest.importorskip("pyarrow.parquet")
    out = tmp_path / "o.parquet"
    journal = Path(str(out) + JOURNAL_SUFFIX)
    journal.write_text(json.dumps(_record("a.png").to_dict()) + "\n" + '{"image": "b.p')  # killed mid-write
    sink = open_output(str(out))
    assert sink.state.done == {key_hash("a.png")} and sink.state.dropped_lines == 1
    sink.write(_record("b.png"))
    sink.close()
    assert pq.read_table(out).column("image").to_pylist() == ["a.png", "b.png"] and not journal.exists()


def test_unreadable_parquet_output_is_refused(tmp_path: Path) -> None:
    pytest.importorskip("pyarrow")
    out = tmp_path / "o.parquet"
    out.write_bytes(b"not parquet")
    with pytest.raises(OutputError, match="not a readable Parquet"):
        open_output(str(out))
    open_output(str(out), overwrite=True).close()  # nothing written: the file is left alone
    assert out.read_bytes() == b"not parquet"
