"""Checks on the tiny random checkpoints and tokenizer that the rest of the test suite builds on."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoImageProcessor, AutoModelForCausalLM, AutoModelForImageTextToText, AutoTokenizer

from testing.tiny_models import (
    IMAGE_PAD,
    SPECIAL_TOKENS,
    build_hf_inputs,
    build_tiny_checkpoint,
    greedy_margins,
    special_ids,
)

VL_ARCHS = ["qwen2_5_vl", "qwen3_vl"]
ALL_ARCHS = ["qwen3", *VL_ARCHS]


@pytest.fixture
def ckpt(request: pytest.FixtureRequest) -> Path:
    """The session checkpoint dir for the arch named by the test's parameter."""
    return request.getfixturevalue(f"{request.param}_dir")


def _load(model_dir: Path) -> torch.nn.Module:
    config = AutoConfig.from_pretrained(model_dir)
    cls = AutoModelForImageTextToText if hasattr(config, "vision_config") else AutoModelForCausalLM
    return cls.from_pretrained(model_dir, dtype=torch.float32).eval()


def _prompt(tokenizer, with_image: bool, text: str = "Describe the picture.") -> str:
    content = [{"type": "image"}, {"type": "text", "text": text}] if with_image else text
    messages = [{"role": "user", "content": content}]
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


# ---------------------------------------------------------------------------------- tokenizer


TEXTS = [
    "A red cat is sitting on the left.",
    "The café serves a naïve crème brûlée at 7:30.",
    "日本語のテキスト and emoji 😀🐱 mixed in.",
    "  leading spaces, tabs\tand\nnew lines\n\n",
    "Numbers 0123456789 and symbols #@$%^&*()[]{}<>",
]


def test_tokenizer_loads_like_qwen(tiny_tokenizer_dir: Path) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    assert 400 <= len(tok) <= 1000
    assert tok.eos_token == "<|im_end|>"
    assert tok.pad_token == "<|endoftext|>"
    assert tok.bos_token is None
    ids = tok("hello world")["input_ids"]
    assert tok.convert_ids_to_tokens(ids[0]) not in SPECIAL_TOKENS  # no BOS added
    assert (tiny_tokenizer_dir / "chat_template.jinja").is_file()


@pytest.mark.parametrize("text", TEXTS)
def test_tokenizer_round_trips(tiny_tokenizer_dir: Path, text: str) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text


def test_multibyte_characters_split_across_tokens(tiny_tokenizer_dir: Path) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    ids = tok.encode("😀", add_special_tokens=False)
    assert len(ids) > 1
    pieces = [tok.decode([i]) for i in ids]
    assert any("\ufffd" in p for p in pieces)  # a lone token is not valid UTF-8 on its own


def test_tokenizer_is_deterministic(tmp_path: Path, tiny_tokenizer_dir: Path) -> None:
    from testing.tiny_models import build_tiny_tokenizer

    build_tiny_tokenizer(tmp_path)
    first = json.loads((tiny_tokenizer_dir / "tokenizer.json").read_text())
    second = json.loads((tmp_path / "tokenizer.json").read_text())
    assert first["model"] == second["model"]
    assert first["added_tokens"] == second["added_tokens"]


def test_special_tokens_are_single_tokens(tiny_tokenizer_dir: Path) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    for token in SPECIAL_TOKENS:
        ids = tok.encode(f"a{token}b", add_special_tokens=False)
        assert tok.convert_tokens_to_ids(token) in ids
        assert len(tok.encode(token, add_special_tokens=False)) == 1


def test_chat_template(tiny_tokenizer_dir: Path) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    messages = [
        {"role": "system", "content": "Be brief."},
        {
            "role": "user",
            "content": [
                {"type": "image"},
                {"type": "text", "text": "What is this?"},
                {"type": "image_url", "image_url": {"url": "x.png"}},
            ],
        },
        {"role": "assistant", "content": "A cat."},
        {"role": "user", "content": "And now?"},
    ]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    vision = "<|vision_start|><|image_pad|><|vision_end|>"
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        f"<|im_start|>user\n{vision}What is this?{vision}<|im_end|>\n"
        "<|im_start|>assistant\nA cat.<|im_end|>\n"
        "<|im_start|>user\nAnd now?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    no_prompt = tok.apply_chat_template(messages[-1:], tokenize=False, add_generation_prompt=False)
    assert no_prompt == "<|im_start|>user\nAnd now?<|im_end|>\n"


# ---------------------------------------------------------------------------------- checkpoints


@pytest.mark.parametrize("ckpt", ALL_ARCHS, indirect=True)
def test_checkpoint_is_sharded_and_small(ckpt: Path) -> None:
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) >= 3
    assert sorted(p.name for p in ckpt.glob("*.safetensors")) == shards
    total = sum((ckpt / s).stat().st_size for s in shards)
    assert total < 2 * 1024 * 1024
    with safe_open(ckpt / shards[0], framework="pt") as f:
        name = next(iter(f.keys()))
        assert f.get_tensor(name).dtype == torch.float32
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        assert (ckpt / name).is_file()


@pytest.mark.parametrize("ckpt", ALL_ARCHS, indirect=True)
def test_config_token_ids_match_tokenizer(ckpt: Path) -> None:
    tok = AutoTokenizer.from_pretrained(ckpt)
    ids = special_ids(tok)
    config = AutoConfig.from_pretrained(ckpt)
    text_config = config.get_text_config()
    assert text_config.vocab_size >= len(tok)
    assert text_config.pad_token_id == ids.endoftext
    gen = json.loads((ckpt / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [ids.im_end, ids.endoftext]
    if hasattr(config, "vision_config"):
        assert config.image_token_id == ids.image_pad
        assert config.video_token_id == ids.video_pad
        assert config.vision_start_token_id == ids.vision_start
        assert config.vision_end_token_id == ids.vision_end


def test_config_shapes(qwen3_dir: Path, qwen2_5_vl_dir: Path, qwen3_vl_dir: Path) -> None:
    q3 = AutoConfig.from_pretrained(qwen3_dir)
    assert q3.tie_word_embeddings is True and q3.head_dim == 16 and q3.num_key_value_heads == 2
    q25 = AutoConfig.from_pretrained(qwen2_5_vl_dir)
    assert q25.tie_word_embeddings is False
    assert q25.text_config.rope_parameters["mrope_section"] == [2, 3, 3]
    assert q25.vision_config.window_size == 56 and q25.vision_config.fullatt_block_indexes == [1]
    q3vl = AutoConfig.from_pretrained(qwen3_vl_dir)
    assert q3vl.tie_word_embeddings is False
    rope = q3vl.text_config.rope_parameters
    assert rope["mrope_section"] == [4, 2, 2] and rope["mrope_interleaved"] is True
    assert q3vl.vision_config.deepstack_visual_indexes == [0, 1]
    assert int(q3vl.vision_config.num_position_embeddings**0.5) ** 2 == q3vl.vision_config.num_position_embeddings


@pytest.mark.parametrize(
    ("ckpt", "patch", "mean"),
    [("qwen2_5_vl", 14, 0.48145466), ("qwen3_vl", 16, 0.5)],
    indirect=["ckpt"],
)
def test_preprocessor_config(ckpt: Path, patch: int, mean: float) -> None:
    raw = json.loads((ckpt / "preprocessor_config.json").read_text())
    factor = patch * 2
    assert raw["patch_size"] == patch and raw["merge_size"] == 2 and raw["temporal_patch_size"] == 2
    assert raw["size"] == {"shortest_edge": 4 * factor * factor, "longest_edge": 64 * factor * factor}
    assert raw["image_mean"][0] == pytest.approx(mean)
    proc = AutoImageProcessor.from_pretrained(ckpt)
    assert proc.patch_size == patch


def test_build_is_deterministic(tmp_path: Path, qwen3_dir: Path) -> None:
    other = build_tiny_checkpoint("qwen3", tmp_path / "again", seed=0)
    index = json.loads((qwen3_dir / "model.safetensors.index.json").read_text())
    for name, shard in index["weight_map"].items():
        with safe_open(qwen3_dir / shard, framework="pt") as a, safe_open(other / shard, framework="pt") as b:
            assert torch.equal(a.get_tensor(name), b.get_tensor(name)), name


def test_qwen3_forward_tied_and_margins(qwen3_dir: Path) -> None:
    model = _load(qwen3_dir)
    assert model.lm_head.weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()
    tok = AutoTokenizer.from_pretrained(qwen3_dir)
    inputs = build_hf_inputs(qwen3_dir, _prompt(tok, with_image=False))
    tokens, margins = greedy_margins(model, inputs, steps=20)
    assert min(margins) > 1e-4
    assert len(set(tokens)) > 3


@pytest.mark.parametrize("ckpt", VL_ARCHS, indirect=True)
def test_vl_forward_with_images(ckpt: Path, sample_images: list) -> None:
    model = _load(ckpt)
    assert model.lm_head.weight.data_ptr() != model.get_input_embeddings().weight.data_ptr()
    tok = AutoTokenizer.from_pretrained(ckpt)
    image_id = tok.convert_tokens_to_ids(IMAGE_PAD)
    for image in sample_images:
        inputs = build_hf_inputs(ckpt, _prompt(tok, with_image=True), [image])
        grid = inputs["image_grid_thw"][0]
        n_image_tokens = int((inputs["input_ids"] == image_id).sum())
        assert n_image_tokens == int(grid.prod()) // 4
        assert 4 <= n_image_tokens <= 64
        assert inputs["pixel_values"].shape[0] == int(grid.prod())
        with torch.no_grad():
            logits = model(**inputs).logits
        assert logits.shape[:2] == inputs["input_ids"].shape
        assert torch.isfinite(logits).all()


@pytest.mark.parametrize("ckpt", VL_ARCHS, indirect=True)
def test_vl_greedy_margins(ckpt: Path, sample_images: list) -> None:
    model = _load(ckpt)
    tok = AutoTokenizer.from_pretrained(ckpt)
    inputs = build_hf_inputs(ckpt, _prompt(tok, with_image=True), [sample_images[3]])
    tokens, margins = greedy_margins(model, inputs, steps=20)
    assert min(margins) > 1e-4
    assert len(set(tokens)) > 3


def test_window_attention_is_exercised(qwen2_5_vl_dir: Path, sample_images: list) -> None:
    inputs = build_hf_inputs(qwen2_5_vl_dir, f"<|vision_start|>{IMAGE_PAD}<|vision_end|>", [sample_images[3]])
    _, grid_h, grid_w = inputs["image_grid_thw"][0].tolist()
    window_patches = 56 // 14  # window_size / patch_size
    assert grid_h > window_patches and grid_w > window_patches
