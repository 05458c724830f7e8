"""What the GPU acceptance run (bench/gpu_acceptance.py) runs: its checks, each a command with its own
time limit, in two parts of under ten minutes each, and what each names that must exist.

Part 1 is the CUDA fast path (FlashInfer's kernels first: they compile at first use), part 2 the
torch path on CUDA, the whole suite and the benchmarks. `missing_names` is what the script's dry run
checks: every test file and test function, the bench script, its models and their configs.
"""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[1]
PYTHON = sys.executable
BENCH_MODELS = ["qwen3_vl_2b", "qwen3_5_27b_4l"]
BENCH_CONFIGS = "tests/configs"
NOT_CUDA_FILES = ["tests/test_web.py", "tests/test_web_errors.py"]  # gradio and a browser: too large to carry
SETUP_SECONDS = 20  # what a part needs around its checks: the report and the log archive
NVCC_TIMEOUT_S = 10  # every part starts with `nvcc --version`
INSTALL_TIMEOUT_S = 60  # then installs the carried wheels
DEVICE_CALL_S = 600  # the longest command a device call runs


@dataclass(frozen=True)
class Check:
    """One command of the acceptance run, with the time it may take."""

    name: str  # also its log file's name
    part: int
    what: str  # one line for the report
    command: list[str]
    timeout_s: int
    test_ids: tuple[str, ...] = ()  # the pytest files and node ids it runs (the dry run checks they exist)
    env: dict[str, str] = field(default_factory=dict)


def pytest_check(name: str, part: int, what: str, test_ids: list[str], timeout_s: int,
                 extra: Optional[list[str]] = None) -> Check:
    command = [PYTHON, "-m", "pytest", "-q", "-s", "-rfEs", "--tb=short", "-p", "no:cacheprovider",
               "-p", "no:benchmark", *(extra or []), *test_ids]
    return Check(name, part, what, command, timeout_s, tuple(test_ids))


KERNELS = "tests/test_gpu_kernels.py"
ENGINE = "tests/test_gpu_engine.py"

CHECKS: list[Check] = [
    # part 1: the CUDA fast path, FlashInfer's JIT compiles first
    pytest_check("flashinfer_kernels", 1, "FlashInfer prefill/decode = torch backend (head_dim 128, 256); "
                 "refusals; fused vision attention = reference",
                 [f"{KERNELS}::test_flashinfer_equals_torch_backend",
                  f"{KERNELS}::test_flashinfer_refuses_what_it_cannot_run",
                  f"{KERNELS}::test_fused_vision_attention_equals_reference"], 200),
    pytest_check("fp8_cuda_kernel", 1, "FP8 block-scaled GEMM (torch scaled_mm, fp8_kernel='cuda') = the dequantized reference",
                 ["tests/test_quantization_fp8.py::test_cuda_kernel_matches_the_dequantized_reference"], 30),
    pytest_check("fla_float32", 1, "FLA GDN = torch GDN in float32 (hybrid real shapes, plain and 7-token chunks)",
                 [f"{KERNELS}::test_fla_engine_equals_torch_gdn_in_float32"], 70),
    pytest_check("fast_vs_torch_bf16", 1, "fast path (FlashInfer + FLA + graphs) follows the torch backends, bf16",
                 [f"{KERNELS}::test_fast_path_follows_torch_backends_in_bf16"], 80),
    pytest_check("fast_vs_hf_bf16", 1, "fast path follows HF bf16 by vLLM's rule and the bf16 error budget",
                 [f"{KERNELS}::test_fast_path_follows_hf_in_bf16"], 90),
    pytest_check("graphs_vs_eager", 1, "decode CUDA graphs = eager by vLLM's rule (Qwen3-VL-2B, Qwen3.5-27B shapes)",
                 [f"{KERNELS}::test_cuda_graphs_equal_eager"], 40),
    # part 2: the torch path on CUDA, the suite, the benchmarks
    pytest_check("float32_cuda_vs_cpu", 2, "float32 on CUDA = the CPU engine (every architecture, chunked too)",
                 [f"{ENGINE}::test_float32_cuda_equals_cpu_engine"], 45),
    pytest_check("bf16_torch_vs_hf", 2, "torch backends follow HF bf16 on CUDA by vLLM's rule",
                 [f"{ENGINE}::test_bfloat16_cuda_follows_hf"], 55),
    pytest_check("structured_and_defaults", 2, "structured outputs on CUDA = CPU engine; auto picks CUDA bf16; "
                 "async scheduling = sync on CUDA",
                 [f"{ENGINE}::test_structured_outputs_on_cuda_equal_the_cpu_engine",
                  f"{ENGINE}::test_auto_device_and_dtype_pick_cuda_bfloat16",
                  "tests/test_async_scheduling.py::test_async_equals_sync_on_cuda"], 45),
    pytest_check("gpu_preprocessing_and_gdn_ops", 2, "image preprocessing on CUDA; torch GDN ops on CUDA",
                 ["tests/test_processors.py", "tests/test_gdn_ops.py"], 25, ["-m", "gpu"]),
    pytest_check("suite", 2, "the whole suite with CUDA (xdist; the gpu-marked tests ran above; no gradio)",
                 ["tests"], 100, ["-n", "14", "-m", "not gpu", *(f"--ignore={f}" for f in NOT_CUDA_FILES)]),
    Check("bench", 2, "decode tok/s (batch 1) and share of the bandwidth floor, captions/s 256 x 448^2, "
          "TTFT 1024^2: torch backends, fast path, HF",
          [PYTHON, "-m", "bench.bench_gpu", "--models", *BENCH_MODELS, "--sides", "vlmrun", "vlmrun-fast", "HF",
           "--configs", BENCH_CONFIGS, "--repeats", "3", "--decode-tokens", "128", "--tmp", "/tmp",
           "--out", "{log_dir}/bench.jsonl"], 220, ("bench/bench_gpu.py",)),
]
PARTS = sorted({c.part for c in CHECKS})


def part_time_limit(part: int) -> int:
    """The seconds a part may take: its checks' limits, the nvcc check, the install and the report."""
    return SETUP_SECONDS + NVCC_TIMEOUT_S + INSTALL_TIMEOUT_S + sum(c.timeout_s for c in CHECKS if c.part == part)


def missing_names(check: Check, root: Path = ROOT) -> list[str]:
    """What `check` names that is not in the checkout: test files, test functions, the bench script,
    its models and their configs."""
    missing = []
    for test_id in check.test_ids:
        path, _, function = test_id.partition("::")
        file = root / path
        if not file.exists():
            missing.append(path)
        elif function and function.split("[")[0] not in _function_names(file):
            missing.append(test_id)
    if check.name == "bench":
        models = _dict_literal(root / "bench/bench_gpu.py", "MODELS")
        for name in BENCH_MODELS:
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
