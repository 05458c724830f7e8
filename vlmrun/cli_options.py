"""Command-line options every engine-running command shares (`serve`, `web`, `caption`, `run-batch`):
kernels, async scheduling, speculative decoding, the image backend and the weights' quantization.

Kept free of torch so that parsing a command line stays fast.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from vlmrun.configs.quantization import QUANTIZATION_METHODS

# EngineConfig's LORA_KERNELS (vlmrun/config.py imports torch: the names are repeated here, and
# tests/test_cli_startup.py checks they agree).
LORA_KERNELS = ("torch", "triton")


def add_kernel_args(p: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    p.add_argument("--attention-backend", default="auto", choices=["auto", "torch", "cpu", "flashinfer"],
                   help="full-attention kernels (auto: cpu on the CPU; torch on CUDA until the fast path is verified)")
    p.add_argument("--gdn-backend", default="auto", choices=["auto", "torch", "fla"],
                   help="hybrid models' Gated DeltaNet kernels (fla: flash-linear-attention, CUDA)")
    p.add_argument("--enforce-eager", action=argparse.BooleanOptionalAction, default=None,
                   help="no decode padding to batch-size buckets and no CUDA graphs (default: eager on the "
                        "CPU only; --no-enforce-eager pads on the CPU too)")
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="plan and launch each step while the one before runs; its tokens reach the host one "
                        "step later (same tokens as without; default: on with CUDA, off on the CPU)")
    p.add_argument("--speculative-config", type=json_object, default=None, metavar="JSON",
                   help='speculative decoding, vLLM\'s keys, e.g. \'{"method": "ngram", "num_speculative_tokens": 3, '
                        '"prompt_lookup_min": 2, "prompt_lookup_max": 4}\' (docs/spec_decode.md; default: off)')
    p.add_argument("--verify-cuda-graphs", action="store_true",
                   help="speculative decoding: replay verify steps from CUDA graphs too (opt-in, unverified on a GPU)")
    p.add_argument("--linear-backend", default="auto", choices=["auto", "torch", "onednn"],
                   help="dense linears' GEMMs: onednn packs the weights once (auto: on the CPU)")
    p.add_argument("-q", "--quantization", default=None, choices=QUANTIZATION_METHODS,
                   help="the weights' quantization, vLLM's names (default: the checkpoint's own); must agree "
                        "with a quantized checkpoint; fp8 on a float checkpoint quantizes it at load (online FP8)")
    p.add_argument("--fp8-kernel", default="dequantize", choices=["dequantize", "cuda"],
                   help="FP8 layers' GEMM: dequantize (the weight to the activation dtype, then a float GEMM: "
                        "any device) or cuda (FP8 GEMM with 1x128 activation quantization; opt-in, unverified)")
    p.add_argument("--lora-kernel", default="torch", choices=LORA_KERNELS,
                   help="LoRA: the update of a batch of mixed adapters: torch (masked matmuls, any device) or "
                        "triton (rows grouped by adapter, Triton kernels on CUDA; opt-in, unverified on a GPU)")
    p.add_argument("--image-backend", default="auto", choices=["auto", "torchvision", "pil"],
                   help="image resize as transformers' torchvision (auto: when it imports) or PIL processor")
    p.add_argument("--threads", type=positive_int, default=None, metavar="N",
                   help="CPU threads for the engine's steps (default: chosen from the CPUs this process may use "
                        "(affinity, cgroup quota) and the model's size; or VLMRUN_NUM_THREADS; an OMP_NUM_THREADS "
                        "of yours is kept)")
    p.add_argument("--preprocess-device", default="auto", choices=["auto", "cpu", "cuda"],
                   help="resize and normalise images on the CPU or on the engine's GPU (torchvision backend); "
                        "auto: on the GPU where it is faster, measured at start")


def kernel_options(args: argparse.Namespace) -> dict[str, Any]:
    """The EngineConfig fields `add_kernel_args` set."""
    return {"attention_backend": args.attention_backend, "gdn_backend": args.gdn_backend,
            "linear_backend": args.linear_backend, "enforce_eager": args.enforce_eager,
            "async_scheduling": args.async_scheduling, "image_backend": args.image_backend,
            "preprocess_device": args.preprocess_device, "quantization": args.quantization,
            "fp8_kernel": args.fp8_kernel, "lora_kernel": args.lora_kernel,
            "speculative_config": args.speculative_config, "verify_cuda_graphs": args.verify_cuda_graphs,
            "num_threads": args.threads}


def positive_int(text: str) -> int:
    """A command-line count >= 1 (argparse type)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}")
    return value


def json_object(text: str) -> dict[str, Any]:
    """A command-line JSON object (argparse type): an error naming the text when it is not one."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from e
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value
