"""`vlmrun embed` end to end on the tiny Qwen3-VL: the caption job's machinery with a vector per image.

Checked: the vectors (JSONL and a Parquet fixed-size list column) equal `LLM.embed`'s for the same
prompts; bad inputs are error records with a null vector; a SIGKILL mid-job and a resume record every
image exactly once, the Parquet built at the end; a resume of a finished Parquet output keeps its vectors.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from testing.image_folders import write_bad_files, write_images
from tests.test_caption_cli import _by_image, _lines_in, _records, subprocess_env
from vlmrun import LLM
from vlmrun.cli import main
from vlmrun.jobs.sink import JOURNAL_SUFFIX


def _cmd(model_dir: Path, folder: Path, out: Path, *extra: str) -> list[str]:
    return ["embed", str(folder), "--out", str(out), "--model", str(model_dir), "--max-num-seqs", "4",
            "--no-progress", "--dtype", "float32", "--device", "cpu", *extra]


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_vectors_equal_llm_embed_and_bad_inputs_are_error_records(qwen3_vl_dir: Path, tmp_path: Path, suffix: str,
                                                                    capsys: pytest.CaptureFixture):
    paths = write_images(tmp_path / "imgs", 5, size=None, sizes_range=(30, 90), seed=4)
    bad = write_bad_files(tmp_path / "imgs")
    out = tmp_path / f"out{suffix}"
    assert main(_cmd(qwen3_vl_dir, tmp_path / "imgs", out, "--prompt", "a photo", "--max-num-batched-tokens",
                     "16")) == 1  # some inputs failed
    assert f"embedded 5/{5 + len(bad)} images" in capsys.readouterr().err
    records = _by_image(_records(out))
    llm = LLM(str(qwen3_vl_dir), runner="pooling", dtype="float32", device="cpu")
    want = llm.embed([{"prompt": "a photo", "images": [str(p)]} for p in paths], use_tqdm=False)
    for p, w in zip(paths, want):
        r = records[str(p)]
        assert r["error"] is None and r["caption"] is None and r["num_tokens"] == len(w.prompt_token_ids)
        np.testing.assert_allclose(r["embedding"], w.outputs.embedding, atol=1e-6)
    failed = [r for r in records.values() if r["error"] is not None]
    assert len(failed) == len(bad) and all(r["embedding"] is None for r in failed)
    if suffix == ".parquet":
        import pyarrow.parquet as pq

        column = pq.read_schema(out).field("embedding").type
        assert column.list_size == len(want[0].outputs.embedding) and str(column.value_type) == "float"
        assert main(_cmd(qwen3_vl_dir, tmp_path / "imgs", out, "--prompt", "a photo")) == 0  # resumed: nothing to do
        again = _by_image(_records(out))
        assert again[str(paths[0])]["embedding"] == records[str(paths[0])]["embedding"]  # kept through the resume


def test_sigkill_mid_job_then_resume_records_every_image_exactly_once(qwen3_vl_dir: Path, tmp_path: Path):
    n = 60
    paths = write_images(tmp_path / "imgs", n, size=(40, 40))
    out = tmp_path / "out.parquet"
    journal = Path(str(out) + JOURNAL_SUFFIX)
    cmd = [sys.executable, "-m", "vlmrun.cli", *_cmd(qwen3_vl_dir, tmp_path / "imgs", out)]
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=subprocess_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 60
    while _lines_in(journal) < 6 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, proc.stderr.read().decode()[-2000:]
    proc.stderr.close()
    killed_at = _lines_in(journal)
    assert 6 <= killed_at < n, f"the kill did not land mid-job ({killed_at} records)"
    assert not out.exists()
    assert main(cmd[3:]) == 0  # the resumed run, in this process
    records = _by_image(_records(out))
    assert sorted(records) == sorted(str(p) for p in paths)
    dims = {len(r["embedding"]) for r in records.values()}
    assert all(r["error"] is None for r in records.values()) and len(dims) == 1
    assert not journal.exists()


def test_a_bad_dimensions_is_a_usage_error(qwen3_vl_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture):
    write_images(tmp_path / "imgs", 1, size=(40, 40))
    assert main(_cmd(qwen3_vl_dir, tmp_path / "imgs", tmp_path / "o.jsonl", "--dimensions", "4")) == 2
    assert "Matryoshka" in capsys.readouterr().err


def test_embedder_rows_equal_the_local_job(qwen3_vl_dir: Path, tmp_path: Path):
    """`VlmrunEmbedder` as a map_batches callable (what `vlmrun embed --ray` maps): one row per input, in
    order, with the vector of the local job. (The --ray CLI itself starts a Ray: too slow for the suite.)"""
    from vlmrun.jobs.embed_records import EMBEDDING_FIELDS
    from vlmrun.ray import VlmrunEmbedder

    folder = tmp_path / "imgs"
    paths = [str(p) for p in write_images(folder, 3, size=None, sizes_range=(30, 90), seed=6)]
    embedder = VlmrunEmbedder(str(qwen3_vl_dir), workers=2, engine_options={"dtype": "float32", "max_num_seqs": 2})
    out = embedder({"image": np.array([paths[1], str(tmp_path / "missing.png"), paths[0]])})
    assert list(out) == list(EMBEDDING_FIELDS) and out["image"] == [paths[1], str(tmp_path / "missing.png"), paths[0]]
    assert out["embedding"][1] is None and "not found" in out["error"][1]
    local_out = tmp_path / "local.jsonl"
    assert main(_cmd(qwen3_vl_dir, folder, local_out)) == 0
    local = _by_image(_records(local_out))
    np.testing.assert_allclose([out["embedding"][0], out["embedding"][2]],
                               [local[paths[1]]["embedding"], local[paths[0]]["embedding"]], atol=1e-6)
