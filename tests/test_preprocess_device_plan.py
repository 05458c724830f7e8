"""`preprocess_device="auto"`: the GPU image path only on CUDA, with torchvision, where one GPU outruns
the CPU workers and gives the CPU path's pixels (`vlmrun.processors.device_plan`); the plan runs on
CPU as plain functions, the measurement on a GPU."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from vlmrun import LLM
from vlmrun.processors import ImageProcessor, ImageProcessorConfig
from vlmrun.processors.device_plan import GPU_MARGIN, PathTiming, gpu_wins, measure_paths, plan_preprocess_device
from vlmrun.processors.pixel_backends import torchvision_available

CUDA = torch.device("cuda")
CPU = torch.device("cpu")


def never_measured() -> PathTiming:
    raise AssertionError("the paths were measured where the plan needs no measurement")


def test_gpu_wins_only_with_the_same_pixels_and_by_the_margin():
    assert gpu_wins(PathTiming(cpu_s=0.040, gpu_s=0.001, same_pixels=True), workers=8)
    assert not gpu_wins(PathTiming(cpu_s=0.040, gpu_s=0.001, same_pixels=False), workers=8)
    assert not gpu_wins(PathTiming(cpu_s=0.040, gpu_s=0.040 / (8 * GPU_MARGIN), same_pixels=True), workers=8)
    assert gpu_wins(PathTiming(cpu_s=0.040, gpu_s=0.040 / (8 * GPU_MARGIN) * 0.9, same_pixels=True), workers=8)


def test_cpu_and_off_cuda_need_no_measurement():
    assert plan_preprocess_device("cpu", CUDA, "torchvision", 4, never_measured) == CPU
    assert plan_preprocess_device("auto", CPU, "torchvision", 4, never_measured) == CPU
    with pytest.raises(ValueError, match="preprocess_device='cuda' needs the engine on CUDA"):
        plan_preprocess_device("cuda", CPU, "torchvision", 4, never_measured)
    with pytest.raises(ValueError, match="preprocess_device must be one of"):
        plan_preprocess_device("gpu", CPU, "torchvision", 4, never_measured)


def test_auto_on_cuda_follows_the_measurement(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    fast = PathTiming(cpu_s=0.050, gpu_s=0.001, same_pixels=True)
    slow = PathTiming(cpu_s=0.002, gpu_s=0.001, same_pixels=True)
    assert plan_preprocess_device("auto", CUDA, "torchvision", 4, lambda: fast) == CUDA
    assert plan_preprocess_device("auto", CUDA, "torchvision", 4, lambda: slow) == CPU
    assert plan_preprocess_device("auto", CUDA, "pil", 4, never_measured) == CPU  # PIL resizes on the host
    assert plan_preprocess_device("auto", CUDA, None, 4, never_measured) == CPU  # a text-only model

    def broken() -> PathTiming:
        raise RuntimeError("no kernel image")

    assert plan_preprocess_device("auto", CUDA, "torchvision", 4, broken) == CPU


def test_measure_paths_times_both_and_compares_pixels(qwen3_vl_dir: Path):
    processor = ImageProcessor(ImageProcessorConfig.from_pretrained(qwen3_vl_dir), "auto")
    timing = measure_paths(processor, CPU, repeats=1)  # on CPU both paths are the CPU's
    assert timing.same_pixels and timing.cpu_s > 0 and timing.gpu_s > 0


def test_auto_is_the_default_and_keeps_a_cpu_engine_on_the_cpu(qwen3_vl_dir: Path):
    llm = LLM(str(qwen3_vl_dir), dtype="float32", device="cpu")
    assert llm.engine.config.preprocess_device == "auto" and llm.engine.processor.device == CPU


@pytest.mark.gpu
@pytest.mark.skipif(not torchvision_available(), reason="torchvision does not import here")
def test_gpu_image_path_measured_on_cuda(qwen3_vl_dir: Path):
    """On a GPU: the calibration runs, the GPU path gives the CPU path's pixels, and "auto" follows it."""
    processor = ImageProcessor(ImageProcessorConfig.from_pretrained(qwen3_vl_dir), "torchvision")
    timing = measure_paths(processor, CUDA)
    assert timing.same_pixels, "the GPU resize differs from the CPU's: auto keeps images on the CPU"
    print(f"one 1024x768 image: CPU {timing.cpu_s * 1e3:.2f} ms, GPU {timing.gpu_s * 1e3:.2f} ms")
    llm = LLM(str(qwen3_vl_dir), device="cuda", dtype="float32", kv_cache_memory_bytes=64 << 20)
    assert llm.engine.processor.device.type in ("cuda", "cpu")
