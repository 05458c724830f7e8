"""Qwen3-VL parity with HF transformers (float32, CPU): vision tower + DeepStack, full logits."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from tests.model_harness import cache_shape_of_layers, prefill_logits
from vlmrun.loader import iter_weights
from vlmrun.models.registry import get_model_class
from vlmrun.multimodal.mrope import compute_mrope_positions
from vlmrun.models.blocks.text_decoder import DEEPSTACK

IMG = "<|vision_start|><|image_pad|><|vision_end|>"


def _image(w: int, h: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))


@pytest.fixture(scope="module")
def ckpt(qwen3_vl_dir):
    return qwen3_vl_dir


@pytest.fixture(scope="module")
def models(ckpt):
    from transformers import AutoConfig, Qwen3VLForConditionalGeneration

    config = AutoConfig.from_pretrained(str(ckpt))
    ours = get_model_class(config.architectures)(config).eval()
    loaded = ours.load_weights(iter_weights(ckpt))
    assert loaded == {n for n, _ in ours.named_parameters()}
    hf = Qwen3VLForConditionalGeneration.from_pretrained(str(ckpt), dtype=torch.float32,
                                                         attn_implementation="eager").eval()
    return ours, hf


def _inputs(ckpt, text: str, images: list[Image.Image]) -> dict:
    from testing.tiny_models import build_hf_inputs

    return build_hf_inputs(ckpt, text, images)


def _our_logits(model, batch: list[dict]) -> torch.Tensor:
    """Prefill every prompt of `batch` (HF-style input dicts) in one batched call."""
    seqs, positions, masks, embeds, deepstack = [], [], [], [], []
    for inp in batch:
        ids = inp["input_ids"][0]
        grids = [tuple(g) for g in inp.get("image_grid_thw", torch.zeros(0, 3)).tolist()]
        pos, _ = compute_mrope_positions(ids.tolist(), grids, model.config)
        seqs.append(ids)
        positions.append(pos)
        masks.append(ids == model.config.image_token_id)
        if grids:
            with torch.no_grad():
                vis = model.encode_images(inp["pixel_values"], inp["image_grid_thw"])
            embeds.append(vis.embeds)
            deepstack.append(vis.extras.get(DEEPSTACK))
    mm = dict(mm_mask=torch.cat(masks), mm_embeds=torch.cat(embeds), deepstack_embeds=torch.cat(deepstack, dim=1)) \
        if embeds else {}
    return prefill_logits(model, seqs, positions, **mm)


def _rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def _hf_logits(hf, inp: dict) -> torch.Tensor:
    with torch.no_grad():
        return hf(**inp).logits[0].float()


def test_attributes(models):
    ours, hf = models
    text = hf.config.text_config
    assert cache_shape_of_layers(ours) == ours.cache_shape()  # the shape it declares is what its layers need
    assert (ours.cache_shape().num_attention_layers, ours.cache_shape().num_kv_heads, ours.cache_shape().head_dim) == (
        text.num_hidden_layers, text.num_key_value_heads, text.head_dim)
    assert ours.lm_head.in_features == text.hidden_size and ours.lm_head.out_features == text.vocab_size
    assert ours.config.image_token_id == hf.config.image_token_id


def test_vision_tower_matches_hf(models, ckpt):
    ours, hf = models
    inp = _inputs(ckpt, IMG + IMG + IMG, [_image(100, 60, 0), _image(64, 64, 1), _image(45, 170, 2)])
    pv, grid = inp["pixel_values"], inp["image_grid_thw"]
    assert len({tuple(g) for g in grid.tolist()}) == 3  # three different grids
    with torch.no_grad():
        ref = hf.model.get_image_features(pv, grid)
        vis = ours.encode_images(pv, grid)
    ref_embeds = torch.cat(ref.pooler_output)
    ref_deep = torch.stack([torch.cat(f) for f in ref.deepstack_features])
    assert vis.embeds.shape == ref_embeds.shape and vis.extras.get(DEEPSTACK).shape == ref_deep.shape
    # The patch embed is a matmul where HF runs a Conv3d: same math, another summation order, so
    # outputs differ by float32 rounding (~2e-6 relative); with HF's conv they match bit for bit.
    assert _rel_diff(vis.embeds, ref_embeds) < 1e-5
    assert _rel_diff(vis.extras.get(DEEPSTACK), ref_deep) < 1e-5


PROMPTS = {
    "text_only": ("<|im_start|>user\nWhat is in the picture? A red car.<|im_end|>\n<|im_start|>assistant\n", []),
    "one_image": (f"<|im_start|>user\n{IMG}Describe the image.<|im_end|>\n<|im_start|>assistant\n", [(100, 60)]),
    "two_images": (f"<|im_start|>user\nCompare {IMG} and{IMG}please.<|im_end|>\n<|im_start|>assistant\n",
                   [(64, 64), (45, 170)]),
    "image_first": (f"{IMG}Caption:", [(130, 70)]),
}


@pytest.mark.parametrize("name", list(PROMPTS))
def test_logits_match_hf(models, ckpt, name):
    ours, hf = models
    text, sizes = PROMPTS[name]
    inp = _inputs(ckpt, text, [_image(w, h, i) for i, (w, h) in enumerate(sizes)])
    ref = _hf_logits(hf, inp)
    # End to end (our vision tower): its float32 rounding noise (see above) grows through the
    # wide-init text layers, so this bound is relative to the logit scale (|logits| ~ 16 here).
    assert _rel_diff(_our_logits(ours, [inp]), ref) < 2e-5
    if sizes:  # text model + M-RoPE + DeepStack alone: splice HF's own image features
        ids = inp["input_ids"][0]
        with torch.no_grad():
            feats = hf.model.get_image_features(inp["pixel_values"], inp["image_grid_thw"])
        pos, _ = compute_mrope_positions(ids.tolist(), inp["image_grid_thw"].tolist(), ours.config)
        logits = prefill_logits(
            ours, [ids], [pos], mm_mask=ids == ours.config.image_token_id, mm_embeds=torch.cat(feats.pooler_output),
            deepstack_embeds=torch.stack([torch.cat(f) for f in feats.deepstack_features]))
    else:
        logits = _our_logits(ours, [inp])
    assert (logits - ref).abs().max().item() < 1e-4


def test_batched_equals_single(models, ckpt):
    ours, _ = models
    batch = [_inputs(ckpt, text, [_image(w, h, i) for i, (w, h) in enumerate(sizes)])
             for text, sizes in (PROMPTS["two_images"], PROMPTS["text_only"], PROMPTS["one_image"])]
    together = _our_logits(ours, batch)
    start = 0
    for inp in batch:
        n = inp["input_ids"].shape[1]
        # padding changes SDPA's summation order: float32 noise only (logits ~ 16)
        assert (together[start:start + n] - _our_logits(ours, [inp])).abs().max().item() < 5e-5
        start += n


def test_load_hub_layout(models, ckpt):
    """Checkpoints laid out as `model.*` (text) + `visual.*` load into the same parameters."""
    ours, _ = models

    def hub_names():
        for name, t in iter_weights(ckpt):
            name = name.replace("model.language_model.", "model.", 1).replace("model.visual.", "visual.", 1)
            yield name, t

    other = type(ours)(ours.config).eval()
    assert other.load_weights(hub_names()) == {n for n, _ in other.named_parameters()}
    for (n, a), (_, b) in zip(ours.named_parameters(), other.named_parameters()):
        assert torch.equal(a, b), n
