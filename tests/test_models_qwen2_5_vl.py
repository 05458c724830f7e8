"""Qwen2.5-VL parity with HF transformers (float32, CPU): vision tower, full logits, weight layouts."""

from __future__ import annotations

import pytest
import torch
from PIL import Image

from tests.model_harness import cache_shape_of_layers, prefill_logits
from vlmrun.loader import iter_weights
from vlmrun.models.blocks.vision_common import plan_segments
from vlmrun.models.qwen2_5_vl import Qwen2_5_VLForConditionalGeneration, build_vision_layout
from vlmrun.models.registry import get_model_class
from vlmrun.multimodal.mrope import compute_mrope_positions

PATCH_DIM = 3 * 2 * 14 * 14  # channels * temporal_patch * patch * patch of the tiny checkpoint


@pytest.fixture(scope="module")
def ckpt(qwen2_5_vl_dir):
    return qwen2_5_vl_dir


@pytest.fixture(scope="module")
def config(ckpt):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(ckpt))


@pytest.fixture(scope="module")
def models(ckpt, config):
    from transformers import Qwen2_5_VLForConditionalGeneration as HFModel

    ours = get_model_class(config.architectures)(config).eval()
    loaded = ours.load_weights(iter_weights(ckpt))
    assert loaded == {n for n, _ in ours.named_parameters()}
    hf = HFModel.from_pretrained(str(ckpt), dtype=torch.float32, attn_implementation="sdpa").eval()
    return ours, hf


def _noise_image(width: int, height: int, seed: int) -> Image.Image:
    gen = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (height, width, 3), generator=gen, dtype=torch.uint8)
    return Image.fromarray(pixels.numpy())


def _positions(input_ids: torch.Tensor, grids: torch.Tensor | None, hf) -> torch.Tensor:
    """[3, L] positions from vlmrun's compute_mrope_positions, checked against HF's get_rope_index."""
    grid_rows = [tuple(g) for g in grids.tolist()] if grids is not None else []
    positions, _ = compute_mrope_positions(input_ids.tolist(), grid_rows, hf.config)
    if grids is None:
        assert torch.equal(positions, torch.arange(len(input_ids)).expand(3, -1))
    else:
        mm_types = (input_ids == hf.config.image_token_id).to(torch.int32)[None]
        ref = hf.model.get_rope_index(input_ids[None], mm_types, image_grid_thw=grids)[0][:, 0]
        assert torch.equal(positions, ref)
    return positions


def _prefill(model, seqs, positions, mm_mask=None, mm_embeds=None) -> torch.Tensor:
    return prefill_logits(model, seqs, positions,
                          mm_mask=mm_mask, mm_embeds=mm_embeds)


def _image_prompt(ckpt, images):
    from testing.tiny_models import build_hf_inputs

    parts = ["<|im_start|>user\n"]
    for i, _ in enumerate(images):
        parts.append(f"Image {i}: <|vision_start|><|image_pad|><|vision_end|>")
    parts.append("Describe the images.<|im_end|>\n<|im_start|>assistant\n")
    return build_hf_inputs(ckpt, "".join(parts), images)


# ------------------------------------------------------------------------------------------------


def test_attributes(models, config):
    ours, _ = models
    text = config.text_config
    assert cache_shape_of_layers(ours) == ours.cache_shape()  # the shape it declares is what its layers need
    assert ours.cache_shape().num_attention_layers == text.num_hidden_layers
    assert ours.cache_shape().num_kv_heads == text.num_key_value_heads
    assert ours.cache_shape().head_dim == text.hidden_size // text.num_attention_heads
    assert ours.lm_head.in_features == text.hidden_size and ours.lm_head.out_features == text.vocab_size
    assert not ours.ties_word_embeddings and ours.lm_head.weight is not ours.language_model.embed_tokens.weight


@pytest.mark.parametrize("grids", [
    [(1, 4, 4)],  # 2x2 merged units: exactly one window
    [(1, 6, 10), (1, 4, 4), (1, 12, 6), (2, 10, 6)],  # partial edge windows, several frames
    [(1, 16, 12), (1, 2, 2)],
])
def test_window_layout_matches_hf(grids, config):
    from transformers.vision_utils import get_vision_window_index

    vc = config.vision_config
    ref_index, ref_cu = get_vision_window_index(torch.tensor(grids), vc.spatial_merge_size, vc.window_size,
                                                vc.patch_size)
    layout = build_vision_layout(grids, vc.spatial_merge_size, vc.window_size // vc.spatial_merge_size // vc.patch_size)
    assert torch.equal(layout.unit_order, ref_index)
    assert plan_segments(layout.window_lens).cu_seqlens.tolist() == ref_cu.tolist()


@pytest.mark.parametrize("grids", [
    [(1, 6, 10)],  # 3x5 merged units: partial windows on both axes
    [(1, 6, 10), (1, 4, 4), (1, 12, 6)],  # three images of different grids, one without partial windows
    [(2, 8, 6), (1, 2, 2)],  # two frames; a single-unit image
])
def test_vision_tower_matches_hf(models, grids):
    ours, hf = models
    gen = torch.Generator().manual_seed(len(grids))
    num_patches = sum(t * h * w for t, h, w in grids)
    pixels = torch.randn(num_patches, PATCH_DIM, generator=gen)
    grid_thw = torch.tensor(grids)
    with torch.no_grad():
        ref = torch.cat(hf.model.get_image_features(pixels, grid_thw).pooler_output)
        out = ours.encode_images(pixels, grid_thw)
    assert out.extras == {}
    assert out.embeds.shape == ref.shape == (num_patches // 4, ours.lm_head.in_features)
    # 1e-5 relative to the output scale: the patch embed is a matmul here and a Conv3d in HF, whose
    # float32 sums round differently (~1e-6 relative); everything after it follows HF op for op.
    scale = max(1.0, float(ref.abs().max()))
    assert (out.embeds - ref).abs().max() <= 1e-5 * scale


def test_text_only_logits_match_hf(models):
    ours, hf = models
    gen = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, 500, (n,), generator=gen) for n in (19, 7)]  # plain (non-special) tokens
    positions = [_positions(s, None, hf) for s in seqs]
    batched = _prefill(ours, seqs, positions)
    start = 0
    for s in seqs:
        with torch.no_grad():
            ref = hf(input_ids=s[None]).logits[0]
        got = batched[start:start + len(s)]
        start += len(s)
        assert (got - ref).abs().max() < 1e-4


def test_image_prompt_logits_match_hf(models, ckpt):
    ours, hf = models
    images = [_noise_image(150, 90, 1), _noise_image(56, 56, 2), _noise_image(90, 170, 3)]
    inputs = _image_prompt(ckpt, images)
    grids = inputs["image_grid_thw"]
    assert any((h // 2) % 2 or (w // 2) % 2 for _, h, w in grids.tolist())  # some images have partial windows
    with torch.no_grad():
        ref = hf(**inputs).logits[0]
        embeds = ours.encode_images(inputs["pixel_values"], grids).embeds
    ids = inputs["input_ids"][0]
    mm_mask = ids == ours.config.image_token_id
    assert int(mm_mask.sum()) == embeds.shape[0]

    positions = _positions(ids, grids, hf)
    with torch.no_grad():
        hf_embeds = torch.cat(hf.model.get_image_features(inputs["pixel_values"], grids).pooler_output)

    # text path (splice + M-RoPE + decoder) alone: HF's image features at the image-pad rows
    got = _prefill(ours, [ids], [positions], mm_mask, hf_embeds)
    assert (got - ref).abs().max() < 1e-4

    # end to end with our encode_images rows. Float32 rounding in the vision tower (~3e-6 relative,
    # mostly matmul-vs-Conv3d patch embedding) is amplified by the wide-init tiny decoder to ~3e-4
    # on logits of magnitude ~16; HF's own float32 logits are ~2e-4 off a float64 run.
    got = _prefill(ours, [ids], [positions], mm_mask, embeds)
    assert (got - ref).abs().max() < 1e-3

    # the same image prompt batched after a text-only sequence gives the same rows
    text = torch.randint(0, 500, (5,), generator=torch.Generator().manual_seed(1))
    both = _prefill(ours, [text, ids], [_positions(text, None, hf), positions],
                    torch.cat([torch.zeros(5, dtype=torch.bool), mm_mask]), embeds)
    assert (both[5:] - got).abs().max() < 1e-5


def _hub_name(name: str) -> str:
    """transformers-5 name -> original hub checkpoint name."""
    if name.startswith("model.visual."):
        return name[len("model."):]
    return name.replace("model.language_model.", "model.", 1)


@pytest.mark.parametrize("layout", ["transformers5", "hub"])
def test_both_weight_layouts_load_the_same_model(models, config, layout):
    ours, hf = models
    weights = list(hf.state_dict().items())  # transformers-5 names: model.language_model.*, model.visual.*
    assert any(n.startswith("model.language_model.") for n, _ in weights)
    if layout == "hub":
        weights = [(_hub_name(n), t) for n, t in weights]
        assert any(n.startswith("model.layers.") for n, _ in weights)
        assert any(n.startswith("visual.") for n, _ in weights)
    other = Qwen2_5_VLForConditionalGeneration(config).eval()
    loaded = other.load_weights(weights)
    assert loaded == {n for n, _ in other.named_parameters()}
    ref_params = dict(ours.named_parameters())
    for name, param in other.named_parameters():
        assert torch.equal(param, ref_params[name]), name
    ids = torch.randint(0, 500, (9,), generator=torch.Generator().manual_seed(2))
    pos = [torch.arange(9).expand(3, -1)]
    assert torch.equal(_prefill(other, [ids], pos), _prefill(ours, [ids], pos))


def test_missing_or_mismatched_weight_raises(config, ckpt):
    weights = list(iter_weights(ckpt))
    victim = next(n for n, _ in weights if n.endswith("visual.blocks.0.attn.qkv.weight"))
    model = Qwen2_5_VLForConditionalGeneration(config)
    with pytest.raises(ValueError, match=r"visual\.blocks\.0\.attn\.qkv\.weight"):
        model.load_weights([(n, t) for n, t in weights if n != victim])
    bad = [(n, t[:-1] if n == "lm_head.weight" else t) for n, t in weights]
    with pytest.raises(ValueError, match=r"lm_head\.weight"):
        model.load_weights(bad)


@pytest.mark.parametrize("where", ["top", "text_config"])
def test_tied_embeddings(config, ckpt, where):
    import copy

    cfg = copy.deepcopy(config)
    if where == "top":
        cfg.tie_word_embeddings = True
    else:  # pre-v5 checkpoints set the flag inside text_config; the config class forwards it on load
        data = cfg.to_dict()
        data["text_config"]["tie_word_embeddings"] = True
        cfg = type(cfg).from_dict(data)
    model = Qwen2_5_VLForConditionalGeneration(cfg)
    assert model.lm_head.weight is model.language_model.embed_tokens.weight
    weights = [(n, t) for n, t in iter_weights(ckpt) if n != "lm_head.weight"]
    model.load_weights(weights)
    embed = next(t for n, t in weights if n.endswith("embed_tokens.weight"))
    hidden = torch.randn(3, model.lm_head.in_features)
    torch.testing.assert_close(model.compute_logits(hidden), hidden @ embed.t())


def test_planned_segments_attend_within_themselves():
    """`plan_segments` + the reference varlen kernel equal one SDPA per segment (mixed lengths,
    repeated lengths batched together, an empty segment skipped)."""
    import torch.nn.functional as F

    from vlmrun.models.blocks.vision_common import varlen_attention

    lengths = [4, 9, 0, 4, 16, 9]
    segments = plan_segments(lengths)
    assert segments.max_len == 16 and segments.cu_seqlens.tolist() == [0, 4, 13, 13, 17, 33, 42]
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(sum(lengths), 2, 8, generator=gen) for _ in range(3))
    expected, start = torch.empty_like(q), 0
    for n in lengths:
        rows = slice(start, start + n)
        expected[rows] = F.scaled_dot_product_attention(*(x[rows].transpose(0, 1) for x in (q, k, v))).transpose(0, 1)
        start += n
    torch.testing.assert_close(varlen_attention(q, k, v, segments), expected)
