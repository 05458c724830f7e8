"""A caption job's peak memory does not grow with the number of images (bounded queues, lazy inputs).

The same job runs in a subprocess over 500 and over 2,000 tiny images; its RSS high-water mark
(`resource.getrusage`) must stay within a few MB. Holding every preprocessed image instead would
add ~100 KB per image here (16 patches x 1536 float32 values), ~150 MB for the extra 1,500.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from testing.image_folders import write_images
from tests.test_caption_cli import subprocess_env

_SCRIPT = """
import json, resource, sys
from vlmrun.cli import main
rc = main(sys.argv[1:])
print(json.dumps({"rc": rc, "maxrss_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}))
"""

# The engine's encoder cache (an LRU of vision embeddings, 32,768 tokens by default) would fill
# across this range (4 tokens an image) and is bounded by its own setting, so it is kept small
# here: the test is about the job's own memory.
# Growth allowed from 500 to 2,000 images: the per-image bookkeeping (a 64-bit key hash, ~70 B)
# plus allocator noise; an unbounded pipeline would exceed it ~10 times over.
MAX_GROWTH_MB = 8


def _peak_rss_mb(inputs: list[str], out: Path, model: Path, cwd: Path) -> float:
    cmd = [sys.executable, "-c", _SCRIPT, "caption", *inputs, "--out", str(out), "--model", str(model),
           "--max-tokens", "1", "--workers", "2", "--max-num-seqs", "32", "--prefetch", "16",
           "--encoder-cache-tokens", "256", "--no-progress"]
    done = subprocess.run(cmd, cwd=cwd, env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["rc"] == 0, done.stderr[-2000:]
    return result["maxrss_kb"] / 1024


def test_peak_memory_is_flat_from_500_to_2000_images(qwen3_vl_dir: Path, tmp_path: Path) -> None:
    folder = tmp_path / "imgs"
    write_images(folder, 2000, size=(32, 32))
    small = _peak_rss_mb([str(folder / "img_00[0-4]*.png")], tmp_path / "small.jsonl", qwen3_vl_dir, tmp_path)
    large = _peak_rss_mb([str(folder)], tmp_path / "large.jsonl", qwen3_vl_dir, tmp_path)
    assert sum(1 for _ in open(tmp_path / "small.jsonl")) == 500
    assert sum(1 for _ in open(tmp_path / "large.jsonl")) == 2000
    print(f"peak RSS: 500 images {small:.1f} MB, 2000 images {large:.1f} MB, growth {large - small:+.1f} MB")
    assert large - small < MAX_GROWTH_MB, (small, large)
