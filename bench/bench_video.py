"""Video decode + preprocessing throughput on CPU: a 30 s 720p clip through `processors.VideoProcessor`.

Writes the clip once with the FFmpeg command line (`testsrc2`, H.264, 30 frames/s, 1280x720), then
times `VideoProcessor.preprocess` (open, sample, decode only the sampled frames with torchcodec,
resize, normalise, patchify, hash) under the published video configs of Qwen3-VL (2 frames/s,
pixel bounds over all frames) and Qwen2.5-VL (asked for 2 frames/s, as qwen-vl-utils does by
default; per-frame bounds) and prints one line: sampled frames/s and clip seconds per second of
each, best of --repeats passes, with the command, date and machine.

    python -m bench.bench_video --threads 2
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from bench.common import add_threads_option, apply_threads, describe_run
from vlmrun.processors import ProcessorLimits
from vlmrun.processors.video_config import VideoProcessorConfig
from vlmrun.processors.video_io import video_decoder
from vlmrun.processors.video_processor import VideoOptions, VideoProcessor

CONFIGS = {
    "Qwen3-VL": ({"size": {"shortest_edge": 4096, "longest_edge": 25165824}, "patch_size": 16, "fps": 2,
                  "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
                  "video_processor_type": "Qwen3VLVideoProcessor"}, VideoOptions()),
    "Qwen2.5-VL": ({"min_pixels": 3136, "max_pixels": 12845056, "patch_size": 14,
                    "image_processor_type": "Qwen2VLImageProcessor"}, VideoOptions(fps=2.0)),
}


def write_clip(path: Path, seconds: int, fps: int, width: int, height: int) -> None:
    if shutil.which("ffmpeg") is None:
        raise SystemExit("needs the ffmpeg command (apt-get install ffmpeg)")
    subprocess.run(["ffmpeg", "-loglevel", "error", "-y", "-f", "lavfi", "-i",
                    f"testsrc2=size={width}x{height}:rate={fps}", "-t", str(seconds), "-c:v", "libx264",
                    "-pix_fmt", "yuv420p", str(path)], check=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=3)
    add_threads_option(parser, default=torch.get_num_threads())
    args = parser.parse_args()
    apply_threads(args)
    if video_decoder() is None:
        raise SystemExit("no video decoder (install FFmpeg + torchcodec, or PyAV)")
    with tempfile.TemporaryDirectory() as tmp:
        clip = Path(tmp) / "clip.mp4"
        write_clip(clip, args.seconds, 30, 1280, 720)
        results = []
        for name, (config, options) in CONFIGS.items():
            processor = VideoProcessor(VideoProcessorConfig.from_dict(config, "qwen3"))
            best, frames = float("inf"), 0
            for _ in range(args.repeats):
                start = time.perf_counter()
                video = processor.preprocess(str(clip), ProcessorLimits(), options)
                best = min(best, time.perf_counter() - start)
                frames = video.grid_thw[0] * processor.config.temporal_patch_size
            height, width = video.size
            results.append(f"{name}: {frames} frames resized to {width}x{height} in {best:.2f} s = "
                           f"{frames / best:.1f} frames/s ({args.seconds / best:.1f} clip s/s)")
    print(f"{describe_run(__spec__.name)}, decoder {video_decoder()} | {args.seconds} s 1280x720 30 frames/s H.264: "
          + "; ".join(results))


if __name__ == "__main__":
    main()
