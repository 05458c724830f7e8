"""What the benchmark scripts share: the CPU bench checkpoint and its workloads, timed runs, the machine.

The CPU benchmarks compare engines on one random-weight Qwen3-VL checkpoint larger than the test
ones (`build_checkpoint`, text hidden 512; weights do not change the speed) and on three workloads
of N requests (`make_requests`): `uniform` (one 224x224 image each, every output max-tokens long),
`mixed` (one image each, photo-like sizes and aspect ratios, output lengths uniform in max/4..max)
and `text` (no image, prompts of 8..96 words). `VlmrunSide` and `run_hf` time one batch of them on
vlmrun and on HF transformers as its users batch. Scripts run from the repository root as
`python -m bench.NAME`; they import `vlmrun`, `testing` and the shared modules of `bench/` (this
one, `gemm_ceiling`), never one another (tests/test_imports.py checks).
"""

from __future__ import annotations

import argparse
import ast
import datetime
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

import numpy as np
import torch
from PIL import Image

REPO_ROOT = Path(__file__).resolve().parents[1]
MAX_SIDE = 448  # the bench checkpoint's image processor's max_pixels is MAX_SIDE**2
BENCH_MODEL = "Qwen3-VL random weights (text hidden 512, 6 layers; vision 256 x 4)"
PROMPT = "Describe the image in one sentence."
WORKLOADS = ("uniform", "mixed", "text")
DTYPES = ("float32", "bfloat16")
WORDS = ("the a red blue small large circle square left right middle picture of shape colour "
         "describe what where how many there is are one two three near far above below").split()


def hide_flash_linear_attention() -> None:
    """Make `import fla` fail in this process. transformers binds its GDN layers to
    flash-linear-attention whenever `fla` imports, CPU tensors included, where FLA's Triton kernels
    cannot run: on the CPU every side takes its torch path. Call it before HF builds a model."""
    sys.modules["fla"] = None  # type: ignore[assignment]


# ------------------------------------------------------------------ the CPU bench checkpoint and workloads


def build_checkpoint(out_dir: Path) -> Path:
    """The bench checkpoint (`BENCH_MODEL`, float32, the tiny tokenizer, HF's torchvision image processor)."""
    from transformers import AutoTokenizer, GenerationConfig, Qwen3VLConfig, Qwen3VLForConditionalGeneration
    from transformers import Qwen2VLImageProcessor  # the default (torchvision) class

    from testing.tiny_models import build_tiny_tokenizer, reinit_weights, special_ids

    build_tiny_tokenizer(out_dir)
    tok = AutoTokenizer.from_pretrained(out_dir)
    ids = special_ids(tok)
    vocab = (len(tok) + 7) // 8 * 8
    config = Qwen3VLConfig(
        text_config=dict(vocab_size=vocab, hidden_size=512, intermediate_size=1536, num_hidden_layers=6,
                         num_attention_heads=8, num_key_value_heads=4, head_dim=64, max_position_embeddings=8192,
                         rms_norm_eps=1e-6, pad_token_id=ids.endoftext,
                         rope_parameters={"rope_type": "default", "rope_theta": 5_000_000.0,
                                          "mrope_section": [12, 10, 10], "mrope_interleaved": True}),
        vision_config=dict(depth=4, hidden_size=256, intermediate_size=1024, num_heads=4, out_hidden_size=512,
                           patch_size=16, spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=256,
                           deepstack_visual_indexes=[1, 2]),
        image_token_id=ids.image_pad, video_token_id=ids.video_pad, vision_start_token_id=ids.vision_start,
        vision_end_token_id=ids.vision_end, tie_word_embeddings=False,
        architectures=["Qwen3VLForConditionalGeneration"], dtype="float32",
    )
    torch.manual_seed(0)
    model = Qwen3VLForConditionalGeneration(config).eval()
    reinit_weights(model, 0)
    model.generation_config = GenerationConfig(eos_token_id=[ids.im_end, ids.endoftext], pad_token_id=ids.endoftext)
    model.save_pretrained(out_dir)
    factor = 32
    Qwen2VLImageProcessor(patch_size=16, merge_size=2, temporal_patch_size=2, min_pixels=4 * factor**2,
                          max_pixels=MAX_SIDE**2, image_mean=[0.5] * 3,
                          image_std=[0.5] * 3).save_pretrained(out_dir)
    return out_dir


def make_requests(n: int, workload: str, seed: int, max_tokens: int) -> tuple[list, list[str], list[int]]:
    """Per request: an image (None for text), a prompt, an output length (max/4..max for mixed)."""
    rng = np.random.default_rng(seed + 7)
    if workload == "mixed":
        lengths = [int(x) for x in rng.integers(max_tokens // 4, max_tokens + 1, size=n)]
    else:
        lengths = [max_tokens] * n
    if workload == "text":
        prompts = [" ".join(rng.choice(WORDS, size=int(rng.integers(8, 97)))) for _ in range(n)]
        return [None] * n, prompts, lengths
    return make_images(n, workload, seed), [PROMPT] * n, lengths


def make_images(n: int, workload: str, seed: int) -> list[Image.Image]:
    rng = np.random.default_rng(seed)
    sizes = []
    for _ in range(n):
        if workload == "uniform":
            sizes.append((224, 224))
        else:  # mixed: photo-like sizes, 96..448 px a side, landscape and portrait
            sizes.append((int(rng.integers(96, MAX_SIDE + 1)), int(rng.integers(96, MAX_SIDE + 1))))
    return [Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)) for w, h in sizes]


# ------------------------------------------------------------------ timed runs


def generate_timed(llm, images: list, prompts: list[str], lengths: list[int],
                   ignore_eos: bool = True) -> tuple[float, list]:
    """(seconds, outputs) of one greedy `LLM.generate` over the requests (an image each, or None)."""
    from vlmrun import SamplingParams

    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=ignore_eos) for n in lengths]
    requests = [{"prompt": p, "images": [img] if img is not None else []} for img, p in zip(images, prompts)]
    start = time.perf_counter()
    outs = llm.generate(requests, params, use_tqdm=False)
    return time.perf_counter() - start, outs


class VlmrunSide:
    """vlmrun on the CPU as one side of a comparison: `run` times one batch, (seconds, output tokens)."""

    def __init__(self, model_dir: Optional[Path], dtype: str, **engine_kwargs):
        from vlmrun import LLM

        self.llm = LLM(str(model_dir) if model_dir else None, dtype=dtype, device="cpu", **engine_kwargs)

    def run(self, images, prompts: list[str], lengths: list[int], ignore_eos: bool = True) -> tuple[float, int]:
        seconds, outs = generate_timed(self.llm, images, prompts, lengths, ignore_eos)
        return seconds, sum(len(o.token_ids) for o in outs)


def run_hf(ref, images, lengths: list[int], prompts, ignore_eos: bool = True) -> tuple[float, int]:
    """HF as its users batch (`ref`: a `testing.hf_reference.HFReference`): the default processor once
    over the whole batch (chat template, left padding), then one `generate`. The batch runs every row
    to the longest requested length (it cannot retire rows early); only the tokens each request asked
    for are counted (all generated tokens up to EOS with `ignore_eos=False`). `prompts` is one string
    or one per request. Returns (seconds, tokens)."""
    if isinstance(prompts, str):
        prompts = [prompts] * len(images)
    max_tokens = max(lengths)
    msgs = [[{"role": "user", "content": ([{"type": "image", "image": img}] if img is not None else [])
              + [{"type": "text", "text": p}]}] for img, p in zip(images, prompts)]
    processor = ref.processor
    start = time.perf_counter()  # HF's preprocessing is timed too, as vlmrun's is
    texts = [processor.apply_chat_template(m, tokenize=False, add_generation_prompt=True) for m in msgs]
    pil = [img for img in images if img is not None]
    inputs = processor(text=texts, images=pil or None, padding=True, padding_side="left", return_tensors="pt")
    if pil:
        inputs["pixel_values"] = inputs["pixel_values"].to(ref.model.dtype)
    lengths_kw = {} if not ignore_eos else {"min_new_tokens": max_tokens}
    with torch.no_grad():
        out = ref.model.generate(**inputs, max_new_tokens=max_tokens, do_sample=False, **lengths_kw)
    elapsed = time.perf_counter() - start
    width = inputs["input_ids"].shape[1]
    if ignore_eos:
        assert out.shape[1] - width == max_tokens
        return elapsed, sum(lengths)
    eos = set(ref.model.generation_config.eos_token_id or [])
    produced = 0
    for row in out[:, width:].tolist():
        produced += next((k + 1 for k, t in enumerate(row) if t in eos), len(row))
    return elapsed, produced


# ------------------------------------------------------------------ command lines and the machine


def engine_option(option: str) -> dict[str, object]:
    """"OPTION=VALUE" -> {OPTION: VALUE}, the value read as a Python literal when it is one (True, 4)."""
    key, sep, value = option.partition("=")
    if not sep:
        raise SystemExit(f"{option!r}: expected OPTION=VALUE")
    try:
        return {key: ast.literal_eval(value)}
    except (ValueError, SyntaxError):
        return {key: value}


def add_threads_option(parser: argparse.ArgumentParser, default: Optional[int] = None) -> None:
    parser.add_argument("--threads", type=int, default=default, help="torch's intra-op threads (default: torch's)")


def apply_threads(args: argparse.Namespace) -> None:
    """torch's intra-op threads as --threads asks (left alone when it is not given)."""
    if args.threads:
        torch.set_num_threads(args.threads)


def run_child(module: str, args: list[str]) -> dict:
    """Run `python -m MODULE ARGS` in a fresh process from the repository root (for what is
    process-wide: malloc settings, peak memory); its last line of output, read as JSON."""
    out = subprocess.run([sys.executable, "-m", module, *args], cwd=REPO_ROOT, capture_output=True, text=True,
                         check=True).stdout
    return json.loads(out.strip().splitlines()[-1])



def rotated(sides: Sequence[str], round_index: int) -> list[str]:
    """`sides` starting at round `round_index`'s place: an A/B run's rounds each start with another side, so
    no side always runs first (on a warm or a cold machine)."""
    k = round_index % len(sides)
    return list(sides[k:]) + list(sides[:k])

def describe_cpu() -> str:
    """'CPU (x86_64, 2 threads), torch 2.x': the processor, torch's threads and release."""
    return (f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads), "
            f"torch {torch.__version__}")


def describe_run(module: str) -> str:
    """'`python -m bench.X ARGS` | date | machine, cores, torch threads, torch': a BENCHMARKS.md row's start."""
    command = " ".join(["python -m", module, *sys.argv[1:]])
    return (f"`{command}` | {datetime.date.today()} | {platform.processor() or platform.machine()}, "
            f"{os.cpu_count()} cores, {torch.get_num_threads()} torch threads, torch {torch.__version__}")
