"""Ray Data: `VlmrunCaptioner` as a map_batches callable, and `vlmrun caption --ray` on a local Ray
(CPU, the tiny model) giving the captions of the local path."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from testing.image_folders import write_bad_files, write_images
from tests.test_caption_cli import subprocess_env
from vlmrun.cli import main
from vlmrun.jobs.records import RECORD_FIELDS


def _results(path: Path) -> dict[str, tuple]:
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        rows = pq.read_table(path).to_pylist()
    else:
        rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    out = {r["image"]: (r["caption"], r["num_tokens"], r["error"], r["finish_reason"]) for r in rows}
    assert len(out) == len(rows)
    return out


def test_captioner_returns_one_row_per_input_in_order(qwen3_vl_dir: Path, tmp_path: Path) -> None:
    from vlmrun import LLM, SamplingParams
    from vlmrun.ray import VlmrunCaptioner

    paths = [str(p) for p in write_images(tmp_path, 3, size=(50, 40))]
    pixels = np.asarray(Image.open(paths[1]).convert("RGB"))
    captioner = VlmrunCaptioner(str(qwen3_vl_dir), prompt="Describe.", max_tokens=4, workers=2,
                                engine_options={"dtype": "float32", "max_num_seqs": 2})
    batch = {"image": np.array([paths[2], paths[0], str(tmp_path / "missing.png")])}
    out = captioner(batch)
    assert list(out) == list(RECORD_FIELDS)
    assert out["image"] == [paths[2], paths[0], str(tmp_path / "missing.png")]
    assert out["caption"][2] is None and "not found" in out["error"][2]
    want = LLM(str(qwen3_vl_dir), dtype="float32").generate(
        [{"prompt": "Describe.", "images": [p]} for p in (paths[2], paths[0], paths[1])],
        SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    assert out["caption"][:2] == [want[0].text, want[1].text]
    # decoded arrays (read_images) keyed by a "path" column
    decoded = captioner({"image": [pixels], "path": np.array(["p/1.png"])})
    assert decoded["image"] == ["p/1.png"] and decoded["caption"] == [want[2].text]


def test_ray_cli_gives_the_same_captions_as_the_local_path(qwen3_vl_dir: Path, tmp_path: Path) -> None:
    pytest.importorskip("ray")
    folder = tmp_path / "imgs"
    write_images(folder, 9, size=None, sizes_range=(40, 160), seed=5)
    write_bad_files(folder / "bad")
    common = ["caption", str(folder), "--model", str(qwen3_vl_dir), "--max-tokens", "5", "--no-progress"]
    assert main(common + ["--out", str(tmp_path / "local.jsonl")]) == 1  # the bad files fail
    cmd = [sys.executable, "-m", "vlmrun.cli", *common, "--out", str(tmp_path / "ray.parquet"), "--ray",
           "--ray-batch-size", "4", "--workers", "2"]
    done = subprocess.run(cmd, cwd=tmp_path, env=subprocess_env(), capture_output=True, text=True, timeout=240)
    assert done.returncode == 1, done.stderr[-3000:]
    local, on_ray = _results(tmp_path / "local.jsonl"), _results(tmp_path / "ray.parquet")
    assert len(local) == 13 and sum(r[2] is None for r in local.values()) == 9
    assert on_ray == local
