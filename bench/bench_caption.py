"""`vlmrun caption` vs a plain HF transformers loop: images/s captioning a folder of JPEGs on CPU.

Both sides caption the same N JPEG files (photo-like sizes 96..448 px a side, any aspect ratio)
from disk with the same random-weight Qwen3-VL checkpoint (bench.common.build_checkpoint) and
generate exactly --max-tokens tokens per image (EOS ignored), greedy:

- vlmrun: the caption job as the CLI runs it (`run_caption_job`: input walk, worker threads that
  decode and preprocess, the engine with continuous batching, JSONL records written and fsynced);
  timed from the first input to the last record (the engine load is not timed).
- HF: for each batch of --hf-batch files in order: open + decode with PIL, HF's processor, one
  left-padded batched `generate` (bench.common.run_hf); timed over all batches (the model load
  is not timed). A warm-up batch runs first.

The median of --repeats alternating runs is reported.

    python -m bench.bench_caption --images 128 --max-tokens 32 --repeats 3
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
from PIL import Image

from bench.common import (BENCH_MODEL, MAX_SIDE, PROMPT, add_threads_option, apply_threads, build_checkpoint,
                          describe_cpu, run_hf)
from testing.image_folders import write_images


def run_vlmrun(model_dir: Path, folder: Path, out: Path, max_tokens: int, max_num_seqs: int) -> tuple[float, int]:
    from vlmrun.jobs.config import CaptionJobConfig
    from vlmrun.jobs.runner import run_caption_job
    from vlmrun.sampling_params import SamplingParams

    config = CaptionJobConfig(
        inputs=[str(folder)], model=str(model_dir), out=str(out), prompt=PROMPT, overwrite=True, progress=False,
        sampling=SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
        engine_options={"dtype": "float32", "device": "cpu", "max_num_seqs": max_num_seqs})
    summary = run_caption_job(config)
    assert summary.written == summary.tokens // max_tokens and summary.failed == 0
    return summary.elapsed_s, summary.written


class HFLoop:
    def __init__(self, model_dir: Path):
        from transformers import AutoModelForImageTextToText

        from testing.hf_reference import HFReference

        self.ref = HFReference(model_dir)
        self.ref.model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32,
                                                                     attn_implementation="sdpa").eval()

    def run(self, files: list[Path], max_tokens: int, batch: int) -> tuple[float, int]:
        start = time.perf_counter()
        for i in range(0, len(files), batch):
            images = [Image.open(f).convert("RGB") for f in files[i:i + batch]]
            run_hf(self.ref, images, [max_tokens] * len(images), PROMPT)
        return time.perf_counter() - start, len(files)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--hf-batch", type=int, default=32, help="images per HF generate call")
    parser.add_argument("--max-num-seqs", type=int, default=64, help="vlmrun's concurrent requests")
    parser.add_argument("--repeats", type=int, default=3)
    add_threads_option(parser)
    args = parser.parse_args()
    apply_threads(args)
    print(f"device: {describe_cpu()}; {BENCH_MODEL}")
    print(f"{args.images} JPEGs, 96..{MAX_SIDE} px sides, {args.max_tokens} tokens each; HF batch {args.hf_batch}, "
          f"vlmrun max_num_seqs {args.max_num_seqs}; median of {args.repeats}")
    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = Path(tmp)
        model_dir = build_checkpoint(tmp_path / "model")
        folder = tmp_path / "images"
        files = write_images(folder, args.images, size=None, seed=1, fmt="JPEG", sizes_range=(96, MAX_SIDE + 1))
        warm = write_images(tmp_path / "warm", 8, size=None, seed=2, fmt="JPEG", sizes_range=(96, MAX_SIDE + 1))
        hf = HFLoop(model_dir)
        hf.run(warm, args.max_tokens, args.hf_batch)
        rates: dict[str, list[float]] = {"vlmrun caption": [], "HF loop": []}
        for _ in range(args.repeats):
            t, n = run_vlmrun(model_dir, folder, tmp_path / "out.jsonl", args.max_tokens, args.max_num_seqs)
            rates["vlmrun caption"].append(n / t)
            t, n = hf.run(files, args.max_tokens, args.hf_batch)
            rates["HF loop"].append(n / t)
        medians = {k: statistics.median(v) for k, v in rates.items()}
        for name, rate in medians.items():
            runs = ", ".join(f"{r:.2f}" for r in rates[name])
            print(f"  {name:15s} {rate:6.2f} images/s  {rate * args.max_tokens:7.1f} out tok/s   (runs: {runs})")
        print(f"  ratio vlmrun / HF images/s: {medians['vlmrun caption'] / medians['HF loop']:.2f}x")


if __name__ == "__main__":
    main()
