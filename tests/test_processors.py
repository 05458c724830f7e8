"""Tests for processors/: image loading and limits, HF-parity preprocessing, chat -> token ids.

References: transformers' `Qwen2VLImageProcessor` (torchvision backend) and `Qwen2VLImageProcessorPil`
(PIL backend) for pixels and grids, bit for bit; qwen-vl-utils' `fetch_image` (per-image sizing
options), transformers' `Qwen2_5_VLProcessor` / `Qwen3VLProcessor` (token ids).
"""

from __future__ import annotations

import base64
import contextlib
import functools
import hashlib
import http.server
import io
import json
import struct
import sys
import threading
import types
import zlib
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AutoTokenizer
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from vlmrun.processors import (
    IMAGE_BACKENDS,
    ImageProcessor,
    ImageProcessorConfig,
    InputError,
    MMItem,
    ProcessedPrompt,
    Processor,
    ProcessorLimits,
    load_image,
    smart_resize,
)
from vlmrun.processors.pixel_backends import torchvision_available
from vlmrun.shape_scenes import scene_from_file

ASSETS = Path(__file__).resolve().parent.parent / "assets" / "images"

# Real Qwen2.5-VL (patch 14, old top-level spelling) and Qwen3-VL (patch 16, transformers-5 `size`
# spelling) preprocessor configs, plus a small-budget one that exercises the shrink branch.
QWEN25_CONFIG = {
    "min_pixels": 3136, "max_pixels": 12845056, "patch_size": 14, "temporal_patch_size": 2, "merge_size": 2,
    "image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711],
}
QWEN3_CONFIG = {
    "size": {"shortest_edge": 65536, "longest_edge": 16777216}, "patch_size": 16, "temporal_patch_size": 2,
    "merge_size": 2, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
}
SMALL16_CONFIG = {**QWEN3_CONFIG, "size": {"shortest_edge": 4 * 32 * 32, "longest_edge": 64 * 32 * 32}}
CONFIGS = {"qwen25_p14": QWEN25_CONFIG, "qwen3_p16": QWEN3_CONFIG, "small_p16": SMALL16_CONFIG}

# (height, width): tiny (below min_pixels), square, odd, very wide, very tall, photo-like.
SIZES = [(1, 1), (10, 10), (28, 28), (57, 31), (300, 451), (20, 3000), (3000, 20), (333, 777), (1025, 769)]


# The backends of this environment: torchvision only where it imports (its tests skip elsewhere).
BACKENDS = [pytest.param("torchvision", marks=pytest.mark.skipif(not torchvision_available(),
                                                                 reason="torchvision does not import here")),
            "pil"]


def _hf_class(backend: str = "pil") -> Any:
    """transformers' image processor class that the backend reproduces."""
    if backend == "torchvision":
        from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor

        return Qwen2VLImageProcessor
    return Qwen2VLImageProcessorPil


def _hf(config: dict[str, Any], backend: str = "pil") -> Any:
    return _hf_class(backend)(**config)


def _noise(height: int, width: int, seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def _hf_pixels(hf: Any, images: list[Image.Image]) -> tuple[np.ndarray, list[list[int]]]:
    out = hf(images=images, return_tensors="np")
    return out["pixel_values"], out["image_grid_thw"].tolist()


@contextlib.contextmanager
def _placeholder_torchvision() -> Iterator[None]:
    """qwen_vl_utils.vision_process imports torchvision at module top but uses it only for video.

    Only CUDA builds of torchvision exist for this torch, so `import torchvision` fails here. A
    placeholder module is put in sys.modules just while qwen_vl_utils is imported, then removed
    (transformers probes torchvision with importlib and must keep seeing it as absent).
    """
    names = ("torchvision", "torchvision.io", "torchvision.transforms")
    saved = {n: sys.modules.get(n) for n in names}
    tv = types.ModuleType("torchvision")
    tv.__version__ = "0.0.0-placeholder"
    tv.io = types.ModuleType("torchvision.io")
    tv.transforms = types.ModuleType("torchvision.transforms")
    tv.transforms.InterpolationMode = types.SimpleNamespace(BICUBIC="bicubic")
    sys.modules.update({"torchvision": tv, "torchvision.io": tv.io, "torchvision.transforms": tv.transforms})
    try:
        yield
    finally:
        for n, mod in saved.items():
            if mod is None:
                sys.modules.pop(n, None)
            else:
                sys.modules[n] = mod


@functools.lru_cache(maxsize=1)
def _qwen_vl_utils() -> Any:
    try:
        import torchvision  # noqa: F401

        from qwen_vl_utils import vision_process
    except Exception:
        with _placeholder_torchvision():
            from qwen_vl_utils import vision_process
    return vision_process


# =============================================================================================
# (a) pixel_values / grid_thw equal transformers' Qwen2VLImageProcessor (torchvision) and
#     Qwen2VLImageProcessorPil (PIL), bit for bit
# =============================================================================================


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", list(CONFIGS))
def test_pixels_match_hf_processor(name: str, backend: str) -> None:
    config = CONFIGS[name]
    hf, ours = _hf(config, backend), ImageProcessor.from_dict(config, backend)
    assert ours.backend == backend
    for k, (h, w) in enumerate(SIZES):
        image = _noise(h, w, seed=k)
        ref, grids = _hf_pixels(hf, [image])
        got = ours.preprocess(image)
        assert list(got.grid_thw) == grids[0], (name, h, w)
        assert got.pixel_values.dtype == torch.float32
        assert got.pixel_values.shape == ref.shape
        np.testing.assert_array_equal(got.pixel_values.numpy(), ref, err_msg=f"{name} {h}x{w}")
        assert got.size == (grids[0][1] * config["patch_size"], grids[0][2] * config["patch_size"])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", ["qwen25_p14", "qwen3_p16"])
def test_pixels_match_hf_on_real_photos(name: str, backend: str) -> None:
    config = CONFIGS[name]
    hf, ours = _hf(config, backend), ImageProcessor.from_dict(config, backend)
    for path in sorted(ASSETS.glob("*.*g")):
        image = load_image(path)
        ref, grids = _hf_pixels(hf, [image])
        got = ours.preprocess(image)
        assert list(got.grid_thw) == grids[0], path.name
        np.testing.assert_array_equal(got.pixel_values.numpy(), ref, err_msg=path.name)


# large (shrunk by max_pixels), extreme aspect ratios (up to 200:1) and sizes at the rounding edges
ODD_SIZES = [(2400, 3200), (4, 800), (800, 4), (1, 200), (27, 29), (13, 2600)]


@pytest.mark.parametrize("backend", BACKENDS)
def test_pixels_match_hf_on_odd_sizes_and_batches(backend: str) -> None:
    for name in ("qwen25_p14", "small_p16"):
        config = CONFIGS[name]
        hf, ours = _hf(config, backend), ImageProcessor.from_dict(config, backend)
        for k, (h, w) in enumerate(ODD_SIZES):
            image = _noise(h, w, seed=20 + k)
            ref, grids = _hf_pixels(hf, [image])
            got = ours.preprocess(image)
            assert list(got.grid_thw) == grids[0], (name, h, w)
            np.testing.assert_array_equal(got.pixel_values.numpy(), ref, err_msg=f"{name} {h}x{w}")
        # HF resizes same-shape images as one stacked batch: still the per-image pixels
        images = [_noise(90, 130, seed=s) for s in (1, 2)] + [_noise(40, 300, seed=3)]
        ref, grids = _hf_pixels(hf, images)
        got = [ours.preprocess(image) for image in images]
        assert [list(g.grid_thw) for g in got] == grids
        np.testing.assert_array_equal(torch.cat([g.pixel_values for g in got]).numpy(), ref)


def _mode_images() -> dict[str, Image.Image]:
    """One picture in the PIL modes people feed: grayscale, RGBA, LA, CMYK, palette (with and
    without a transparent index), 1-bit."""
    rgb = Image.fromarray(_pattern(61, 45))
    rgba = np.concatenate([_pattern(61, 45), (np.arange(61, dtype=np.uint8) * 4)[None, :, None].repeat(45, 0)], -1)
    pal_transparent = rgb.convert("P", palette=Image.Palette.ADAPTIVE, colors=32)
    pal_transparent.info["transparency"] = 3
    return {
        "L": rgb.convert("L"),
        "RGBA": Image.fromarray(rgba, "RGBA"),
        "LA": Image.fromarray(rgba, "RGBA").convert("LA"),
        "CMYK": rgb.convert("CMYK"),
        "P": rgb.convert("P", palette=Image.Palette.ADAPTIVE, colors=32),
        "P+transparency": pal_transparent,
        "1": rgb.convert("1"),
    }


@pytest.mark.parametrize("backend", BACKENDS)
def test_pixels_match_hf_for_every_image_mode(backend: str) -> None:
    config = CONFIGS["qwen25_p14"]
    hf, ours = _hf(config, backend), ImageProcessor.from_dict(config, backend)
    for mode, image in _mode_images().items():
        assert image.mode == mode.split("+")[0]
        ref, grids = _hf_pixels(hf, [image])
        got = ours.preprocess(load_image(image))
        assert list(got.grid_thw) == grids[0], mode
        np.testing.assert_array_equal(got.pixel_values.numpy(), ref, err_msg=mode)


@pytest.mark.skipif(not torchvision_available(), reason="torchvision does not import here")
def test_auto_backend_is_torchvision_when_it_imports() -> None:
    assert ImageProcessor().backend == "torchvision"
    assert ImageProcessor(backend="pil").backend == "pil"
    with pytest.raises(ValueError, match="image_backend"):
        ImageProcessor(backend="opencv")
    # the two resizes differ (that is why the backend is an option and part of the hash)
    a, b = ImageProcessor(backend="torchvision"), ImageProcessor(backend="pil")
    image = _noise(300, 451, seed=9)
    ta, tb = a.preprocess(image), b.preprocess(image)
    assert ta.grid_thw == tb.grid_thw and ta.hash != tb.hash
    assert not torch.equal(ta.pixel_values, tb.pixel_values)


def test_smart_resize_matches_hf() -> None:
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize as hf_smart_resize

    rng = np.random.default_rng(1)
    for _ in range(500):
        h, w = (int(v) for v in rng.integers(1, 5000, 2))
        if max(h, w) / min(h, w) > 200:
            continue
        for factor, lo, hi in ((28, 3136, 12845056), (32, 65536, 16777216), (32, 4096, 65536)):
            assert smart_resize(h, w, factor, lo, hi) == hf_smart_resize(h, w, factor, lo, hi), (h, w, factor)
    with pytest.raises(InputError, match="aspect ratio"):
        smart_resize(10, 2500, 28, 3136, 12845056)


def test_config_spellings(qwen3_vl_dir: Path, qwen2_5_vl_dir: Path) -> None:
    old = ImageProcessorConfig.from_dict(QWEN25_CONFIG)
    new = ImageProcessorConfig.from_dict({**QWEN25_CONFIG, "min_pixels": None, "max_pixels": None,
                                          "size": {"shortest_edge": 3136, "longest_edge": 12845056}})
    assert (old.min_pixels, old.max_pixels) == (new.min_pixels, new.max_pixels) == (3136, 12845056)
    legacy_size = ImageProcessorConfig.from_dict({"size": {"min_pixels": 100, "max_pixels": 1000}})
    assert (legacy_size.min_pixels, legacy_size.max_pixels) == (100, 1000)
    # top-level min/max win over `size`, as in transformers
    both = ImageProcessorConfig.from_dict({"size": {"shortest_edge": 1, "longest_edge": 2}, "min_pixels": 7,
                                           "max_pixels": 9})
    assert (both.min_pixels, both.max_pixels) == (7, 9)
    assert ImageProcessorConfig.from_dict({}) == ImageProcessorConfig()  # transformers' class defaults

    for ckpt in (qwen2_5_vl_dir, qwen3_vl_dir):
        cfg = ImageProcessorConfig.from_pretrained(ckpt)
        hf = Qwen2VLImageProcessorPil.from_pretrained(str(ckpt))
        assert cfg is not None
        assert (cfg.patch_size, cfg.merge_size, cfg.temporal_patch_size) == (hf.patch_size, hf.merge_size,
                                                                             hf.temporal_patch_size)
        assert (cfg.min_pixels, cfg.max_pixels) == (hf.size["shortest_edge"], hf.size["longest_edge"])
        image = _noise(123, 77)
        ref, grids = _hf_pixels(hf, [image])
        got = ImageProcessor(cfg, "pil").preprocess(image)
        assert list(got.grid_thw) == grids[0]
        np.testing.assert_allclose(got.pixel_values.numpy(), ref, atol=1e-5, rtol=0)


def test_hash_identifies_pixels() -> None:
    ours = ImageProcessor.from_dict(QWEN25_CONFIG)
    a, b = _noise(100, 150, seed=1), _noise(100, 150, seed=2)
    ha = ours.preprocess(a).hash
    assert ha == ours.preprocess(a.copy()).hash
    assert ha != ours.preprocess(b).hash
    assert ha != ours.preprocess(a, max_pixels=4 * 28 * 28).hash  # other size, other pixels
    assert ha != ImageProcessor.from_dict(QWEN3_CONFIG).preprocess(a).hash  # other config
    other = [b for b in IMAGE_BACKENDS[1:] if b != ours.backend and (b != "torchvision" or torchvision_available())]
    for backend in other:  # other backend, other pixels
        assert ha != ImageProcessor.from_dict(QWEN25_CONFIG, backend).preprocess(a).hash
    assert len(ha) == 64 and set(ha) <= set("0123456789abcdef")  # a sha256 hex digest


# =============================================================================================
# (b) per-image min/max/resized_* options equal qwen-vl-utils' fetch_image + the HF processor
# =============================================================================================


PER_ITEM_OPTIONS: list[dict[str, int]] = [
    {"min_pixels": 200_000},
    {"max_pixels": 50_000},
    {"min_pixels": 100_000, "max_pixels": 150_000},
    {"resized_height": 280, "resized_width": 420},
    {"resized_height": 333, "resized_width": 101},
    {"resized_height": 90, "resized_width": 2000},
    {"max_pixels": 2_000_000},  # above the image's own size: only rounding
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", ["qwen25_p14", "qwen3_p16"])
def test_per_item_options_match_qwen_vl_utils(name: str, backend: str) -> None:
    vp = _qwen_vl_utils()
    config = CONFIGS[name]
    patch = config["patch_size"]
    hf, ours = _hf(config, backend), ImageProcessor.from_dict(config, backend)
    cfg = ours.config
    images = [_noise(300, 451, seed=3), load_image(ASSETS / "rocket_280x420.jpg"), _noise(61, 47, seed=4)]
    resized_twice = 0
    for image in images:
        for options in PER_ITEM_OPTIONS:
            fetched = vp.fetch_image({"image": image, **options}, image_patch_size=patch)
            ref, grids = _hf_pixels(hf, [fetched])
            got = ours.preprocess(image, **options)
            assert list(got.grid_thw) == grids[0], (name, image.size, options)
            # identical pixels, also where HF resizes qwen-vl-utils' image a second time (its size
            # lies outside the model's bounds)
            np.testing.assert_array_equal(got.pixel_values.numpy(), ref, err_msg=f"{name} {image.size} {options}")
            resized_twice += not cfg.min_pixels <= fetched.height * fetched.width <= cfg.max_pixels
    assert resized_twice >= (3 if name == "qwen3_p16" else 0)  # Qwen3's min_pixels is above some options' sizes


@pytest.mark.parametrize("backend", BACKENDS)
def test_per_item_options_through_process_chat(tiny_tokenizer_dir: Path, backend: str) -> None:
    vp = _qwen_vl_utils()
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_tokenizer_dir))
    template = (tiny_tokenizer_dir / "chat_template.jinja").read_text()
    processor = Processor(tokenizer, template, ImageProcessor.from_dict(QWEN25_CONFIG, backend))
    hf = _hf(QWEN25_CONFIG, backend)
    image = _noise(300, 451, seed=5)
    items = [{"type": "image", "image": image, "max_pixels": 60_000},
             {"type": "image", "image": image, "resized_height": 200, "resized_width": 120}]
    prompt = processor.process_chat([{"role": "user", "content": [*items, {"type": "text", "text": "hi"}]}])
    for item, mm in zip(items, prompt.mm_items):
        fetched = vp.fetch_image(item, image_patch_size=14)
        ref, grids = _hf_pixels(hf, [fetched])
        assert list(mm.grid_thw) == grids[0]
        np.testing.assert_array_equal(mm.pixel_values.numpy(), ref)
    assert [m.length for m in prompt.mm_items] == [int(np.prod(m.grid_thw)) // 4 for m in prompt.mm_items]


# =============================================================================================
# (c) token ids of a chat equal HF's Qwen-VL processor flow
# =============================================================================================


def _hf_vl_processor(ckpt: Path, backend: str) -> Any:
    """HF's own Qwen2.5-VL / Qwen3-VL processor around the backend's HF image processor, without video.

    Their constructors type-check a video processor, whose classes need torchvision; the subclass
    skips that check (video_processor=None) — text and image handling are HF's unchanged.
    """
    from transformers.models.qwen2_5_vl.processing_qwen2_5_vl import Qwen2_5_VLProcessor
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor

    base = Qwen3VLProcessor if "qwen3" in ckpt.name else Qwen2_5_VLProcessor

    class NoVideo(base):  # type: ignore[misc, valid-type]
        def check_argument_for_proper_class(self, argument_name: str, argument: Any) -> None:
            return None

    tokenizer = AutoTokenizer.from_pretrained(str(ckpt))
    image_processor = _hf_class(backend).from_pretrained(str(ckpt))
    return NoVideo(image_processor=image_processor, tokenizer=tokenizer, video_processor=None,
                   chat_template=(ckpt / "chat_template.jinja").read_text())


def _two_image_chat(img1: Any, img2: Any, as_url: bool = False) -> list[dict[str, Any]]:
    def item(x: Any) -> dict[str, Any]:
        return {"type": "image_url", "image_url": {"url": x}} if as_url else {"type": "image", "image": x}

    return [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": [item(img1), {"type": "text", "text": "What is in this picture?"}]},
        {"role": "assistant", "content": "A cat."},
        {"role": "user", "content": [{"type": "text", "text": "And here: "}, item(img2),
                                     {"type": "text", "text": "compare them."}]},
    ]


@pytest.mark.parametrize("arch", ["qwen2_5_vl", "qwen3_vl"])
def test_chat_token_ids_match_hf_processor(arch: str, request: pytest.FixtureRequest) -> None:
    ckpt: Path = request.getfixturevalue(f"{arch}_dir")
    img1 = load_image(ASSETS / "chelsea_451x300.jpg")
    img2 = _noise(77, 190, seed=6)
    processor = Processor.from_pretrained(ckpt)  # the default backend, as transformers picks it
    hf_proc = _hf_vl_processor(ckpt, processor.image_processor.backend)
    hf_messages = _two_image_chat(None, None)
    for m in hf_messages:  # HF's template only needs to see where the images are
        if isinstance(m["content"], list):
            m["content"] = [{"type": "image"} if c["type"] == "image" else c for c in m["content"]]
    text = hf_proc.apply_chat_template(hf_messages, tokenize=False, add_generation_prompt=True)
    ref = hf_proc(text=[text], images=[img1, img2], return_tensors="np")
    ref_ids = ref["input_ids"][0].tolist()

    prompt = processor.process_chat(_two_image_chat(img1, img2))
    assert isinstance(prompt, ProcessedPrompt)
    assert prompt.token_ids == ref_ids
    assert prompt.text == text

    pad = processor.image_token_id
    assert pad == hf_proc.image_token_id
    runs = [i for i, t in enumerate(ref_ids) if t == pad and (i == 0 or ref_ids[i - 1] != pad)]
    assert [m.offset for m in prompt.mm_items] == runs
    grids = ref["image_grid_thw"].tolist()
    assert [list(m.grid_thw) for m in prompt.mm_items] == grids
    for m in prompt.mm_items:
        assert isinstance(m, MMItem)
        assert prompt.token_ids[m.offset - 1] == processor.vision_token_ids.vision_start
        assert prompt.token_ids[m.offset: m.offset + m.length] == [pad] * m.length
        assert prompt.token_ids[m.offset + m.length] == processor.vision_token_ids.vision_end
    pixels = torch.cat([m.pixel_values for m in prompt.mm_items]).numpy()
    np.testing.assert_array_equal(pixels, ref["pixel_values"])

    # OpenAI image_url items (dict and plain string forms) give the same prompt
    as_url = processor.process_chat(_two_image_chat(img1, img2, as_url=True))
    assert as_url.token_ids == ref_ids
    plain = _two_image_chat(img1, img2, as_url=True)
    plain[1]["content"][0] = {"type": "image_url", "image_url": img1}
    assert processor.process_chat(plain).token_ids == ref_ids
    assert [m.hash for m in as_url.mm_items] == [m.hash for m in prompt.mm_items]


def test_process_prompt_is_one_user_turn(qwen2_5_vl_dir: Path) -> None:
    processor = Processor.from_pretrained(qwen2_5_vl_dir)
    img = _noise(50, 60)
    a = processor.process_prompt("describe", [img, img])
    b = processor.process_chat([{"role": "user", "content": [{"type": "image", "image": img},
                                                               {"type": "image", "image": img},
                                                               {"type": "text", "text": "describe"}]}])
    assert a.token_ids == b.token_ids and len(a.mm_items) == 2
    assert a.mm_items[0].hash == a.mm_items[1].hash
    text_only = processor.process_prompt("hello", [])
    assert text_only.mm_items == []
    assert text_only.token_ids == processor.tokenizer.encode(
        processor.tokenizer.apply_chat_template([{"role": "user", "content": [{"type": "text", "text": "hello"}]}],
                                                tokenize=False, add_generation_prompt=True),
        add_special_tokens=False)


def test_text_only_checkpoint(qwen3_dir: Path) -> None:
    processor = Processor.from_pretrained(qwen3_dir)
    assert not processor.supports_images
    ids = processor.process_chat([{"role": "user", "content": "hello there"}]).token_ids
    assert ids and processor.tokenizer.decode(ids).endswith("<|im_start|>assistant\n")
    with pytest.raises(InputError, match="does not accept images"):
        processor.process_prompt("what is this?", [_noise(30, 30)])


def test_chat_template_sources(tiny_tokenizer_dir: Path, tmp_path: Path) -> None:
    import shutil

    base = tmp_path / "tok"
    shutil.copytree(tiny_tokenizer_dir, base)
    template = (base / "chat_template.jinja").read_text()
    custom = "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}"
    (base / "chat_template.jinja").write_text(custom)
    assert Processor.from_pretrained(base).chat_template == custom
    (base / "chat_template.jinja").unlink()
    (base / "chat_template.json").write_text('{"chat_template": "JSON{{ messages[0][\'content\'] }}"}')
    assert Processor.from_pretrained(base).process_chat([{"role": "user", "content": "x"}]).text == "JSONx"
    (base / "chat_template.json").unlink()
    config_path = base / "tokenizer_config.json"
    tok_config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**tok_config, "chat_template": template}))
    assert Processor.from_pretrained(base).chat_template == template
    config_path.write_text(json.dumps({**tok_config, "chat_template": [{"name": "default", "template": custom},
                                                                        {"name": "tool_use", "template": "T"}]}))
    assert Processor.from_pretrained(base).chat_template == custom
    config_path.write_text(json.dumps(tok_config))
    tok = AutoTokenizer.from_pretrained(str(base))
    tok.chat_template = None
    bare = Processor(tok, None, None)
    with pytest.raises(ValueError, match="no chat template"):
        bare.process_chat([{"role": "user", "content": "x"}])


# =============================================================================================
# (d) every input kind
# =============================================================================================


def _pattern(width: int = 48, height: int = 32) -> np.ndarray:
    ys, xs = np.mgrid[0:height, 0:width]
    return np.stack([xs * 5 % 256, ys * 7 % 256, (xs + ys) * 3 % 256], -1).astype(np.uint8)


def _png_bytes(array: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(array).save(buf, "PNG")
    return buf.getvalue()


def test_every_input_kind_gives_the_same_pixels(tmp_path: Path) -> None:
    ref = _pattern()
    data = _png_bytes(ref)
    path = tmp_path / "pattern image.png"
    path.write_bytes(data)
    sources = {
        "str path": str(path),
        "Path": path,
        "file uri": f"file://{path}",
        "file uri, %-escaped": "file://" + str(path).replace(" ", "%20"),
        "bytes": data,
        "bytearray": bytearray(data),
        "data uri": "data:image/png;base64," + base64.b64encode(data).decode(),
        "data uri, wrapped lines": "data:image/png;base64," + base64.encodebytes(data).decode(),
        "PIL": Image.fromarray(ref),
        "PIL lazily opened": Image.open(path),
        "numpy uint8": ref,
        "numpy float": ref.astype(np.float64) / 255.0,
        "numpy float32": ref.astype(np.float32) / 255.0,
    }
    for kind, source in sources.items():
        image = load_image(source)
        assert image.mode == "RGB" and image.size == (48, 32), kind
        np.testing.assert_array_equal(np.asarray(image), ref, err_msg=kind)


def test_grayscale_and_alpha_inputs() -> None:
    gray = _pattern()[..., 0]
    for source in (gray, gray[..., None], Image.fromarray(gray)):
        out = np.asarray(load_image(source))
        np.testing.assert_array_equal(out, np.repeat(gray[..., None], 3, -1))
    # RGBA: transparent -> white, opaque kept, partial blended; equal to HF's conversion
    rgba = np.concatenate([_pattern(), np.zeros((32, 48, 1), np.uint8)], -1)
    rgba[:, 16:32, 3] = 128
    rgba[:, 32:, 3] = 255
    for source in (rgba, Image.fromarray(rgba), _png_bytes(rgba)):
        out = np.asarray(load_image(source)).astype(int)
        assert (out[:, :16] == 255).all()
        np.testing.assert_array_equal(out[:, 32:], rgba[:, 32:, :3])
        expected = rgba[:, 16:32, :3].astype(np.float64) * 128 / 255 + 255 * 127 / 255
        assert np.abs(out[:, 16:32] - expected).max() <= 1
    from transformers.image_transforms import convert_to_rgb

    hf_rgb = convert_to_rgb(Image.fromarray(rgba), return_numpy=True)
    np.testing.assert_array_equal(np.asarray(load_image(Image.fromarray(rgba))), hf_rgb)
    # LA and palette-with-transparency (GIF) are composited too
    la = Image.fromarray(np.stack([gray, np.where(gray > 100, 255, 0).astype(np.uint8)], -1), "LA")
    out = np.asarray(load_image(la))
    assert (out[gray <= 100] == 255).all()
    pal = Image.new("P", (8, 8), 0)
    pal.putpalette([10, 20, 30] * 256)
    buf = io.BytesIO()
    pal.save(buf, "GIF", transparency=0)
    assert (np.asarray(load_image(buf.getvalue())) == 255).all()
    # 16-bit grayscale PNG is scaled to 8 bits, not clipped
    g16 = (np.arange(64, dtype=np.uint16).reshape(8, 8) * 1000)
    buf = io.BytesIO()
    Image.fromarray(g16).save(buf, "PNG")
    out = np.asarray(load_image(buf.getvalue()))[..., 0]
    np.testing.assert_array_equal(out, np.rint(g16 / 257).astype(np.uint8))


def test_exif_rotated_jpeg(tmp_path: Path) -> None:
    stored = Image.fromarray(_pattern(40, 20))
    exif = Image.Exif()
    exif[0x0112] = 6  # "rotate 90 clockwise to display"
    path = tmp_path / "rotated.jpg"
    stored.save(path, "JPEG", quality=95, exif=exif.tobytes())
    decoded = Image.open(path)
    decoded.load()
    expected = np.asarray(decoded.convert("RGB").transpose(Image.Transpose.ROTATE_270))
    for source in (path, path.read_bytes(), Image.open(path)):
        image = load_image(source)
        assert image.size == (20, 40)
        np.testing.assert_array_equal(np.asarray(image), expected)


@pytest.fixture
def http_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[str, Path]]:
    """A local http.server on 127.0.0.1 serving tmp_path (no real network)."""
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
    monkeypatch.setenv("no_proxy", "127.0.0.1,localhost")

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Quiet, directory=str(tmp_path)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", tmp_path
    finally:
        server.shutdown()
        server.server_close()


def test_http_url(http_root: tuple[str, Path]) -> None:
    base, root = http_root
    ref = _pattern()
    (root / "a.png").write_bytes(_png_bytes(ref))
    np.testing.assert_array_equal(np.asarray(load_image(f"{base}/a.png")), ref)
    with pytest.raises(InputError, match="HTTP 404"):
        load_image(f"{base}/missing.png")
    with pytest.raises(InputError, match="more than the limit"):
        load_image(f"{base}/a.png", ProcessorLimits(max_image_bytes=100))
    with pytest.raises(InputError, match="not accepted"):
        load_image(f"{base}/a.png", ProcessorLimits(allow_remote_urls=False))
    with pytest.raises(InputError, match="could not fetch"):
        load_image("http://127.0.0.1:1/nothing-listens-here.png")


# =============================================================================================
# (e) bad input raises InputError with a clear message
# =============================================================================================


def _png_header(width: int, height: int) -> bytes:
    """A PNG whose header claims width x height but that carries no pixel data (a cheap 'bomb')."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)  # 8-bit RGB
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"")) + chunk(b"IEND", b"")


def _jpeg_bytes() -> bytes:
    buf = io.BytesIO()
    Image.fromarray(_pattern(64, 64)).save(buf, "JPEG", quality=90)
    return buf.getvalue()


def test_bad_inputs(tmp_path: Path) -> None:
    empty = tmp_path / "empty.jpg"
    empty.write_bytes(b"")
    text = tmp_path / "notes.txt"
    text.write_text("this is not an image\n" * 20)
    jpeg, png = _jpeg_bytes(), _png_bytes(_pattern(64, 64))
    cases: list[tuple[str, Any, str]] = [
        ("corrupt bytes", bytes(np.random.default_rng(0).integers(0, 256, 2000, dtype=np.uint8)),
         "not a recognised image"),
        ("truncated JPEG", jpeg[: len(jpeg) // 2], "corrupt or truncated"),
        ("truncated PNG", png[: len(png) // 2], "corrupt or truncated"),
        ("zero-byte file", empty, r"empty \(0 bytes\)"),
        ("zero bytes", b"", r"empty \(0 bytes\)"),
        ("text file", text, "not a recognised image.*text"),
        ("missing file", tmp_path / "nope.png", "not found"),
        ("directory", tmp_path, "directory"),
        ("PNG bomb 100000x100000", _png_header(100_000, 100_000), "more pixels than the limit|pixels, more than"),
        ("bad base64", "data:image/png;base64,!!!not-base64!!!", "valid base64"),
        ("data URI, not base64", "data:image/png,abc", "base64"),
        ("data URI, text type", "data:text/plain;base64,aGVsbG8=", "not an image type"),
        ("numpy shape", np.zeros((4, 4, 2), np.uint8), "unsupported shape"),
        ("numpy dtype", np.zeros((4, 4, 3), np.int64), "dtype"),
        ("numpy range", np.full((4, 4, 3), 2.0), r"\[0, 1\]"),
        ("numpy nan", np.full((4, 4, 3), np.nan), "NaN"),
        ("unsupported type", 12345, "unsupported image source"),
        ("ftp url", "ftp://example.com/a.png", "unsupported URL scheme"),
    ]
    for what, source, message in cases:
        with pytest.raises(InputError, match=message):
            load_image(source)
        assert issubclass(InputError, ValueError), what


def test_decompression_bomb_checked_before_decoding() -> None:
    # 9000 x 9000 = 81 MP: under PIL's own guard (89 MP), over our 64 MP default. The file has no
    # pixel data, so reaching the decoder would report truncation: the pixel message proves the
    # check ran on the header alone.
    with pytest.raises(InputError, match="9000x9000 = 81,000,000 pixels, more than the limit of 64,000,000"):
        load_image(_png_header(9000, 9000))
    with pytest.raises(InputError, match="corrupt or truncated"):
        load_image(_png_header(900, 900))
    with pytest.raises(InputError, match="pixels, more than the limit of 1,000"):
        load_image(_png_bytes(_pattern(64, 64)), ProcessorLimits(max_image_pixels=1000))
    with pytest.raises(InputError, match="more than the limit of 1,000"):
        load_image(_pattern(64, 64), ProcessorLimits(max_image_pixels=1000))


def test_request_limits(qwen2_5_vl_dir: Path, tmp_path: Path) -> None:
    processor = Processor.from_pretrained(qwen2_5_vl_dir, limits=ProcessorLimits(max_images_per_request=2))
    missing = str(tmp_path / "does-not-exist.png")
    # counted before any image is opened: the (missing) files are never touched
    with pytest.raises(InputError, match=r"too many images in one request: 3 \(the limit is 2\)"):
        processor.process_prompt("x", [missing, missing, missing])
    with pytest.raises(InputError, match=r"image 2 \(.*does-not-exist.png'\): .* not found"):
        processor.process_prompt("x", [_noise(30, 30), missing])
    small = Processor.from_pretrained(qwen2_5_vl_dir, limits=ProcessorLimits(max_image_bytes=1000))
    big = tmp_path / "big.png"
    big.write_bytes(_png_bytes(np.random.default_rng(0).integers(0, 256, (64, 64, 3), dtype=np.uint8)))
    with pytest.raises(InputError, match="more than the limit of 1,000"):
        small.process_prompt("x", [big])
    no_paths = Processor.from_pretrained(qwen2_5_vl_dir, limits=ProcessorLimits(allow_local_paths=False))
    with pytest.raises(InputError, match="local image paths are not accepted"):
        no_paths.process_prompt("x", [big])


def test_bad_messages(qwen2_5_vl_dir: Path) -> None:
    processor = Processor.from_pretrained(qwen2_5_vl_dir)
    img = _noise(30, 30)
    bad: list[tuple[Any, str]] = [
        ([], "empty"),
        ("hello", "list"),
        ([{"content": "x"}], "role"),
        ([{"role": "user", "content": 5}], "content must be"),
        ([{"role": "user", "content": [{"type": "video", "video": "v.mp4"}]}], "not found"),
        ([{"role": "user", "content": [{"type": "audio", "audio": "a.wav"}]}], "not supported"),
        ([{"role": "user", "content": [{"type": "sticker"}]}], "unknown content type"),
        ([{"role": "user", "content": [{"type": "text"}]}], "'text' string"),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}], "no image"),
        ([{"role": "user", "content": "sneaky <|image_pad|>"}], "reserved token"),
        ([{"role": "user", "content": [{"type": "image", "image": img, "max_pixels": -5}]}], "positive integer"),
        ([{"role": "user", "content": [{"type": "image", "image": img, "min_pixels": 10**6,
                                        "max_pixels": 10}]}], "max_pixels"),
        ([{"role": "user", "content": [{"type": "image", "image": _noise(2, 500)}]}], "aspect ratio"),
    ]
    for messages, message in bad:
        with pytest.raises(InputError, match=message):
            processor.process_chat(messages)


def test_assets_load() -> None:
    files = sorted(ASSETS.glob("*.*g"))
    photos = [f for f in files if scene_from_file(f) is None]  # the rest are small generator scenes
    assert len(photos) >= 5
    total = sum(f.stat().st_size for f in files)
    assert total < 1_000_000
    for f in files:
        image = load_image(f)
        assert image.mode == "RGB" and min(image.size) >= (200 if f in photos else 64)


# =============================================================================================
# (f) GPU path
# =============================================================================================


@pytest.mark.gpu
def test_cuda_preprocess_matches_cpu() -> None:
    """PIL backend: the resize runs on the host, so CUDA pixels (and hashes) equal the CPU ones."""
    for config in (QWEN25_CONFIG, QWEN3_CONFIG):
        ours = ImageProcessor.from_dict(config, "pil")
        for k, (h, w) in enumerate(SIZES):
            image = _noise(h, w, seed=k)
            cpu = ours.preprocess(image)
            gpu = ours.preprocess(image, device="cuda")
            assert gpu.pixel_values.is_cuda and gpu.grid_thw == cpu.grid_thw and gpu.hash == cpu.hash
            torch.testing.assert_close(gpu.pixel_values.cpu(), cpu.pixel_values, atol=1e-6, rtol=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torchvision_available(), reason="torchvision does not import here")
def test_cuda_torchvision_preprocess_matches_hf_on_cuda() -> None:
    """torchvision backend on CUDA: uint8 upload, resize + normalise on the GPU, equal to HF's
    torchvision processor run with device="cuda", bit for bit; the hash names the device."""
    for config in (QWEN25_CONFIG, QWEN3_CONFIG):
        hf, ours = _hf(config, "torchvision"), ImageProcessor.from_dict(config, "torchvision")
        for k, (h, w) in enumerate(SIZES + ODD_SIZES):
            image = _noise(h, w, seed=k)
            ref = hf(images=[image], return_tensors="pt", device="cuda")
            got = ours.preprocess(image, device="cuda")
            assert got.pixel_values.is_cuda and list(got.grid_thw) == ref["image_grid_thw"][0].tolist()
            assert torch.equal(got.pixel_values, ref["pixel_values"].to("cuda")), (h, w)
            assert got.hash != ours.preprocess(image).hash


def test_hash_is_sha256_of_documented_fields() -> None:
    ours = ImageProcessor.from_dict(QWEN25_CONFIG, "pil")
    image = _noise(56, 84)
    got = ours.preprocess(image)
    h, w = got.size
    digest = hashlib.sha256(ours.config.fingerprint() + b"|pil" + struct.pack("<7q", h, w, h, w, *got.grid_thw)
                            + np.asarray(image.resize((w, h), Image.Resampling.BICUBIC)).tobytes())
    assert got.hash == digest.hexdigest()
    if torchvision_available():  # torchvision: the uploaded pixels are the unresized ones; the device type counts
        tv = ImageProcessor.from_dict(QWEN25_CONFIG, "torchvision")
        got = tv.preprocess(image)
        digest = hashlib.sha256(tv.config.fingerprint() + b"|torchvision:cpu"
                                + struct.pack("<7q", 56, 84, h, w, *got.grid_thw) + np.asarray(image).tobytes())
        assert got.hash == digest.hexdigest()
