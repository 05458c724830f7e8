"""`image_backend` ("auto" | "torchvision" | "pil") reaches the processor from every entry point,
and images preprocessed by different backends never share an encoder-cache or prefix-cache key."""

from __future__ import annotations

from pathlib import Path

import pytest

from vlmrun.processors import Processor
from vlmrun.processors.pixel_backends import resolve_image_backend, torchvision_available
from tests.test_engine_parity import make_image, user
from vlmrun import LLM
from vlmrun.cache.prefix_cache import page_keys
from vlmrun.cli import build_parser
from vlmrun.config import EngineConfig
from vlmrun.jobs.cli import build_config
from vlmrun.server.cli import engine_config

needs_torchvision = pytest.mark.skipif(not torchvision_available(), reason="torchvision does not import here")


def test_auto_follows_transformers() -> None:
    assert resolve_image_backend("auto") == ("torchvision" if torchvision_available() else "pil")
    assert resolve_image_backend("pil") == "pil"
    with pytest.raises(ValueError, match="image_backend"):
        resolve_image_backend("cv2")
    with pytest.raises(ValueError, match="image_backend"):
        EngineConfig(image_backend="cv2")


def test_command_lines_pass_it_on(tmp_path: Path) -> None:
    parser = build_parser()
    serve = parser.parse_args(["serve", "--image-backend", "pil"])
    assert engine_config(serve).image_backend == "pil"
    assert engine_config(parser.parse_args(["serve"])).image_backend == "auto"
    web = parser.parse_args(["web", "--image-backend", "pil"])
    assert engine_config(web).image_backend == "pil"
    caption = parser.parse_args(["caption", str(tmp_path), "--image-backend", "pil"])
    assert build_config(caption).engine_options["image_backend"] == "pil"
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--image-backend", "opencv"])


@needs_torchvision
def test_backends_give_other_hashes_and_prefix_keys(qwen3_vl_dir: Path) -> None:
    chat = [user(make_image(90, 61, 1), "What is this?")]
    prompts = {b: Processor.from_pretrained(qwen3_vl_dir, image_backend=b).process_chat(chat)
               for b in ("torchvision", "pil")}
    tv, pil = prompts["torchvision"], prompts["pil"]
    assert tv.token_ids == pil.token_ids
    assert tv.mm_items[0].hash != pil.mm_items[0].hash  # encoder-cache key
    assert Processor.from_pretrained(qwen3_vl_dir).process_chat(chat).mm_items[0].hash == tv.mm_items[0].hash
    n = len(tv.token_ids) // 4
    tv_keys, pil_keys = (page_keys(p.token_ids, p.mm_items, 4, n) for p in (tv, pil))
    image_page = tv.mm_items[0].offset // 4
    assert tv_keys[:image_page] == pil_keys[:image_page]  # pages before the image are shared
    assert tv_keys[image_page:] != pil_keys[image_page:] and tv_keys[-1] != pil_keys[-1]  # prefix-cache keys

    llm = LLM(str(qwen3_vl_dir), dtype="float32", device="cpu", image_backend="pil")
    assert llm.engine.processor.image_processor.backend == "pil"
    assert llm.engine.process(chat).mm_items[0].hash == pil.mm_items[0].hash


def test_preprocess_device_option(qwen3_vl_dir: Path, tmp_path: Path) -> None:
    parser = build_parser()
    assert engine_config(parser.parse_args(["serve", "--preprocess-device", "cuda"])).preprocess_device == "cuda"
    assert build_config(parser.parse_args(["caption", str(tmp_path)])).engine_options["preprocess_device"] == "auto"
    with pytest.raises(ValueError, match="preprocess_device"):
        EngineConfig(preprocess_device="gpu")
    with pytest.raises(ValueError, match="preprocess_device='cuda' needs the engine on CUDA"):
        LLM(str(qwen3_vl_dir), device="cpu", preprocess_device="cuda")


@pytest.mark.gpu
@needs_torchvision
def test_gpu_preprocessing_gives_the_cpu_pixels(qwen3_vl_dir: Path) -> None:
    chat = [user(make_image(90, 61, 1), make_image(300, 41, 2), "Compare.")]
    on_cpu = LLM(str(qwen3_vl_dir), device="cuda", dtype="float32", kv_cache_memory_bytes=64 << 20)
    on_gpu = LLM(str(qwen3_vl_dir), device="cuda", dtype="float32", kv_cache_memory_bytes=64 << 20,
                 preprocess_device="cuda")
    a, b = on_cpu.engine.process(chat), on_gpu.engine.process(chat)
    assert b.mm_items[0].pixel_values.is_cuda
    for x, y in zip(a.mm_items, b.mm_items):
        assert (x.pixel_values.cpu() == y.pixel_values.cpu()).all()
