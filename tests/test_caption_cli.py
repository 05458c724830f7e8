"""`vlmrun caption` end to end on the tiny Qwen3-VL: streaming pipeline, bad inputs, resume, SIGKILL."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from testing.image_folders import write_bad_files, write_images
from vlmrun.cli import main
from vlmrun.jobs.sink import JOURNAL_SUFFIX

REPO = Path(__file__).resolve().parents[1]


def subprocess_env() -> dict[str, str]:
    """Run vlmrun from this checkout; one OpenMP thread, so a busy machine cannot slow the tiny
    model's steps by orders of magnitude (OpenMP teams stall when cores are oversubscribed)."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
            "OMP_NUM_THREADS": "1"}


def _records(path: Path) -> list[dict]:
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def _by_image(records: list[dict]) -> dict[str, dict]:
    out = {r["image"]: r for r in records}
    assert len(out) == len(records), "an image is recorded twice"
    return out


def test_pipeline_gives_the_captions_of_llm_generate(qwen3_vl_dir: Path, tmp_path: Path) -> None:
    """Streaming (3 worker threads, engine topped up to 3 requests) changes no token."""
    from vlmrun import LLM, SamplingParams
    from vlmrun.jobs.inputs import iter_items
    from vlmrun.jobs.pipeline import CaptionPipeline, PipelineOptions

    paths = write_images(tmp_path / "imgs", 7, size=None, sizes_range=(40, 200), seed=3)
    llm = LLM(str(qwen3_vl_dir), dtype="float32", device="cpu", max_num_seqs=8)
    params = SamplingParams(temperature=0, max_tokens=6)
    pipeline = CaptionPipeline(llm.engine, PipelineOptions("Describe.", params, "tiny", workers=3, prefetch=2,
                                                           max_in_flight=3))
    got: dict[str, tuple[str, int]] = {}
    pipeline.run(iter_items([str(tmp_path / "imgs")]), lambda item, r: got.__setitem__(r.image, (r.caption, r.num_tokens)))
    want = llm.generate([{"prompt": "Describe.", "images": [str(p)]} for p in paths], params, use_tqdm=False)
    assert got == {str(p): (o.text, len(o.token_ids)) for p, o in zip(paths, want)}
    assert not llm.engine.requests and not llm.engine.has_unfinished()


def test_bad_inputs_become_error_records_and_the_exit_status_says_so(qwen3_vl_dir: Path, tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture) -> None:
    folder = tmp_path / "mixed"
    good = write_images(folder, 3, size=(48, 40)) + write_images(folder / "sub", 1, size=(30, 70), seed=1)
    write_images(tmp_path / "big", 1, size=(300, 300), seed=2)
    expected = write_bad_files(folder)
    (folder / "README.md").write_text("not an image, ignored")
    manifest = tmp_path / "more.jsonl"
    manifest.write_text(json.dumps("big/img_00000.png") + "\n{broken\n" + json.dumps("http://127.0.0.1:9/x.jpg") + "\n")
    out = tmp_path / "out.jsonl"
    rc = main(["caption", str(folder), str(manifest), "--out", str(out),
               "--model", str(qwen3_vl_dir), "--max-tokens", "3", "--max-image-pixels", "50000", "--no-progress"])
    assert rc == 1
    records = _by_image(_records(out))
    for path in good:
        r = records.pop(str(path))
        assert r["error"] is None and r["caption"] is not None and r["num_tokens"] >= 1
        assert r["model"] == str(qwen3_vl_dir) and r["prompt"] == "Describe the image." and r["generate_s"] > 0
    words = {"zero_bytes.jpg": "empty (0 bytes)", "truncated.jpg": "truncat", "corrupt.png": "not a recognised image",
             "not_an_image.jpg": "not a recognised image"}
    for name in expected:
        r = records.pop(str(folder / name))
        assert r["caption"] is None and r["num_tokens"] == 0 and r["finish_reason"] == "error"
        assert words[name] in r["error"].lower() and name in r["error"]
    assert "more than the limit" in records.pop("big/img_00000.png")["error"]
    assert "not JSON" in records.pop(f"{manifest}:line 2")["error"]
    assert "could not fetch" in records.pop("http://127.0.0.1:9/x.jpg")["error"]
    assert not records
    err = capsys.readouterr().err
    assert "captioned 4/11 images" in err and "7 failed" in err and "1 file without an image suffix" in err
    assert "failed (the first 5 of 7):" in err and f'all of them: the records in {out} whose "error" is set' in err
    assert f"  {folder / 'corrupt.png'}: " in err or "  http://127.0.0.1:9/x.jpg: could not fetch" in err


def test_a_missing_input_path_is_an_immediate_usage_error(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    write_images(tmp_path / "imgs", 1)
    out = tmp_path / "out.jsonl"
    for missing, words in ((tmp_path / "imgz", "no such file or folder"), (tmp_path / "imgs" / "*.jpg", "no file matches")):
        rc = main(["caption", str(tmp_path / "imgs"), str(missing), "--out", str(out), "--model", "/no/such/model"])
        assert rc == 2  # before the model (which does not exist) is looked at
        err = capsys.readouterr().err
        assert words in err and str(missing) in err
        assert not out.exists()


def test_resume_skips_recorded_images_and_retry_errors_redoes_failures(qwen3_vl_dir: Path, tmp_path: Path,
                                                                       capsys: pytest.CaptureFixture) -> None:
    folder = tmp_path / "imgs"
    write_images(folder, 3)
    (folder / "late.png").write_bytes(b"")
    out = tmp_path / "out.parquet"
    args = ["caption", str(folder), "--out", str(out), "--model", str(qwen3_vl_dir), "--max-tokens", "2",
            "--no-progress"]
    assert main(args) == 1
    first = _by_image(_records(out))
    assert first[str(folder / "late.png")]["error"] is not None
    assert main(args) == 0  # nothing new: the status speaks of this run; the kept failure is reported
    err = capsys.readouterr().err
    assert "nothing left to caption" in err and "1 earlier failure kept" in err
    write_images(tmp_path / "fix", 1, seed=9)[0].rename(folder / "late.png")
    write_images(folder / "new", 1, seed=10)
    assert main(args + ["--retry-errors"]) == 0
    final = _by_image(_records(out))
    assert sorted(final) == sorted(first) + [str(folder / "new" / "img_00000.png")]
    assert all(r["error"] is None for r in final.values())
    assert {k: final[k]["caption"] for k in first if k.endswith("img_00000.png")} == \
        {k: first[k]["caption"] for k in first if k.endswith("img_00000.png")}
    assert not Path(str(out) + JOURNAL_SUFFIX).exists()


@pytest.mark.parametrize("content", [
    b'{"id": 1, "text": "a dataset line"}\n{"id": 2, "text": "another"}\n',  # another program's JSONL
    b'{"image": "a.png", "label": "cat"}\n',  # a manifest with an image column
    b"plain notes without a newline",  # not JSON at all
    b'{"image":"a.png","caption":"x","num_tokens":1,"model":"m","prompt":"p","error":null,"finish_reason":"stop"}\n'
    b'{"note": "a line someone added"}\n',  # a journal with a foreign line
])
def test_an_out_file_that_is_not_a_journal_is_refused_and_untouched(qwen3_vl_dir: Path, tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture, content: bytes):
    write_images(tmp_path / "imgs", 1)
    out = tmp_path / "out.jsonl"
    out.write_bytes(content)
    for extra in ([], ["--retry-errors"]):
        rc = main(["caption", str(tmp_path / "imgs"), "--out", str(out), "--model", str(qwen3_vl_dir),
                   "--max-tokens", "2", "--no-progress", *extra])
        assert rc == 2
        assert out.read_bytes() == content
        assert "is not a caption job's output" in capsys.readouterr().err


@pytest.mark.parametrize("overwrite", [False, True])
def test_an_input_manifest_as_out_is_refused_and_untouched(qwen3_vl_dir: Path, tmp_path: Path,
                                                          capsys: pytest.CaptureFixture, overwrite: bool):
    paths = write_images(tmp_path / "imgs", 2)
    manifest = tmp_path / "list.jsonl"
    content = "".join(json.dumps({"image": str(p)}) + "\n" for p in paths).encode()
    manifest.write_bytes(content)
    rc = main(["caption", str(manifest), "--out", str(manifest), "--model", str(qwen3_vl_dir), "--max-tokens", "2",
               "--no-progress"] + (["--overwrite"] if overwrite else []))
    assert rc == 2
    assert manifest.read_bytes() == content
    assert "is one of the inputs" in capsys.readouterr().err


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_manifest_columns_pass_through_to_the_records(qwen3_vl_dir: Path, tmp_path: Path, suffix: str) -> None:
    paths = write_images(tmp_path / "imgs", 2)
    (tmp_path / "list.csv").write_text(f"id,image,label\n7,{paths[0]},cat\n")
    (tmp_path / "list.jsonl").write_text(json.dumps({"image": str(paths[1]), "id": 8, "tags": ["a", "b"]}) + "\n")
    out = tmp_path / f"out{suffix}"
    assert main(["caption", str(tmp_path / "list.csv"), str(tmp_path / "list.jsonl"), "--out", str(out),
                 "--model", str(qwen3_vl_dir), "--max-tokens", "2", "--no-progress"]) == 0
    records = _by_image(_records(out))
    columns = {k: r["columns"] if suffix == ".jsonl" else json.loads(r["columns"]) for k, r in records.items()}
    assert columns[str(paths[0])] == {"id": "7", "label": "cat"}  # Parquet: JSON text, as `parsed`
    assert columns[str(paths[1])] == {"id": 8, "tags": ["a", "b"]}
    assert all(r["kind"] == "image" for r in records.values())


def test_print_mode_and_no_inputs(qwen3_vl_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture,
                                  monkeypatch: pytest.MonkeyPatch) -> None:
    paths = write_images(tmp_path / "imgs", 2)
    args = ["caption", str(tmp_path / "imgs"), "--model", str(qwen3_vl_dir), "--max-tokens", "2"]
    for extra in ([], ["--out", "-"]):  # stdout is not a terminal here (a pipe): JSONL records, as in a file
        assert main(args + extra) == 0
        records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
        assert sorted(r["image"] for r in records) == [str(p) for p in paths]
        assert all(r["caption"] is not None and r["error"] is None for r in records)
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True, raising=False)  # a person's terminal: readable lines
    assert main(args) == 0
    lines = capsys.readouterr().out.splitlines()
    assert sorted(line.split(": ", 1)[0] for line in lines) == [str(p) for p in paths]
    (tmp_path / "empty").mkdir()
    assert main(["caption", str(tmp_path / "empty"), "--model", str(qwen3_vl_dir)]) == 2
    assert "no images found" in capsys.readouterr().err
    assert main(["caption", str(tmp_path / "imgs"), "--model", str(qwen3_vl_dir), "--out", "x.csv"]) == 2


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_a_full_disk_stops_the_job_with_a_summary_and_loses_nothing(qwen3_vl_dir: Path, tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture,
                                                                   monkeypatch: pytest.MonkeyPatch, suffix: str):
    import errno

    from vlmrun.jobs.journal import Journal

    paths = write_images(tmp_path / "imgs", 6)
    out = tmp_path / f"out{suffix}"
    args = ["caption", str(tmp_path / "imgs"), "--out", str(out), "--model", str(qwen3_vl_dir), "--max-tokens", "2",
            "--no-progress"]
    real, written = Journal.append, []

    def append(self, record):
        if len(written) == 3:
            raise OSError(errno.ENOSPC, "No space left on device")
        real(self, record)
        written.append(record["image"])

    monkeypatch.setattr(Journal, "append", append)
    assert main(args) == 1
    err = capsys.readouterr().err
    assert "stopped: cannot write the output" in err and "No space left on device" in err
    assert "the 3 records before it are kept" in err and "captioned 3/3" in err
    assert sorted(r["image"] for r in _records(out)) == sorted(written)
    assert not Path(str(out) + ".tmp").exists()
    monkeypatch.setattr(Journal, "append", real)  # space again: the rerun captions the rest
    assert main(args) == 0
    assert sorted(r["image"] for r in _records(out)) == sorted(str(p) for p in paths)


def test_a_failed_parquet_conversion_leaves_no_tmp_and_keeps_the_journal(tmp_path: Path, monkeypatch):
    from vlmrun.jobs import sink

    out = tmp_path / "o.parquet"
    output = sink.open_output(str(out))
    output.write(sink.CaptionRecord.failure("a.png", "m", "p", "boom"))

    def full(records, tmp, schema, row_group_size):
        Path(tmp).write_bytes(b"PAR1 half")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(sink, "_write_parquet_file", full)
    with pytest.raises(OSError):
        output.close()
    assert not Path(str(out) + ".tmp").exists() and not out.exists()
    assert [r["image"] for r in _records(Path(str(out) + JOURNAL_SUFFIX))] == ["a.png"]


def _lines_in(path: Path) -> int:
    try:
        return path.read_bytes().count(b"\n")
    except FileNotFoundError:
        return 0


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_sigkill_mid_job_then_resume_records_every_image_exactly_once(qwen3_vl_dir: Path, tmp_path: Path,
                                                                      suffix: str, capsys: pytest.CaptureFixture) -> None:
    n = 60
    paths = write_images(tmp_path / "imgs", n, size=(40, 40))
    out = tmp_path / f"out{suffix}"
    journal = out if suffix == ".jsonl" else Path(str(out) + JOURNAL_SUFFIX)
    cmd = [sys.executable, "-m", "vlmrun.cli", "caption", str(tmp_path / "imgs"), "--out", str(out),
           "--model", str(qwen3_vl_dir), "--max-tokens", "8", "--max-num-seqs", "4", "--no-progress"]
    env = subprocess_env()
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 60
    while _lines_in(journal) < 6 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, proc.stderr.read().decode()[-2000:]
    proc.stderr.close()
    killed_at = _lines_in(journal)
    assert 6 <= killed_at < n, f"the kill did not land mid-job ({killed_at} records)"
    if suffix == ".parquet":
        assert not out.exists()
    with open(journal, "ab") as fh:  # and a torn write, as a power loss would leave
        fh.write(b'{"image":"' + str(paths[0]).encode() + b'","caption":"par')

    rc = main(cmd[3:])  # the resumed run, in this process
    assert rc == 0
    assert "removed the torn last record line" in capsys.readouterr().err
    records = _by_image(_records(out))
    assert sorted(records) == sorted(str(p) for p in paths)
    assert all(r["error"] is None and r["num_tokens"] >= 1 for r in records.values())
    if suffix == ".jsonl":
        assert out.read_bytes().endswith(b"\n")
    else:
        assert not journal.exists()


SHAPE_SCHEMA = {"type": "object", "properties": {
    "colour": {"enum": ["red", "green", "blue"]}, "shape": {"enum": ["circle", "square", "triangle"]}},
    "required": ["colour", "shape"], "additionalProperties": False}


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_json_schema_job_records_carry_the_parsed_object(qwen3_vl_dir: Path, tmp_path: Path, suffix: str) -> None:
    images = write_images(tmp_path / "imgs", 3, size=(40, 40))
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps(SHAPE_SCHEMA))
    out = tmp_path / f"out{suffix}"
    args = ["caption", str(tmp_path / "imgs"), "--model", str(qwen3_vl_dir), "--json-schema", str(schema),
            "--no-progress"]
    assert main(args + ["--out", str(out), "--max-tokens", "40"]) == 0
    records = _by_image(_records(out))
    for path in images:
        r = records[str(path)]
        parsed = json.loads(r["parsed"]) if suffix == ".parquet" else r["parsed"]  # Parquet: JSON text
        assert r["error"] is None and parsed == json.loads(r["caption"])
        assert set(parsed) == {"colour", "shape"} and parsed["shape"] in ("circle", "square", "triangle")
    cut = tmp_path / f"cut{suffix}"
    assert main(args + ["--out", str(cut), "--max-tokens", "3"]) == 1  # too short to close the object
    for r in _records(cut):
        assert r["parsed"] is None and "cut by --max-tokens" in r["error"] and r["finish_reason"] == "length"


def test_regex_and_choice_jobs_and_a_bad_constraint(qwen3_vl_dir: Path, tmp_path: Path,
                                                    capsys: pytest.CaptureFixture) -> None:
    write_images(tmp_path / "imgs", 2, size=(40, 40))
    base = ["caption", str(tmp_path / "imgs"), "--model", str(qwen3_vl_dir), "--no-progress"]
    out = tmp_path / "choice.jsonl"
    assert main(base + ["--out", str(out), "--choice", "cat", "--choice", "dog"]) == 0
    assert all(r["parsed"] in ("cat", "dog") and r["parsed"] == r["caption"] for r in _records(out))
    out = tmp_path / "regex.jsonl"
    assert main(base + ["--out", str(out), "--regex", "[0-9]{2}"]) == 0
    assert all(len(r["parsed"]) == 2 and r["parsed"].isdigit() for r in _records(out))
    capsys.readouterr()
    assert main(base + ["--out", str(tmp_path / "bad.jsonl"), "--regex", "(unclosed"]) == 2
    assert "does not compile" in capsys.readouterr().err
    assert main(base + ["--json-schema", str(tmp_path / "nope.json")]) == 2
