"""Qwen3.5, Qwen3.5-MoE, Qwen3-Next and Qwen3-VL-MoE parity with HF transformers (float32, CPU), model level.

The hybrid models' GDN layers run on the engine's reference backends (`HybridAttnBackend` over
`TorchAttnBackend` + `TorchGDNBackend` with a `GDNPool`), outside the engine: each call prefills fresh
sequences, batched. Checked here: attributes the runner reads, vision towers, the MoE block (routing
and both expert weight layouts), full logits for text and image prompts (including prompts longer
than three 64-token GDN chunks), batched vs single, and weight loading (layouts, clear errors).
"""

from __future__ import annotations

import re
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image

from tests.model_harness import cache_shape_of_layers
from vlmrun.cache.gdn_pool import GDNPool
from vlmrun.cache.kv_pool import KVPool, ReqToTokenPool
from vlmrun.config import CacheShape
from vlmrun.forward_batch import ForwardBatch, ForwardMode
from vlmrun.layers.attention import Attention, GDNAttention
from vlmrun.layers.attention.torch_gdn_backend import TorchGDNBackend
from vlmrun.layers.attention.hybrid_backend import HybridAttnBackend
from vlmrun.layers.attention.torch_backend import TorchAttnBackend
from vlmrun.layers.moe import SparseMoeBlock
from vlmrun.loader import iter_weights
from vlmrun.models.weights import load_checkpoint
from vlmrun.models.registry import get_model_class
from vlmrun.multimodal.mrope import compute_mrope_positions
from vlmrun.models.blocks.text_decoder import DEEPSTACK
from testing.tiny_models import build_hf_inputs

IMG = "<|vision_start|><|image_pad|><|vision_end|>"
HYBRID = ["qwen3_5", "qwen3_5_moe", "qwen3_next"]
VL = ["qwen3_5", "qwen3_5_moe", "qwen3_vl_moe"]
ARCHS = ["qwen3_5", "qwen3_5_moe", "qwen3_next", "qwen3_vl_moe"]


# ---------------------------------------------------------------------------------------------
# Harness: prefill fresh sequences through the model with the engine's reference backends
# ---------------------------------------------------------------------------------------------


def prefill_logits(model, sequences: list[torch.Tensor], positions: list[torch.Tensor], *,
                   mm_mask: torch.Tensor | None = None, mm_embeds: torch.Tensor | None = None,
                   deepstack_embeds: torch.Tensor | None = None) -> torch.Tensor:
    """sequences[i]: [L_i] ids; positions[i]: [3, L_i]. One batched prefill -> logits [sum L_i, vocab]."""
    cpu = torch.device("cpu")
    lens = [int(s.shape[0]) for s in sequences]
    total = sum(lens)
    kv_pool = KVPool(model.cache_shape().num_attention_layers, total + 1, model.cache_shape().num_kv_heads, model.cache_shape().head_dim, torch.float32, cpu)
    req_pool = ReqToTokenPool(len(sequences), max(lens), cpu)
    slots = torch.arange(1, total + 1)  # KV slot 0 is the dummy
    start = 0
    for i, n in enumerate(lens):
        req_pool.req_to_token[i, :n] = slots[start:start + n]
        start += n
    backend = TorchAttnBackend(kv_pool, req_pool)
    if model.cache_shape().is_hybrid:
        gdn_pool = GDNPool(model.cache_shape().num_gdn_layers, len(sequences) + 1, model.cache_shape().gdn_conv_dim, model.cache_shape().gdn_conv_kernel,
                           model.cache_shape().gdn_num_v_heads, model.cache_shape().gdn_head_v_dim, model.cache_shape().gdn_head_k_dim, torch.float32,
                           torch.float32, cpu)
        backend = HybridAttnBackend(backend, TorchGDNBackend(gdn_pool))
    fb = ForwardBatch(
        mode=ForwardMode.EXTEND,
        input_ids=torch.cat(sequences),
        positions=torch.cat(positions, dim=1),
        req_pool_indices=torch.arange(len(sequences)),
        seq_lens=torch.tensor(lens),
        extend_prefix_lens=torch.zeros(len(sequences), dtype=torch.int64),
        extend_seq_lens=torch.tensor(lens),
        out_cache_loc=slots,
        seq_lens_cpu=lens,
        extend_prefix_lens_cpu=[0] * len(lens),
        extend_seq_lens_cpu=lens,
        logits_indices=torch.arange(total),
        attn_backend=backend,
        mm_mask=mm_mask,
        mm_embeds=mm_embeds,
        mm_extras=None if deepstack_embeds is None else {DEEPSTACK: deepstack_embeds},
        state_slots=torch.arange(1, len(sequences) + 1),  # GDN slot 0 is the dummy
    )
    backend.prepare(fb)
    with torch.no_grad():
        return model.compute_logits(model(fb.input_ids, fb.positions, fb))


def _image(w: int, h: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))


def _our_logits(model, batch: list[dict], hf_features=None) -> torch.Tensor:
    """Prefill every prompt of `batch` (HF input dicts); image features from our tower unless given."""
    seqs, positions, masks, embeds, deepstack = [], [], [], [], []
    for inp in batch:
        ids = inp["input_ids"][0]
        grids = [tuple(g) for g in inp.get("image_grid_thw", torch.zeros(0, 3)).tolist()]
        items = [SimpleNamespace(grid_thw=g, second_per_grid_t=None) for g in grids]
        pos, _ = type(model).prompt_positions(model.config)(ids.tolist(), items)  # the family's: 1-D or M-RoPE
        seqs.append(ids)
        positions.append(pos)
        if grids:
            masks.append(ids == model.config.image_token_id)
            if hf_features is not None:
                e, d = hf_features
            else:
                with torch.no_grad():
                    vis = model.encode_images(inp["pixel_values"], inp["image_grid_thw"])
                e, d = vis.embeds, vis.extras.get(DEEPSTACK)
            embeds.append(e)
            if d is not None:
                deepstack.append(d)
        else:
            masks.append(torch.zeros_like(ids, dtype=torch.bool))
    mm = {}
    if embeds:
        mm = dict(mm_mask=torch.cat(masks), mm_embeds=torch.cat(embeds),
                  deepstack_embeds=torch.cat(deepstack, dim=1) if deepstack else None)
    return prefill_logits(model, seqs, positions, **mm)


def _hf_logits(hf, inp: dict) -> torch.Tensor:
    with torch.no_grad():
        return hf(**inp).logits[0].float()


def _rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


# ---------------------------------------------------------------------------------------------
# Fixtures
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module", params=ARCHS)
def arch(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def loaded(request):
    """arch -> (checkpoint dir, our model, HF model), built once per module."""
    cache: dict = {}

    def get(name: str):
        if name not in cache:
            from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

            ckpt = request.getfixturevalue(f"{name}_dir")
            config = AutoConfig.from_pretrained(str(ckpt))
            ours = get_model_class(config.architectures)(config).eval()
            assert ours.load_weights(iter_weights(ckpt)) == {n for n, _ in ours.named_parameters()}
            cls = AutoModelForImageTextToText if name in VL else AutoModelForCausalLM
            hf = cls.from_pretrained(str(ckpt), dtype=torch.float32, attn_implementation="eager").eval()
            cache[name] = (ckpt, ours, hf)
        return cache[name]

    return get


# ---------------------------------------------------------------------------------------------
# Attributes and layer ids
# ---------------------------------------------------------------------------------------------


def test_attributes(loaded, arch):
    _, ours, hf = loaded(arch)
    text = hf.config.get_text_config()
    assert ours.lm_head.in_features == text.hidden_size and ours.lm_head.out_features == text.vocab_size
    assert ours.cache_shape().num_kv_heads == text.num_key_value_heads and ours.cache_shape().head_dim == text.head_dim
    # the runner's view of the caches equals what the HF config describes
    assert cache_shape_of_layers(ours) == ours.cache_shape() == CacheShape.from_hf_config(hf.config)
    if arch in HYBRID:
        types = text.layer_types
        assert ours.cache_shape().num_attention_layers == types.count("full_attention") > 0
        assert ours.cache_shape().num_gdn_layers == types.count("linear_attention") > 0
        assert ours.cache_shape().gdn_conv_dim == 2 * text.linear_num_key_heads * text.linear_key_head_dim \
            + text.linear_num_value_heads * text.linear_value_head_dim
        assert (ours.cache_shape().gdn_conv_kernel, ours.cache_shape().gdn_num_v_heads, ours.cache_shape().gdn_head_v_dim, ours.cache_shape().gdn_head_k_dim) == (
            text.linear_conv_kernel_dim, text.linear_num_value_heads, text.linear_value_head_dim,
            text.linear_key_head_dim)
    else:
        assert ours.cache_shape().num_attention_layers == text.num_hidden_layers


def test_layer_ids_follow_layer_order(loaded, arch):
    """Full-attention layers index the KV pool 0..n-1, GDN layers the GDN pool 0..m-1, in layer order."""
    _, ours, _ = loaded(arch)
    full = [m.layer_id for m in ours.modules() if isinstance(m, Attention)]
    gdn_layers = [m.layer_id for m in ours.modules() if isinstance(m, GDNAttention)]
    assert full == list(range(ours.cache_shape().num_attention_layers))
    assert gdn_layers == list(range(ours.cache_shape().num_gdn_layers))


def test_tiny_checkpoints_have_clear_greedy_margins(loaded, arch):
    """The wide-spread init keeps top-1 / top-2 logit gaps far above float32 noise at every position."""
    ckpt, _, hf = loaded(arch)
    images = [_image(120, 90, 0)] if arch in VL else []
    text = f"<|im_start|>user\n{IMG if images else ''}Describe the picture.<|im_end|>\n<|im_start|>assistant\n"
    top2 = _hf_logits(hf, build_hf_inputs(ckpt, text, images)).topk(2, dim=-1).values  # [L, 2]
    assert (top2[:, 0] - top2[:, 1]).min().item() > 1e-3
    assert top2[:, 0].abs().max().item() > 5  # logits spread wide, not flat


# ---------------------------------------------------------------------------------------------
# Vision towers
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", VL)
def test_vision_tower_matches_hf(loaded, name):
    ckpt, ours, hf = loaded(name)
    inp = build_hf_inputs(ckpt, IMG * 3, [_image(100, 60, 0), _image(64, 64, 1), _image(45, 170, 2)])
    pv, grid = inp["pixel_values"], inp["image_grid_thw"]
    with torch.no_grad():
        ref = hf.model.get_image_features(pv, grid)
        vis = ours.encode_images(pv, grid)
    ref_embeds = torch.cat(ref.pooler_output)
    assert vis.embeds.shape == ref_embeds.shape
    assert _rel_diff(vis.embeds, ref_embeds) < 1e-5
    if name == "qwen3_vl_moe":
        ref_deep = torch.stack([torch.cat(f) for f in ref.deepstack_features])
        assert vis.extras.get(DEEPSTACK).shape == ref_deep.shape and _rel_diff(vis.extras.get(DEEPSTACK), ref_deep) < 1e-5
    else:  # Qwen3.5 has no DeepStack
        assert vis.extras.get(DEEPSTACK) is None and not ours.visual.deepstack_visual_indexes


@pytest.mark.parametrize("name", VL)
def test_mrope_positions_match_hf(loaded, name):
    """Qwen3.5's get_rope_index equals Qwen3-VL's for images: vlmrun's positions and delta match HF's."""
    ckpt, ours, hf = loaded(name)
    inp = build_hf_inputs(ckpt, f"Compare {IMG} and{IMG}please, then {IMG}.",
                          [_image(64, 64, 0), _image(45, 170, 1), _image(250, 61, 2)])
    ref, ref_delta = hf.model.get_rope_index(inp["input_ids"], inp["mm_token_type_ids"], inp["image_grid_thw"])
    pos, delta = compute_mrope_positions(inp["input_ids"][0].tolist(), inp["image_grid_thw"].tolist(), ours.config)
    assert torch.equal(pos, ref[:, 0]) and delta == int(ref_delta)


# ---------------------------------------------------------------------------------------------
# MoE block
# ---------------------------------------------------------------------------------------------


def _hf_moe_block(kind: str, norm_topk_prob: bool = True):
    dims = dict(hidden_size=64, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24)
    if kind == "qwen3_next":
        from transformers import Qwen3NextConfig
        from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextSparseMoeBlock

        cfg = Qwen3NextConfig(**dims, shared_expert_intermediate_size=48, norm_topk_prob=norm_topk_prob)
        block = Qwen3NextSparseMoeBlock(cfg)
        ours = SparseMoeBlock(64, 24, 4, 2, norm_topk_prob=norm_topk_prob, shared_intermediate=48)
    elif kind == "qwen3_5_moe":
        from transformers import Qwen3_5MoeTextConfig
        from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeSparseMoeBlock

        block = Qwen3_5MoeSparseMoeBlock(Qwen3_5MoeTextConfig(**dims, shared_expert_intermediate_size=48))
        ours = SparseMoeBlock(64, 24, 4, 2, norm_topk_prob=True, shared_intermediate=48)
    else:
        from transformers import Qwen3VLMoeTextConfig
        from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import Qwen3VLMoeTextSparseMoeBlock

        block = Qwen3VLMoeTextSparseMoeBlock(Qwen3VLMoeTextConfig(**dims))
        ours = SparseMoeBlock(64, 24, 4, 2, norm_topk_prob=True)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
    return block.eval(), ours.eval()


@pytest.mark.parametrize(("kind", "norm"), [("qwen3_next", True), ("qwen3_next", False), ("qwen3_5_moe", True),
                                            ("qwen3_vl_moe", True)])
def test_moe_block_matches_hf(kind, norm):
    block, ours = _hf_moe_block(kind, norm)
    load_checkpoint(ours, block.state_dict().items(), lambda n: n)
    x = torch.randn(37, 64, generator=torch.Generator().manual_seed(1)) * 2
    with torch.no_grad():
        ref = block(x[None])
        ref = (ref[0] if isinstance(ref, tuple) else ref)[0]
        out = ours(x)
    assert (out - ref).abs().max().item() < 1e-5 * ref.abs().max().item()
    # every expert is used somewhere, so the loop and its empty-expert skip are both exercised
    _, ids = ours.route(x)
    assert set(ids.flatten().tolist()) == {0, 1, 2, 3}
    _, ids = ours.route(x[:1])
    assert len(set(ids.flatten().tolist())) == 2


def _per_expert(state: dict[str, torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
    """Fused expert tensors -> hub-style per-expert tensors (gate rows first in gate_up_proj)."""
    out = []
    for name, t in state.items():
        if name.endswith("experts.gate_up_proj"):
            base = name[: -len("gate_up_proj")]
            for e, w in enumerate(t):
                gate, up = w.chunk(2, dim=0)
                out += [(f"{base}{e}.gate_proj.weight", gate), (f"{base}{e}.up_proj.weight", up)]
        elif name.endswith("experts.down_proj"):
            base = name[: -len("down_proj")]
            out += [(f"{base}{e}.down_proj.weight", w) for e, w in enumerate(t)]
        else:
            out.append((name, t))
    return out


def test_moe_expert_layouts_load_the_same():
    block, ref = _hf_moe_block("qwen3_next")
    state = block.state_dict()
    load_checkpoint(ref, state.items(), lambda n: n)
    layouts = {
        "per_expert": _per_expert(state),
        "fused_transposed": [(n, t.transpose(1, 2).contiguous() if "experts." in n else t) for n, t in state.items()],
    }
    for label, weights in layouts.items():
        other = _hf_moe_block("qwen3_next")[1]
        assert load_checkpoint(other, weights, lambda n: n) == {n for n, _ in other.named_parameters()}, label
        for (n, a), (_, b) in zip(ref.named_parameters(), other.named_parameters()):
            assert torch.equal(a, b), f"{label}: {n}"


def test_moe_loading_errors_name_the_weight():
    block, ours = _hf_moe_block("qwen3_5_moe")
    per_expert = _per_expert(block.state_dict())
    missing = [(n, t) for n, t in per_expert if n != "experts.3.up_proj.weight"]
    with pytest.raises(ValueError, match=re.escape("experts.gate_up_proj") + ".*experts.3.up_proj"):
        load_checkpoint(ours, missing, lambda n: n)
    bad = [(n, t[:, :-1] if n == "experts.1.down_proj.weight" else t) for n, t in per_expert]
    with pytest.raises(ValueError, match=re.escape("experts.1.down_proj.weight")):
        load_checkpoint(ours, bad, lambda n: n)
    bad_fused = [(n, t[:, :-1] if n == "experts.gate_up_proj" else t) for n, t in block.state_dict().items()]
    with pytest.raises(ValueError, match="shape mismatch for experts.gate_up_proj"):
        load_checkpoint(ours, bad_fused, lambda n: n)


# ---------------------------------------------------------------------------------------------
# Full logits
# ---------------------------------------------------------------------------------------------

LONG_TEXT = " ".join(f"Item {i}: a {c} {o} sits {p}." for i, (c, o, p) in enumerate(
    [("red", "cup", "on the table"), ("blue", "car", "near the door"), ("green", "tree", "in the park"),
     ("small", "dog", "under a chair"), ("old", "clock", "on the wall")] * 2))

PROMPTS = {
    "text_only": ("<|im_start|>user\nWhat is in the picture? A red car.<|im_end|>\n<|im_start|>assistant\n", []),
    "one_image": (f"<|im_start|>user\n{IMG}Describe the image.<|im_end|>\n<|im_start|>assistant\n", [(100, 60)]),
    "two_images": (f"<|im_start|>user\nCompare {IMG} and{IMG}please.<|im_end|>\n<|im_start|>assistant\n",
                   [(64, 64), (45, 170)]),
    "image_first": (f"{IMG}Caption:", [(130, 70)]),
    # over three 64-token GDN chunks; the image sits across the first chunk boundary
    "long_with_image": (f"<|im_start|>user\nRead this list. {LONG_TEXT[:120]}{IMG}{LONG_TEXT[120:]}<|im_end|>\n"
                        "<|im_start|>assistant\n", [(96, 96)]),
    "long_text": (f"<|im_start|>user\nRead this list. {LONG_TEXT}<|im_end|>\n<|im_start|>assistant\n", []),
}


def _cases() -> list[tuple[str, str]]:
    out = []
    for arch in ARCHS:
        for name, (_, sizes) in PROMPTS.items():
            if sizes and arch not in VL:
                continue
            if name.startswith("long") and arch not in HYBRID:
                continue
            out.append((arch, name))
    return out


@pytest.mark.parametrize(("name", "prompt"), _cases())
def test_logits_match_hf(loaded, name, prompt):
    ckpt, ours, hf = loaded(name)
    text, sizes = PROMPTS[prompt]
    inp = build_hf_inputs(ckpt, text, [_image(w, h, i) for i, (w, h) in enumerate(sizes)])
    if prompt.startswith("long"):
        assert inp["input_ids"].shape[1] > 3 * 64
    ref = _hf_logits(hf, inp)
    ours_logits = _our_logits(ours, [inp])
    # End to end (our vision tower): its float32 rounding noise (~1e-6, see the vision test) grows
    # through the wide-init layers, so this bound is relative to the logit scale (|logits| ~ 16-20).
    assert _rel_diff(ours_logits, ref) < 5e-5
    if sizes:  # text model + M-RoPE (+ DeepStack) alone: splice HF's own image features
        with torch.no_grad():
            feats = hf.model.get_image_features(inp["pixel_values"], inp["image_grid_thw"])
        deep = getattr(feats, "deepstack_features", None)
        hf_features = (torch.cat(feats.pooler_output), torch.stack([torch.cat(f) for f in deep]) if deep else None)
        ours_logits = _our_logits(ours, [inp], hf_features)
    assert (ours_logits - ref).abs().max().item() < 1e-4


@pytest.mark.parametrize("name", ARCHS)
def test_batched_equals_single(loaded, name):
    """Ragged batch: each sequence keeps its own GDN state and KV; results match one-at-a-time runs."""
    ckpt, ours, _ = loaded(name)
    prompts = [PROMPTS["two_images"], PROMPTS["text_only"], PROMPTS["one_image"]] if name in VL else \
        [PROMPTS["long_text"], PROMPTS["text_only"]]
    batch = [build_hf_inputs(ckpt, text, [_image(w, h, i) for i, (w, h) in enumerate(sizes)])
             for text, sizes in prompts]
    together = _our_logits(ours, batch)
    start = 0
    for inp in batch:
        n = inp["input_ids"].shape[1]
        # padding changes SDPA's summation order: float32 noise only (logits ~ 16)
        assert (together[start:start + n] - _our_logits(ours, [inp])).abs().max().item() < 5e-5
        start += n


# ---------------------------------------------------------------------------------------------
# Weight loading
# ---------------------------------------------------------------------------------------------


def _hub_names(ckpt):
    """transformers-5 names -> hub layout: `model.*` text, `visual.*` vision."""
    for name, t in iter_weights(ckpt):
        yield name.replace("model.language_model.", "model.", 1).replace("model.visual.", "visual.", 1), t


def _fused_experts(weights):
    """Per-expert tensors (as the tiny checkpoints save them) -> one fused pair per layer."""
    weights = list(weights)
    pieces: dict[str, dict[str, list]] = {}
    out = []
    for name, t in weights:
        m = re.match(r"(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$", name)
        if m:
            pieces.setdefault(m[1], {}).setdefault(m[3], []).append((int(m[2]), t))
        else:
            out.append((name, t))
    for prefix, kinds in pieces.items():
        stack = {k: torch.stack([t for _, t in sorted(v, key=lambda x: x[0])]) for k, v in kinds.items()}
        out.append((f"{prefix}.gate_up_proj", torch.cat([stack["gate_proj"], stack["up_proj"]], dim=1)))
        out.append((f"{prefix}.down_proj", stack["down_proj"]))
    return out


@pytest.mark.parametrize("name", ARCHS)
def test_load_other_layouts(loaded, name):
    """Hub name layout and the other expert layout load into the same parameters."""
    ckpt, ours, _ = loaded(name)
    layouts = {"hub": list(_hub_names(ckpt)) if name in VL else list(iter_weights(ckpt))}
    if name in ("qwen3_5_moe", "qwen3_next"):  # saved per expert: also try fused
        layouts["fused"] = _fused_experts(iter_weights(ckpt))
    if name == "qwen3_vl_moe":  # saved fused: also try the hub's transposed fused tensors
        layouts["transposed"] = [(n, t.transpose(1, 2).contiguous() if n.endswith(("gate_up_proj", "down_proj"))
                                  and t.dim() == 3 else t) for n, t in iter_weights(ckpt)]
    layouts["with_mtp"] = list(iter_weights(ckpt)) + [("mtp.fc.weight", torch.zeros(2, 2))]  # skipped
    for label, weights in layouts.items():
        other = type(ours)(ours.config).eval()
        assert other.load_weights(weights) == {n for n, _ in other.named_parameters()}, label
        for (n, a), (_, b) in zip(ours.named_parameters(), other.named_parameters()):
            assert torch.equal(a, b), f"{label}: {n}"


@pytest.mark.parametrize("name", ARCHS)
def test_missing_or_misshaped_weight_is_named(loaded, name):
    ckpt, ours, _ = loaded(name)
    weights = list(iter_weights(ckpt))
    target = next(n for n, _ in weights if ("linear_attn.in_proj" in n or "self_attn.q_proj" in n)
                  and ".layers.1." in n)
    other = type(ours)(ours.config)
    with pytest.raises(ValueError, match="missing from the checkpoint"):
        other.load_weights([(n, t) for n, t in weights if n != target])
    with pytest.raises(ValueError, match=re.escape(target)):
        other.load_weights([(n, t[:-1] if n == target else t) for n, t in weights])
