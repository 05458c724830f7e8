"""What the GPU acceptance run (bench/gpu_acceptance.py) runs in its one device call: setup, then checks
in the order of what they are worth, each a command with its own time limit.

- tier 0, setup: the carried wheels installed (`install`, in gpu_acceptance.py), the carried Triton
  cache restored, every FlashInfer module loaded from the carried kernel wheel with JIT off;
- tier 1, speed: bench/bench_gpu.py on the real-shape random-weight models, one process per model,
  the fast path (FlashInfer + FLA + decode CUDA graphs), the torch path and HF side by side: decode
  tokens/s at batch 1, 16 and 64, captions/s for 256 x (448^2, 128 tokens), TTFT of one 1024^2 image;
- tier 2, the fast path's correctness: FlashInfer against the torch backend, the fast path against
  the torch backends in bf16 (FlashInfer + FLA), decode graphs against eager, in one pytest process
  so each real-shape checkpoint is built once; the FP8 CUDA GEMM;
- tier 3, as time allows: each starts only when its whole limit fits in what is left.
Tiers 0-2's limits, with the report's, must fit the call's budget (`CALL_BUDGET_S`, under the 600 s a
device command may run): `plan_seconds` is what the dry run checks. Every check runs with FlashInfer's
JIT off (a module missing from the wheel fails loudly), FLA's configs pinned and the Triton cache at
its fixed folder (`CHECK_ENV`). `missing_names` is what the dry run checks exists.
"""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[1]
PYTHON = sys.executable
CALL_BUDGET_S = 560  # the device command's own seconds: the run tool allows 600, the rest is slack
INSTALL_TIMEOUT_S = 45  # the carried wheels, installed once
REPORT_SECONDS = 20  # the Triton cache harvested, the report written, the logs packed
KILL_GRACE_S = 15  # a check past its limit is interrupted, then killed this much later
BENCH_MODELS = ["qwen3_vl_2b", "qwen3_5_27b_4l"]  # full attention; hybrid (27B's shapes, 3 GDN + 1 attention layer)
BENCH_CONFIGS = "tests/configs"
BENCH_SIDES = ["vlmrun-fast", "vlmrun-torch", "HF"]
NOT_CUDA_FILES = ["tests/test_web.py", "tests/test_web_errors.py"]  # gradio and a browser: too large to carry
TIERS = {0: "setup", 1: "speed", 2: "fast-path correctness", 3: "as time allows"}
TRITON_CACHE_DIR = Path("/tmp/vlmrun_triton_cache")  # fixed on every call: the cache's group files hold absolute paths
CHECK_ENV = {"FLASHINFER_DISABLE_JIT": "1", "VLMRUN_FLA_PINNED_CONFIGS": "1",
             "TRITON_CACHE_DIR": str(TRITON_CACHE_DIR), "TRITON_STORE_BINARY_ONLY": "1"}


@dataclass(frozen=True)
class Check:
    """One command of the acceptance run, with the time it may take."""

    name: str  # also its log file's name
    tier: int  # TIERS
    what: str  # one line for the report
    command: list[str]
    timeout_s: int
    test_ids: tuple[str, ...] = ()  # the pytest files and node ids it runs (the dry run checks they exist)
    env: dict[str, str] = field(default_factory=dict)


def pytest_check(name: str, tier: int, what: str, test_ids: list[str], timeout_s: int,
                 extra: Optional[list[str]] = None) -> Check:
    """pytest with FLA pinned before any test runs (HF's Qwen3.5 layers call FLA too: bench/gpu_fla_pins.py)."""
    command = [PYTHON, "-m", "pytest", "-q", "-s", "-rfEs", "--tb=short", "-p", "no:cacheprovider",
               "-p", "no:benchmark", "-p", "bench.gpu_fla_pins", *(extra or []), *test_ids]
    return Check(name, tier, what, command, timeout_s, tuple(test_ids))


def bench_check(model: str, timeout_s: int) -> Check:
    return Check(f"speed_{model}", 1, f"{model}: decode tok/s at batch 1, 16, 64; captions/s 256 x 448^2 x 128 "
                 "tokens; TTFT 1024^2: fast path, torch path, HF",
                 [PYTHON, "-m", "bench.bench_gpu", "--models", model, "--sides", *BENCH_SIDES,
                  "--configs", BENCH_CONFIGS, "--decode-batches", "1", "16", "64", "--decode-tokens", "32",
                  "--repeats", "2", "--caption-requests", "256", "--caption-px", "448", "--caption-tokens", "128",
                  "--time-limit-s", str(timeout_s - 30), "--tmp", "/tmp", "--out", "{log_dir}/bench.jsonl"],
                 timeout_s, ("bench/bench_gpu.py",))


KERNELS = "tests/test_gpu_kernels.py"
ENGINE = "tests/test_gpu_engine.py"
SYNCS = "tests/test_launch_syncs.py"

CHECKS: list[Check] = [
    # tier 0: setup (the install step comes first, from gpu_acceptance.py)
    Check("triton_cache", 0, "the carried Triton cache restored (only under this machine's triton_key)",
          [PYTHON, "-m", "bench.gpu_triton_cache", "restore"], 15),
    Check("kernels", 0, "every FlashInfer module of the fast path loads from the carried wheel, JIT off",
          [PYTHON, "-m", "bench.flashinfer_aot", "--verify"], 25, ("bench/flashinfer_aot.py",)),
    # tier 1: speed
    bench_check("qwen3_vl_2b", 150),
    bench_check("qwen3_5_27b_4l", 150),
    # tier 2: the fast path's correctness
    pytest_check("fast_path", 2, "FlashInfer prefill/decode = torch backend (head_dim 128, 256); refusals; fused "
                 "vision attention; fast path (FlashInfer + FLA + graphs) follows the torch backends in bf16; "
                 "decode graphs = eager by vLLM's rule",
                 [f"{KERNELS}::test_flashinfer_equals_torch_backend",
                  f"{KERNELS}::test_flashinfer_refuses_what_it_cannot_run",
                  f"{KERNELS}::test_fused_vision_attention_equals_reference",
                  f"{KERNELS}::test_fast_path_follows_torch_backends_in_bf16",
                  f"{KERNELS}::test_cuda_graphs_equal_eager"], 130),
    pytest_check("fp8_cuda_kernel", 2, "FP8 block-scaled GEMM (torch scaled_mm, fp8_kernel='cuda') = the dequantized reference",
                 ["tests/test_quantization_fp8.py::test_cuda_kernel_matches_the_dequantized_reference"], 25),
    # tier 3: as time allows, in this order
    Check("moe_decode_graphs", 3, "MoE decode tok/s at batch 1 and 64 (Qwen3-VL-30B-A3B's shapes, 2 layers, 128 "
          "experts): CUDA graphs (FlashInfer) vs eager vs the torch backend unpadded; the capture asserted",
          [PYTHON, "-m", "bench.bench_moe_graphs", "--layers", "2", "--batches", "1", "64", "--tokens", "32",
           "--tmp", "/tmp", "--out", "{log_dir}/bench.jsonl"], 120, ("bench/bench_moe_graphs.py",)),
    pytest_check("no_sync_on_cuda", 3, "no synchronizing CUDA call inside a launch (set_sync_debug_mode('error')): "
                 "7 architectures, bf16; MoE decode captured in graphs, its launches sync-free, eager's first tokens",
                 [f"{SYNCS}::test_no_sync_on_cuda", f"{SYNCS}::test_moe_decode_captured_on_cuda"], 75),
    pytest_check("fast_vs_hf_bf16", 3, "fast path follows HF bf16 by vLLM's rule and the bf16 error budget",
                 [f"{KERNELS}::test_fast_path_follows_hf_in_bf16"], 90),
    pytest_check("fla_float32", 3, "FLA GDN = torch GDN in float32 (hybrid real shapes, plain and 7-token chunks)",
                 [f"{KERNELS}::test_fla_engine_equals_torch_gdn_in_float32"], 70),
    pytest_check("verify_cuda_graphs", 3, "speculative decoding's verify steps from CUDA graphs = padded eager",
                 [f"{KERNELS}::test_verify_cuda_graphs_equal_padded_eager_verify"], 60),
    pytest_check("float32_cuda_vs_cpu", 3, "float32 on CUDA = the CPU engine (every architecture, chunked too)",
                 [f"{ENGINE}::test_float32_cuda_equals_cpu_engine"], 45),
    pytest_check("bf16_torch_vs_hf", 3, "torch backends follow HF bf16 on CUDA by vLLM's rule",
                 [f"{ENGINE}::test_bfloat16_cuda_follows_hf"], 55),
    pytest_check("structured_and_defaults", 3, "structured outputs on CUDA = CPU engine; auto picks CUDA bf16; "
                 "async scheduling = sync on CUDA",
                 [f"{ENGINE}::test_structured_outputs_on_cuda_equal_the_cpu_engine",
                  f"{ENGINE}::test_auto_device_and_dtype_pick_cuda_bfloat16",
                  "tests/test_async_scheduling.py::test_async_equals_sync_on_cuda"], 45),
    pytest_check("lora_triton", 3, "Triton LoRA kernels = the torch update on CUDA (kernels, engine)",
                 ["tests/test_lora_triton.py::test_kernels_equal_the_torch_update_on_cuda",
                  "tests/test_lora_triton.py::test_engine_with_the_triton_kernel_equals_the_torch_update_on_cuda"], 60),
    pytest_check("gpu_preprocessing_and_gdn_ops", 3, "image preprocessing on CUDA; torch GDN ops on CUDA",
                 ["tests/test_processors.py", "tests/test_gdn_ops.py"], 25, ["-m", "gpu"]),
    pytest_check("preprocess_device_auto", 3, "preprocess_device='auto' measures the GPU image path at start; "
                 "GPU preprocessing gives the CPU path's pixels",
                 ["tests/test_preprocess_device_plan.py::test_gpu_image_path_measured_on_cuda",
                  "tests/test_image_backend_option.py::test_gpu_preprocessing_gives_the_cpu_pixels"], 30),
    pytest_check("suite", 3, "the whole suite with CUDA (xdist; the gpu-marked tests ran above; no gradio)",
                 ["tests"], 100, ["-n", "14", "-m", "not gpu", *(f"--ignore={f}" for f in NOT_CUDA_FILES)]),
]
HARVEST = Check("triton_harvest", 0, "the Triton cache packed for the next call (under --out)",
                [PYTHON, "-m", "bench.gpu_triton_cache", "harvest", "--out", "{out}/triton_cache.tar.gz"], 15)


def planned(checks: list[Check] = CHECKS) -> list[Check]:
    """The checks whose limits the call's budget must hold: setup, speed, fast-path correctness."""
    return [c for c in checks if c.tier <= 2]


def plan_seconds(checks: list[Check] = CHECKS) -> int:
    """The call's seconds when every planned check takes its whole limit: the install, those checks,
    the report (the harvest inside it)."""
    return INSTALL_TIMEOUT_S + sum(c.timeout_s for c in planned(checks)) + REPORT_SECONDS


def missing_names(check: Check, root: Path = ROOT) -> list[str]:
    """What `check` names that is not in the checkout: test files, test functions, scripts, the bench's
    models and their configs."""
    missing = []
    for test_id in check.test_ids:
        path, _, function = test_id.partition("::")
        file = root / path
        if not file.exists():
            missing.append(path)
        elif function and function.split("[")[0] not in _function_names(file):
            missing.append(test_id)
    for module in (part for i, part in enumerate(check.command) if i and check.command[i - 1] in ("-m", "-p")):
        if module.startswith("bench.") and not (root / (module.replace(".", "/") + ".py")).exists():
            missing.append(module)
    if "--models" in check.command:
        models = _dict_literal(root / "bench/bench_gpu.py", "MODELS")
        for name in check.command[check.command.index("--models") + 1:]:
            if name.startswith("--"):
                break
            if name not in models:
                missing.append(f"bench/bench_gpu.py MODELS[{name!r}]")
            elif not (root / BENCH_CONFIGS / models[name][0]).exists():
                missing.append(f"{BENCH_CONFIGS}/{models[name][0]}")
    return missing


def _function_names(file: Path) -> set[str]:
    return {node.name for node in ast.parse(file.read_text()).body if isinstance(node, ast.FunctionDef)}


def _dict_literal(file: Path, name: str) -> dict:
    for node in ast.parse(file.read_text()).body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                return ast.literal_eval(node.value)
    return {}
