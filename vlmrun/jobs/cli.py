"""`vlmrun caption`: caption images (the batch-job pipeline grows here)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

IMAGE_SUFFIXES = {".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif", ".tif", ".tiff"}


def expand_inputs(inputs: list[str]) -> list[str]:
    paths: list[str] = []
    for item in inputs:
        p = Path(item)
        if p.is_dir():
            paths.extend(str(f) for f in sorted(p.rglob("*")) if f.suffix.lower() in IMAGE_SUFFIXES)
        else:
            paths.append(item)
    return paths


def caption(args: argparse.Namespace) -> int:
    from vlmrun import LLM, SamplingParams

    images = expand_inputs(args.inputs)
    if not images:
        print("no images found", file=sys.stderr)
        return 2
    llm = LLM(args.model, dtype=args.dtype, device=args.device)
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed)
    start = time.perf_counter()
    outs = llm.generate([{"prompt": args.prompt, "images": [img]} for img in images], params)
    elapsed = time.perf_counter() - start
    sink = open(args.out, "w", encoding="utf-8") if args.out else None
    failed = 0
    for img, out in zip(images, outs):
        failed += out.error is not None
        record = {"image": img, "caption": None if out.error else out.text, "num_tokens": len(out.token_ids),
                  "model": args.model, "prompt": args.prompt, "error": out.error}
        if sink:
            sink.write(json.dumps(record, ensure_ascii=False) + "\n")
        else:
            print(f"{img}: {'ERROR ' + out.error if out.error else out.text!r}")
    if sink:
        sink.close()
    tokens = sum(len(o.token_ids) for o in outs)
    print(f"captioned {len(images) - failed}/{len(images)} images in {elapsed:.2f}s "
          f"({len(images) / elapsed:.2f} images/s, {tokens / elapsed:.1f} tokens/s), {failed} failed", file=sys.stderr)
    return 1 if failed else 0


def register(sub: argparse._SubParsersAction) -> None:
    cap = sub.add_parser("caption", help="caption images")
    cap.add_argument("inputs", nargs="+", help="image files or directories")
    cap.add_argument("--model", required=True, help="HF checkpoint directory or hub id")
    cap.add_argument("--prompt", default="Describe the image.")
    cap.add_argument("--max-tokens", type=int, default=64)
    cap.add_argument("--temperature", type=float, default=0.0)
    cap.add_argument("--seed", type=int, default=None)
    cap.add_argument("--dtype", default="auto")
    cap.add_argument("--device", default="auto")
    cap.add_argument("--out", default=None, help="write JSONL records here instead of printing")
    cap.set_defaults(func=caption)
