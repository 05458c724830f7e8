"""Quantization as users reach it: `LLM(quantization=...)`, `-q/--quantization` and `--fp8-kernel` on every
engine-running command, the refusals, `Engine.stats().weight_bytes`, the cache budget the smaller
weights leave, and the weight bytes of Qwen's FP8 format counted at a real shape (meta device only).

The FP8 and int4 formats themselves (their arithmetic, equality with transformers, tensor parallelism)
are tests/test_quantization_fp8.py's and tests/test_quantization_int4.py's.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from bench.bench_quantized_memory import counted_bytes, hf_config, hf_tensors, read_config, with_variant
from vlmrun import LLM
from vlmrun.cache.plan import cache_budget_bytes
from vlmrun.cli import build_parser
from vlmrun.config import EngineConfig
from vlmrun.jobs.cli import build_config as caption_config
from vlmrun.jobs.run_batch_cli import build_config as run_batch_config
from vlmrun.server.cli import engine_config
from testing.fp8_checkpoints import write_fp8_checkpoint

CONFIGS = Path(__file__).resolve().parent / "configs"
SMALL = dict(device="cpu", dtype="bfloat16", kv_cache_memory_bytes=16 << 20, max_model_len=512, max_num_seqs=8)


def parameter_bytes(model: torch.nn.Module) -> int:
    """Every distinct parameter's bytes, counted here (a tied one once)."""
    unique = {id(p): p for p in model.parameters()}
    return sum(p.numel() * p.element_size() for p in unique.values())


@pytest.fixture(scope="module")
def float_llm(qwen3_vl_dir: Path) -> LLM:
    return LLM(str(qwen3_vl_dir), **SMALL)


@pytest.fixture(scope="module")
def online_fp8_llm(qwen3_vl_dir: Path) -> LLM:
    return LLM(str(qwen3_vl_dir), quantization="fp8", **SMALL)


@pytest.fixture(scope="module")
def fp8_dir(qwen3_vl_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Qwen3-VL checkpoint in Qwen's FP8 format (the vision tower left as it is)."""
    return write_fp8_checkpoint(qwen3_vl_dir, tmp_path_factory.mktemp("qwen3_vl_fp8"), quantize_vision=False)


# ------------------------------------------------------------------ the argument


@pytest.mark.parametrize("bad", ["int8", "FP8", "bitsandbytes", ""])
def test_an_unknown_quantization_is_refused_before_anything_loads(bad: str) -> None:
    with pytest.raises(ValueError, match=r"quantization must be None or one of fp8, awq, gptq, got"):
        EngineConfig(quantization=bad)
    with pytest.raises(ValueError, match=rf"got {bad!r}"):
        LLM("/no/such/checkpoint", quantization=bad)  # refused before the path is looked at


def test_an_unknown_fp8_kernel_is_refused() -> None:
    with pytest.raises(ValueError, match="fp8_kernel must be dequantize or cuda, got 'fast'"):
        EngineConfig(fp8_kernel="fast")


def test_llm_passes_quantization_to_its_engine(online_fp8_llm: LLM, float_llm: LLM) -> None:
    assert online_fp8_llm.engine.config.quantization == "fp8"
    assert online_fp8_llm.engine.model_config.quantization.online
    assert float_llm.engine.config.quantization is None and float_llm.engine.model_config.quantization is None


def test_awq_on_a_float_checkpoint_is_refused(qwen3_vl_dir: Path) -> None:
    with pytest.raises(ValueError, match=r"quantization='awq' needs a checkpoint quantized with awq; this one has "
                                         r"no quantization_config"):
        LLM(str(qwen3_vl_dir), quantization="awq", **SMALL)


def test_gptq_on_an_fp8_checkpoint_is_refused(fp8_dir: Path) -> None:
    with pytest.raises(ValueError, match=r"the checkpoint is quantized with 'fp8'; quantization='gptq' cannot read it"):
        LLM(str(fp8_dir), quantization="gptq", **SMALL)


# ------------------------------------------------------------------ the command line


@pytest.mark.parametrize("command", ["serve", "web", "run-batch", "caption"])
def test_the_flags_reach_the_engine_config(command: str, tmp_path: Path) -> None:
    given = {"serve": ["serve", "some/model"], "web": ["web"], "run-batch": ["run-batch", "-i", "in.jsonl"],
             "caption": ["caption", "images/", "--out", str(tmp_path / "out.jsonl")]}[command]
    parser = build_parser()

    def config(*flags: str) -> EngineConfig:
        args = parser.parse_args([*given, *flags])
        if command == "caption":
            return EngineConfig(**caption_config(args).engine_options)
        return run_batch_config(args).engine if command == "run-batch" else engine_config(args)

    default = config()
    assert (default.quantization, default.fp8_kernel) == (None, "dequantize")
    flagged = config("--quantization", "fp8", "--fp8-kernel", "cuda")
    assert (flagged.quantization, flagged.fp8_kernel) == ("fp8", "cuda")
    assert config("-q", "awq").quantization == "awq"  # vLLM's short flag


def test_a_bad_flag_value_names_the_choices(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["serve", "-q", "int8"])
    assert exit_info.value.code == 2
    assert "argument -q/--quantization: invalid choice: 'int8' (choose from 'fp8', 'awq', 'gptq')" in \
        capsys.readouterr().err


# ------------------------------------------------------------------ memory


def test_stats_report_the_weight_bytes_of_the_model(float_llm: LLM, online_fp8_llm: LLM) -> None:
    full = float_llm.engine.stats().weight_bytes
    assert full == (parameter_bytes(float_llm.engine.executor.model),)
    fp8 = online_fp8_llm.engine.stats().weight_bytes
    model = online_fp8_llm.engine.executor.model
    assert fp8 == (parameter_bytes(model),)
    assert any(p.dtype == torch.float8_e4m3fn for p in model.parameters())
    assert fp8[0] < full[0]


def test_the_meta_count_equals_what_the_engine_holds(float_llm: LLM, online_fp8_llm: LLM, fp8_dir: Path,
                                                     qwen3_vl_dir: Path) -> None:
    """bench/bench_quantized_memory.py's count (the model built on the meta device) against the engine's
    loaded model: float, online FP8 of it, and the checkpoint testing.fp8_checkpoints writes in Qwen's
    FP8 format (its own list of unquantized modules: every one by its full name)."""
    config = read_config(qwen3_vl_dir / "config.json")
    assert counted_bytes(config) == float_llm.engine.stats().weight_bytes[0]
    assert counted_bytes(config, "fp8") == online_fp8_llm.engine.stats().weight_bytes[0]
    fp8_llm = LLM(str(fp8_dir), **SMALL)
    try:
        assert counted_bytes(read_config(fp8_dir / "config.json")) == fp8_llm.engine.stats().weight_bytes[0]
    finally:
        fp8_llm.engine.shutdown()


def test_the_cache_budget_grows_by_the_weight_bytes_saved(float_llm: LLM, online_fp8_llm: LLM,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """On CUDA the KV + GDN budget is a share of the GPU less what is in use once the weights are loaded:
    a device holding the FP8 model instead of the float one leaves exactly the bytes saved to the cache.
    (The device is simulated: `torch.cuda.mem_get_info` reports a GPU holding `in_use` bytes.)"""
    total, other = 80 << 30, 3 << 30  # the GPU, and what the CUDA context and kernels hold beside the weights
    config = EngineConfig(gpu_memory_utilization=0.9)

    def budget(weights: int) -> int:
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (total - other - weights, total))
        return cache_budget_bytes(config, torch.device("cuda", 0))

    full = float_llm.engine.stats().weight_bytes[0]
    fp8 = online_fp8_llm.engine.stats().weight_bytes[0]
    assert budget(fp8) - budget(full) == full - fp8 > 0


def test_qwen_fp8_at_a_real_shape_takes_at_most_55_percent_of_bf16() -> None:
    """Qwen3-VL-30B-A3B, counted on the meta device as the engine builds it: the bf16 count is
    transformers' own parameter count x 2, Qwen's FP8 format (LM head, embeddings, routers and the vision
    tower in bf16) <= 55 % of it."""
    config = read_config(CONFIGS / "Qwen3-VL-30B-A3B-Instruct.json")
    bf16 = counted_bytes(config)
    assert bf16 == 2 * sum(torch.Size(shape).numel() for shape, _ in hf_tensors(hf_config(config)).values())
    fp8 = counted_bytes(with_variant(config, "fp8"))
    assert 0.5 < fp8 / bf16 <= 0.55, f"FP8 {fp8} B is {fp8 / bf16:.1%} of bf16 {bf16} B"

