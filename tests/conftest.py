"""Shared pytest fixtures: tiny checkpoints built once per session, sample images, the gpu marker."""

from __future__ import annotations

import atexit
import gc
import importlib.util
import os
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from testing.tiny_models import build_tiny_checkpoint, build_tiny_tokenizer
from tests.hf_kernels import route_hf_gdn_kernels_by_device

# transformers runs its GDN layers on flash-linear-attention whenever `fla` imports, CPU tensors
# included, where FLA's Triton kernels cannot run: HF references on the CPU must take HF's torch path.
if not torch.cuda.is_available():
    # (The FLA backend's own CPU check runs in a process of its own: tests/test_fla_backend.py.)
    sys.modules["fla"] = None  # type: ignore[assignment]
elif importlib.util.find_spec("fla") is not None:
    route_hf_gdn_kernels_by_device()


# The paged decode kernel (vlmrun/layers/attention/paged_decode.py) is built into a folder of the test session's
# own, not the user's cache (a test that needs another folder sets its own)
if "VLMRUN_KERNEL_CACHE" not in os.environ:
    os.environ["VLMRUN_KERNEL_CACHE"] = tempfile.mkdtemp(prefix="vlmrun-kernels-")
    atexit.register(shutil.rmtree, os.environ["VLMRUN_KERNEL_CACHE"], ignore_errors=True)


@pytest.fixture(autouse=True)
def _unfreeze_heap():
    """An Engine freezes the objects alive at its startup (vlmrun/engine/startup_heap.py); the next test's
    garbage cycles among them (an engine it dropped) must stay collectable."""
    yield
    gc.unfreeze()


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gpu: needs CUDA")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs CUDA (torch.cuda.is_available() is False)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def tiny_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tiny_tokenizer")
    build_tiny_tokenizer(out)
    return out


@pytest.fixture(scope="session")
def qwen3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_checkpoint("qwen3", tmp_path_factory.mktemp("tiny_qwen3"))


@pytest.fixture(scope="session")
def qwen2_5_vl_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_checkpoint("qwen2_5_vl", tmp_path_factory.mktemp("tiny_qwen2_5_vl"))


@pytest.fixture(scope="session")
def qwen3_vl_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_checkpoint("qwen3_vl", tmp_path_factory.mktemp("tiny_qwen3_vl"))


@pytest.fixture(scope="session")
def qwen3_5_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_checkpoint("qwen3_5", tmp_path_factory.mktemp("tiny_qwen3_5"))


@pytest.fixture(scope="session")
def qwen3_5_moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_checkpoint("qwen3_5_moe", tmp_path_factory.mktemp("tiny_qwen3_5_moe"))


@pytest.fixture(scope="session")
def qwen3_next_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_checkpoint("qwen3_next", tmp_path_factory.mktemp("tiny_qwen3_next"))


@pytest.fixture(scope="session")
def qwen3_vl_moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_checkpoint("qwen3_vl_moe", tmp_path_factory.mktemp("tiny_qwen3_vl_moe"))


def _pattern_image(width: int, height: int, seed: int) -> np.ndarray:
    """A deterministic RGB picture: colour gradients, a filled rectangle and a little noise."""
    rng = np.random.default_rng(seed)
    ys, xs = np.mgrid[0:height, 0:width].astype(np.float32)
    red = 255 * xs / max(width - 1, 1)
    green = 255 * ys / max(height - 1, 1)
    blue = 127 + 127 * np.sin((xs + 2 * ys) / (4 + seed))
    rgb = np.stack([red, green, blue], axis=-1)
    x0, y0 = width // 4, height // 3
    rgb[y0 : y0 + height // 3, x0 : x0 + width // 2] = rng.integers(0, 256, size=3)
    rgb += rng.normal(0, 8, size=rgb.shape)
    return np.clip(rgb, 0, 255).astype(np.uint8)


def make_sample_images() -> list[Image.Image]:
    """Small images of varied sizes (width x height), aspect ratios and modes, deterministic."""
    sizes = [(64, 48), (100, 30), (33, 77), (250, 250), (500, 120)]
    images = [Image.fromarray(_pattern_image(w, h, seed=i), "RGB") for i, (w, h) in enumerate(sizes)]
    gray = Image.fromarray(_pattern_image(40, 56, seed=7)[..., 1], "L")
    rgba = np.concatenate(
        [_pattern_image(80, 60, seed=8), np.zeros((60, 80, 1), dtype=np.uint8)], axis=-1
    )
    rgba[..., 3] = np.linspace(0, 255, 80, dtype=np.uint8)[None, :]  # alpha ramp, left edge fully clear
    images += [gray, Image.fromarray(rgba, "RGBA")]
    return images


@pytest.fixture
def sample_images() -> list[Image.Image]:
    """RGB 64x48, 100x30, 33x77, 250x250, 500x120, then an 'L' 40x56 and an 'RGBA' 80x60 image."""
    return make_sample_images()
