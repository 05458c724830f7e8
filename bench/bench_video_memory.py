"""Peak memory of one video request's preprocessing, with the bundled default model's processor.

Each case runs in a fresh process: the processor is loaded and warmed up on a small clip, then one
request is processed and the growth of the peak resident set (ru_maxrss) is printed, with the
request's outcome (its token count, or the error that refused it). Cases: a 32-frame 2048x2048 clip
with `nframes` 32; a 9-frame 64x48 clip asked for `min_pixels` 13,000,000 (about 63,500 video tokens,
under the 65,536 limit) and 20,000,000 (over it).

    python -m bench.bench_video_memory
"""

from __future__ import annotations

import argparse
import json
import resource
import tempfile
from pathlib import Path

from bench.common import run_child
from testing.videos import write_video

CASES = [("big", {"nframes": 32}), ("small", {"min_pixels": 13_000_000}), ("small", {"min_pixels": 20_000_000})]


def measure(small: str, clip: str, options: dict) -> dict:
    """In this process: warm up on `small`, then process `clip` with `options`."""
    from vlmrun.processors import InputError, Processor
    from vlmrun.default_model import default_model_path

    processor = Processor.from_pretrained(default_model_path())

    def ask(path: str, **item) -> str:
        content = [{"type": "video", "video": path, **item}, {"type": "text", "text": "Describe."}]
        try:
            return f"{len(processor.process_chat([{'role': 'user', 'content': content}]).token_ids):,} prompt tokens"
        except InputError as exc:
            return f"refused: {str(exc)[:110]}"

    ask(small)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    outcome = ask(clip, **options)
    return {"outcome": outcome, "peak_growth_mb": (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # one case, in a subprocess: the small clip, the clip, the options as JSON
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        small, clip, options = args.child
        print(json.dumps(measure(small, clip, json.loads(options))))
        return
    with tempfile.TemporaryDirectory() as tmp:
        clips = {"small": str(write_video(Path(tmp) / "small.mp4", 9, 48, 64, 3.0, seed=0)),
                 "big": str(write_video(Path(tmp) / "big.mp4", 32, 2048, 2048, 8.0, seed=1))}
        for name, options in CASES:
            result = run_child(__spec__.name, ["--child", clips["small"], clips[name], json.dumps(options)])
            print(f"{name} clip {options}: peak growth {result['peak_growth_mb']:7.1f} MB; {result['outcome']}",
                  flush=True)


if __name__ == "__main__":
    main()
