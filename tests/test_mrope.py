"""compute_mrope_positions against HF's get_rope_index (transformers 5.23) for Qwen2.5-VL and Qwen3-VL."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from vlmrun.multimodal.mrope import compute_mrope_positions


def _hf_pair(arch: str):
    """(config, hf get_rope_index bound to a stand-in that holds only the config)."""
    if arch == "qwen3_vl":
        from transformers import Qwen3VLConfig as Config
        from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLModel as Model
    else:
        from transformers import Qwen2_5_VLConfig as Config
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLModel as Model
    config = Config(vision_config={"spatial_merge_size": 2})
    stub = SimpleNamespace(config=config)
    stub.get_vision_position_ids = lambda *a, **k: Model.get_vision_position_ids(stub, *a, **k)
    return config, lambda *a, **k: Model.get_rope_index(stub, *a, **k)


def _prompt(config, layout: list, seed: int) -> tuple[list[int], list[tuple[int, int, int]]]:
    """layout items: int n = n text tokens; (t, h, w) = an image block <vs> pads <ve>."""
    rng = random.Random(seed)
    ids, grids = [], []
    for item in layout:
        if isinstance(item, int):
            ids += [rng.randrange(1000) for _ in range(item)]
        else:
            t, h, w = item
            ids += [config.vision_start_token_id] + [config.image_token_id] * (t * h * w // 4)
            ids += [config.vision_end_token_id]
            grids.append(item)
    return ids, grids


LAYOUTS = {
    "text_only": [23],
    "one_image": [5, (1, 4, 6), 7],
    "several_grids": [3, (1, 8, 4), 2, (1, 2, 2), 4, (1, 6, 10), 5],
    "image_at_start": [(1, 10, 4), 6],
    "image_at_end": [4, (1, 4, 4)],
    "only_images": [(1, 2, 6), (1, 4, 2)],
}


@pytest.mark.parametrize("arch", ["qwen2_5_vl", "qwen3_vl"])
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_matches_hf_get_rope_index(arch, name):
    config, get_rope_index = _hf_pair(arch)
    ids, grids = _prompt(config, LAYOUTS[name], seed=len(name))
    positions, delta = compute_mrope_positions(ids, grids, config)
    assert positions.dtype == torch.int64 and positions.shape == (3, len(ids))
    if not grids:  # HF leaves text-only prompts to plain 1-D positions
        assert torch.equal(positions, torch.arange(len(ids)).expand(3, -1)) and delta == 0
        return
    input_ids = torch.tensor([ids])
    ref_pos, ref_delta = get_rope_index(
        input_ids, mm_token_type_ids=(input_ids == config.image_token_id).int(),
        image_grid_thw=torch.tensor(grids), attention_mask=torch.ones_like(input_ids))
    assert torch.equal(positions, ref_pos[:, 0])
    assert delta == int(ref_delta[0, 0])


def test_generated_positions_continue_after_delta():
    config, _ = _hf_pair("qwen3_vl")
    ids, grids = _prompt(config, [2, (1, 6, 8), 3], seed=0)
    positions, delta = compute_mrope_positions(ids, grids, config)
    # the first generated token (index L) comes right after the largest prompt position
    assert len(ids) + delta == int(positions.max()) + 1
    assert delta < 0  # a 3x4 merged image spans 12 tokens but only max(3, 4) positions


def test_mismatched_images_raise():
    config, _ = _hf_pair("qwen3_vl")
    ids, grids = _prompt(config, [2, (1, 4, 4), 3], seed=0)
    with pytest.raises(ValueError):
        compute_mrope_positions(ids, [(1, 4, 6)], config)  # grid needs more tokens than present
    with pytest.raises(ValueError):
        compute_mrope_positions(ids, grids + [(1, 2, 2)], config)  # more grids than images
    with pytest.raises(ValueError):
        compute_mrope_positions(ids, [], config)  # image tokens but no grids


@pytest.mark.parametrize("arch", ["qwen2_5_vl", "qwen3_vl"])
def test_rotary_tables_match_hf(arch):
    """Sectioned (Qwen2.5-VL) and interleaved (Qwen3-VL) M-RoPE cos/sin equal HF's rotary modules."""
    from vlmrun.layers.rotary import MRotaryEmbedding

    if arch == "qwen3_vl":
        from transformers import Qwen3VLTextConfig as Config
        from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextRotaryEmbedding as Rotary
        kw = dict(hidden_size=256, num_attention_heads=2, head_dim=128, rope_parameters={
            "rope_type": "default", "rope_theta": 5e6, "mrope_section": [24, 20, 20], "mrope_interleaved": True})
    else:
        from transformers import Qwen2_5_VLTextConfig as Config
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLRotaryEmbedding as Rotary
        kw = dict(hidden_size=256, num_attention_heads=2, rope_parameters={
            "rope_type": "default", "rope_theta": 1e6, "mrope_section": [16, 24, 24]})
    config = Config(**kw)
    pos = torch.randint(0, 5000, (3, 37))
    ref_cos, ref_sin = Rotary(config)(torch.zeros(1, dtype=torch.float32), pos[:, None, :])
    ours = MRotaryEmbedding(128, config.rope_parameters["rope_theta"], kw["rope_parameters"]["mrope_section"],
                            interleaved=arch == "qwen3_vl")
    cos, sin = ours(pos)
    assert torch.allclose(cos, ref_cos[0], atol=1e-6) and torch.allclose(sin, ref_sin[0], atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_apply_rotary_equals_hf_rotate_half(dtype):
    """The rolled one-addcmul form equals HF's `q * cos + rotate_half(q) * sin` (in float32, then cast)."""
    from transformers.models.qwen3.modeling_qwen3 import rotate_half

    from vlmrun.layers.rotary import RotaryEmbedding, apply_rotary, prepared_tables

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(37, 4, 64, generator=gen).to(dtype)
    cos, sin = RotaryEmbedding(64, 1e6)(torch.randint(0, 5000, (37,), generator=gen))
    xf = x.float()
    expected = (xf * cos[:, None] + rotate_half(xf) * sin[:, None]).to(dtype)
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(apply_rotary(x, *prepared_tables(cos, sin)), expected, atol=tol, rtol=tol)
