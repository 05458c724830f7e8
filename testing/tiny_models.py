"""Tiny random checkpoints and a tiny tokenizer, built on the fly for tests, benchmarks and training.

Nothing here is downloaded. `build_tiny_tokenizer` trains a small byte-level BPE tokenizer with
the Qwen special tokens and a ChatML chat template; `build_tiny_checkpoint` builds a tiny random
Qwen3 / Qwen2.5-VL / Qwen3-VL / Qwen3.5 / Qwen3.5-MoE / Qwen3-Next / Qwen3-VL-MoE model with
transformers' own config classes, re-initialises its
weights with a wide spread (so greedy argmax is robust to float noise) and saves it as sharded
float32 safetensors next to the tokenizer files, a generation config and (for VL models) an image
processor config. `build_hf_inputs` turns a prompt plus images into the inputs HF's model expects,
for parity tests.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import torch
from PIL import Image
from tokenizers import Regex, Tokenizer, decoders, normalizers, pre_tokenizers
from tokenizers.models import BPE
from tokenizers.trainers import BpeTrainer

# --------------------------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------------------------

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
VISION_START = "<|vision_start|>"
VISION_END = "<|vision_end|>"
VISION_PAD = "<|vision_pad|>"
IMAGE_PAD = "<|image_pad|>"
VIDEO_PAD = "<|video_pad|>"

SPECIAL_TOKENS: tuple[str, ...] = (
    ENDOFTEXT,
    IM_START,
    IM_END,
    VISION_START,
    VISION_END,
    VISION_PAD,
    IMAGE_PAD,
    VIDEO_PAD,
)

# Learned BPE vocabulary size (256 byte symbols + merges); the special tokens come after it,
# so the full vocabulary is BPE_VOCAB_SIZE + 8 = 512 tokens.
BPE_VOCAB_SIZE = 504

# Same split rule as Qwen's tokenizer: contractions, letter runs, single digits, punctuation runs.
_SPLIT_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

# A ChatML template (Qwen's conversation format), written for this project.
CHAT_TEMPLATE = """\
{%- macro media_or_text(item) -%}
    {%- set kind = item['type'] if item['type'] is defined else '' -%}
    {%- if kind == 'text' -%}
        {{- item['text'] -}}
    {%- elif kind in ['image', 'image_url'] -%}
        {{- '<|vision_start|><|image_pad|><|vision_end|>' -}}
    {%- elif kind in ['video', 'video_url'] -%}
        {{- '<|vision_start|><|video_pad|><|vision_end|>' -}}
    {%- endif -%}
{%- endmacro -%}
{%- for message in messages -%}
    {{- '<|im_start|>' + message['role'] + '\\n' -}}
    {%- if message['content'] is string -%}
        {{- message['content'] -}}
    {%- elif message['content'] is not none -%}
        {%- for item in message['content'] -%}
            {{- media_or_text(item) -}}
        {%- endfor -%}
    {%- endif -%}
    {{- '<|im_end|>\\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<|im_start|>assistant\\n' -}}
{%- endif -%}
"""

_SUBJECTS = [
    "cat", "dog", "bird", "car", "bus", "tree", "house", "person", "child", "woman", "man",
    "horse", "boat", "train", "bicycle", "table", "chair", "cup", "book", "flower", "mountain",
    "river", "street", "window", "door", "clock", "phone", "laptop", "pizza", "apple",
]
_ADJECTIVES = [
    "red", "blue", "green", "yellow", "black", "white", "small", "large", "old", "new",
    "bright", "dark", "wooden", "shiny", "tall", "round", "striped", "blurry", "colorful", "quiet",
]
_VERBS = [
    "is sitting", "is standing", "is running", "is parked", "is lying", "is flying", "appears",
    "is shown", "is visible", "is waiting", "is moving", "rests",
]
_PLACES = [
    "on the left", "on the right", "in the center", "near the top", "at the bottom",
    "next to a wall", "under a tree", "behind the fence", "in the background", "in the foreground",
    "beside the road", "on a table",
]
_STARTERS = [
    "The image shows", "This picture contains", "In this photo, there is", "We can see",
    "Describe the image:", "Caption:", "Question: what is in the picture? Answer:",
]
_EXTRA_SENTENCES = [
    "The café on the corner serves coffee at 7:30 a.m.",
    "A naïve question: how many objects are there?",
    "日本語のテキストも少し含まれています。",
    "東京の夜景はとても綺麗です。",
    "Ünïcödé text: Straße, façade, jalapeño, crème brûlée, smörgåsbord.",
    "Emoji test: 😀 🐱 🚗 🌳 🍕 ❤️ 👍",
    "Привет, мир! Это тест.",
    "¿Dónde está la biblioteca? ¡Aquí!",
    "Numbers: 0 1 2 3 4 5 6 7 8 9, 10, 42, 100, 2024, 3.14159, -7, 1e-3.",
    "Punctuation: (a) [b] {c} <d> \"quoted\" 'single' a/b a\\b a|b #tag @user $5 %20 ^ & * ~ `code`.",
    "Width x height = 640 x 480 pixels; aspect ratio 4:3.",
    "The answer is: yes. The answer is: no. Maybe?",
    "def f(x):\n    return x * 2\n",
    "Line one.\nLine two.\n\nParagraph three.",
]


def _tiny_corpus() -> list[str]:
    """A few hundred deterministic English-ish sentences plus non-ASCII and code snippets."""
    rng = random.Random(1234)
    lines: list[str] = []
    for i in range(360):
        start = rng.choice(_STARTERS)
        adj = rng.choice(_ADJECTIVES)
        subj = rng.choice(_SUBJECTS)
        verb = rng.choice(_VERBS)
        place = rng.choice(_PLACES)
        count = rng.randint(0, 99)
        lines.append(f"{start} a {adj} {subj} that {verb} {place}. There are {count} of them ({i}).")
    for _ in range(6):
        lines.extend(_EXTRA_SENTENCES)
    return lines


def _new_bpe_tokenizer() -> Tokenizer:
    """An untrained byte-level BPE pipeline shaped like Qwen's (NFC, regex split, byte-level)."""
    tok = Tokenizer(BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_SPLIT_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    return tok


def train_tiny_bpe() -> Tokenizer:
    """Train the tiny BPE deterministically and append the Qwen special tokens after it."""
    tok = _new_bpe_tokenizer()
    trainer = BpeTrainer(
        vocab_size=BPE_VOCAB_SIZE,
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    tok.train_from_iterator(_tiny_corpus(), trainer=trainer)
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    return tok


def build_tiny_tokenizer(out_dir: Path) -> None:
    """Write a Qwen-style tiny tokenizer (tokenizer.json, config, chat_template.jinja) to out_dir."""
    from transformers import Qwen2Tokenizer

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    hf_tok = Qwen2Tokenizer(
        tokenizer_object=train_tiny_bpe(),
        unk_token=None,
        bos_token=None,
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        add_prefix_space=False,
        model_max_length=4096,
        extra_special_tokens=[t for t in SPECIAL_TOKENS if t not in (IM_END, ENDOFTEXT)],
    )
    hf_tok.chat_template = CHAT_TEMPLATE
    hf_tok.save_pretrained(str(out_dir))
    (out_dir / "chat_template.jinja").write_text(CHAT_TEMPLATE, encoding="utf-8")


@dataclass(frozen=True)
class SpecialIds:
    """Ids of the Qwen special tokens in the tiny tokenizer."""

    endoftext: int
    im_start: int
    im_end: int
    vision_start: int
    vision_end: int
    vision_pad: int
    image_pad: int
    video_pad: int


def special_ids(tokenizer: Any) -> SpecialIds:
    """Look up the special token ids of a loaded tokenizer."""
    ids = [tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS]
    return SpecialIds(*ids)


# --------------------------------------------------------------------------------------------
# Checkpoints
# --------------------------------------------------------------------------------------------

ARCHS: tuple[str, ...] = ("qwen3", "qwen2_5_vl", "qwen3_vl", "qwen3_5", "qwen3_5_moe", "qwen3_next", "qwen3_vl_moe")
# Hybrid (Gated DeltaNet + gated full attention) architectures.
HYBRID_ARCHS: tuple[str, ...] = ("qwen3_5", "qwen3_5_moe", "qwen3_next")

TEXT_HIDDEN = 64
TEXT_INTERMEDIATE = 128
TEXT_HEADS = 4
TEXT_KV_HEADS = 2
HEAD_DIM = 16
MAX_POSITIONS = 4096
VISION_HIDDEN = 32
VISION_INTERMEDIATE = 64
VISION_HEADS = 2
MERGE_SIZE = 2
TEMPORAL_PATCH = 2
# Image token limits: at least 2x2 and at most 64 merged tokens (8x8 merged grid).
MIN_MERGED_TOKENS = 4
MAX_MERGED_TOKENS = 64
SHARD_SIZE = "100KB"
WEIGHT_GAIN = 1.6  # weight std = WEIGHT_GAIN / sqrt(fan_in): 0.2 for the 64-wide text layers
LM_HEAD_GAIN = 4.0  # lm_head (and tied embeddings) std = 0.5: logits spread ~4, clear greedy margins

# Hybrid models: GDN layers with 2 key heads and 4 value heads (grouped, as the real models), 16 dims each.
LINEAR_KEY_HEADS = 2
LINEAR_VALUE_HEADS = 4
LINEAR_HEAD_DIM = 16
HYBRID_HEAD_DIM = 32  # full-attention head_dim; the rotary part is partial_rotary_factor (0.25) of it
# MoE: 4 experts, top-2, experts narrower than the shared expert. The dims keep every expert tensor
# non-square so a transposed fused layout is told apart by its shape.
NUM_EXPERTS = 4
EXPERTS_PER_TOKEN = 2
MOE_INTERMEDIATE = 24
SHARED_EXPERT_INTERMEDIATE = 48

QWEN25VL_MEAN = (0.48145466, 0.4578275, 0.40821073)  # OpenAI CLIP mean/std, as the real checkpoint
QWEN25VL_STD = (0.26862954, 0.26130258, 0.27577711)
QWEN3VL_MEAN = (0.5, 0.5, 0.5)
QWEN3VL_STD = (0.5, 0.5, 0.5)


def _padded_vocab(n: int, multiple: int = 8) -> int:
    return (n + multiple - 1) // multiple * multiple


def _text_dims(vocab_size: int, num_layers: int, ids: SpecialIds) -> dict[str, Any]:
    """Text-decoder kwargs shared by all three architectures."""
    return dict(
        vocab_size=vocab_size,
        hidden_size=TEXT_HIDDEN,
        intermediate_size=TEXT_INTERMEDIATE,
        num_hidden_layers=num_layers,
        num_attention_heads=TEXT_HEADS,
        num_key_value_heads=TEXT_KV_HEADS,
        max_position_embeddings=MAX_POSITIONS,
        rms_norm_eps=1e-6,
        pad_token_id=ids.endoftext,
    )


def _qwen3_config(vocab_size: int, ids: SpecialIds) -> Any:
    from transformers import Qwen3Config

    return Qwen3Config(
        **_text_dims(vocab_size, 2, ids),
        head_dim=HEAD_DIM,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        tie_word_embeddings=True,
        bos_token_id=ids.endoftext,
        eos_token_id=ids.im_end,
        architectures=["Qwen3ForCausalLM"],
        dtype="float32",
    )


def _qwen2_5_vl_config(vocab_size: int, ids: SpecialIds) -> Any:
    from transformers import Qwen2_5_VLConfig

    text = _text_dims(vocab_size, 3, ids)
    text.update(
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0, "mrope_section": [2, 3, 3]},
        bos_token_id=ids.endoftext,
        eos_token_id=ids.im_end,
        tie_word_embeddings=False,
    )
    vision = dict(
        depth=3,
        hidden_size=VISION_HIDDEN,
        intermediate_size=VISION_INTERMEDIATE,
        num_heads=VISION_HEADS,
        out_hidden_size=TEXT_HIDDEN,
        patch_size=14,
        spatial_merge_size=MERGE_SIZE,
        temporal_patch_size=TEMPORAL_PATCH,
        window_size=56,  # 2x2 merged tokens per window: most test images span several windows
        fullatt_block_indexes=[1],
        tokens_per_second=2,
    )
    return Qwen2_5_VLConfig(
        text_config=text,
        vision_config=vision,
        **_vision_token_ids(ids),
        tie_word_embeddings=False,
        architectures=["Qwen2_5_VLForConditionalGeneration"],
        dtype="float32",
    )


def _qwen3_vl_config(vocab_size: int, ids: SpecialIds) -> Any:
    from transformers import Qwen3VLConfig

    text = _text_dims(vocab_size, 3, ids)
    text.update(
        head_dim=HEAD_DIM,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 5_000_000.0,
            "mrope_section": [4, 2, 2],  # interleaved: h at freqs 1,4; w at 2,5; t at 0,3,6,7
            "mrope_interleaved": True,
        },
    )
    vision = dict(
        depth=3,
        hidden_size=VISION_HIDDEN,
        intermediate_size=VISION_INTERMEDIATE,
        num_heads=VISION_HEADS,
        out_hidden_size=TEXT_HIDDEN,
        patch_size=16,
        spatial_merge_size=MERGE_SIZE,
        temporal_patch_size=TEMPORAL_PATCH,
        num_position_embeddings=64,  # an 8x8 learned grid, interpolated per image
        deepstack_visual_indexes=[0, 1],
    )
    return Qwen3VLConfig(
        text_config=text,
        vision_config=vision,
        **_vision_token_ids(ids),
        tie_word_embeddings=False,
        architectures=["Qwen3VLForConditionalGeneration"],
        dtype="float32",
    )


def _vision_token_ids(ids: SpecialIds) -> dict[str, int]:
    return dict(
        image_token_id=ids.image_pad,
        video_token_id=ids.video_pad,
        vision_start_token_id=ids.vision_start,
        vision_end_token_id=ids.vision_end,
    )


def _vision_dims(deepstack: list[int] | None) -> dict[str, Any]:
    """A 3-block Qwen3-VL-style vision tower (patch 16, learned 8x8 position grid)."""
    vision = dict(
        depth=3,
        hidden_size=VISION_HIDDEN,
        intermediate_size=VISION_INTERMEDIATE,
        num_heads=VISION_HEADS,
        out_hidden_size=TEXT_HIDDEN,
        patch_size=16,
        spatial_merge_size=MERGE_SIZE,
        temporal_patch_size=TEMPORAL_PATCH,
        num_position_embeddings=64,
    )
    if deepstack is not None:
        vision["deepstack_visual_indexes"] = deepstack
    return vision


def _hybrid_text_dims(vocab_size: int, ids: SpecialIds, layer_types: list[str] | None) -> dict[str, Any]:
    """Qwen3-Next / Qwen3.5 text kwargs: 4 layers, GDN + gated attention, partial rotary."""
    text = _text_dims(vocab_size, 4, ids)
    text.update(
        head_dim=HYBRID_HEAD_DIM,
        linear_num_key_heads=LINEAR_KEY_HEADS,
        linear_num_value_heads=LINEAR_VALUE_HEADS,
        linear_key_head_dim=LINEAR_HEAD_DIM,
        linear_value_head_dim=LINEAR_HEAD_DIM,
        linear_conv_kernel_dim=4,
        bos_token_id=ids.endoftext,
        eos_token_id=ids.im_end,
    )
    if layer_types is not None:
        text["layer_types"] = layer_types
    return text


def _layer_types(pattern: str) -> list[str]:
    """"LFLF" -> linear_attention, full_attention, ..."""
    return [{"L": "linear_attention", "F": "full_attention"}[c] for c in pattern]


def _moe_dims() -> dict[str, Any]:
    return dict(num_experts=NUM_EXPERTS, num_experts_per_tok=EXPERTS_PER_TOKEN, moe_intermediate_size=MOE_INTERMEDIATE)


# Qwen3.5 M-RoPE over the rotary part (32 * 0.25 = 8 dims, 4 frequencies): t at 0 and 3, h at 1, w at 2.
_QWEN3_5_ROPE = {"rope_type": "default", "rope_theta": 10_000_000.0, "mrope_section": [2, 1, 1],
                 "mrope_interleaved": True}


def _vl_config(config_cls: Any, text: dict, vision: dict, ids: SpecialIds) -> Any:
    """A Qwen3-VL-style checkpoint config: text + vision dims, the vision token ids, untied head, float32."""
    return config_cls(text_config=text, vision_config=vision, **_vision_token_ids(ids), tie_word_embeddings=False,
                      architectures=[config_cls.__name__.replace("Config", "ForConditionalGeneration")],
                      dtype="float32")


def _qwen3_5_config(vocab_size: int, ids: SpecialIds) -> Any:
    from transformers import Qwen3_5Config

    text = _hybrid_text_dims(vocab_size, ids, _layer_types("LFLF"))
    text.update(rope_parameters=dict(_QWEN3_5_ROPE))
    return _vl_config(Qwen3_5Config, text, _vision_dims(None), ids)


def _qwen3_5_moe_config(vocab_size: int, ids: SpecialIds) -> Any:
    from transformers import Qwen3_5MoeConfig

    text = _hybrid_text_dims(vocab_size, ids, None)  # HF's default: full attention every 4th layer
    del text["intermediate_size"]  # every layer is MoE
    text.update(rope_parameters=dict(_QWEN3_5_ROPE), shared_expert_intermediate_size=SHARED_EXPERT_INTERMEDIATE,
                **_moe_dims())
    return _vl_config(Qwen3_5MoeConfig, text, _vision_dims(None), ids)


def _qwen3_next_config(vocab_size: int, ids: SpecialIds) -> Any:
    from transformers import Qwen3NextConfig

    text = _hybrid_text_dims(vocab_size, ids, _layer_types("LFLL"))
    text.update(
        head_dim=HEAD_DIM,
        # 1-D rope on half of each head (8 of 16 dims)
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0, "partial_rotary_factor": 0.5},
        shared_expert_intermediate_size=SHARED_EXPERT_INTERMEDIATE,
        mlp_only_layers=[1],  # one dense MLP layer among the MoE ones
        norm_topk_prob=True,
        **_moe_dims(),
    )
    return Qwen3NextConfig(**text, tie_word_embeddings=False, architectures=["Qwen3NextForCausalLM"],
                           dtype="float32")


def _qwen3_vl_moe_config(vocab_size: int, ids: SpecialIds) -> Any:
    from transformers import Qwen3VLMoeConfig

    text = _text_dims(vocab_size, 3, ids)
    text.update(
        head_dim=HEAD_DIM,
        rope_parameters={"rope_type": "default", "rope_theta": 5_000_000.0, "mrope_section": [4, 2, 2],
                         "mrope_interleaved": True},
        mlp_only_layers=[1],  # layers 0 and 2 are MoE, layer 1 a dense MLP
        **_moe_dims(),
    )
    return _vl_config(Qwen3VLMoeConfig, text, _vision_dims([0, 1]), ids)


_CONFIG_BUILDERS = {
    "qwen3": _qwen3_config,
    "qwen2_5_vl": _qwen2_5_vl_config,
    "qwen3_vl": _qwen3_vl_config,
    "qwen3_5": _qwen3_5_config,
    "qwen3_5_moe": _qwen3_5_moe_config,
    "qwen3_next": _qwen3_next_config,
    "qwen3_vl_moe": _qwen3_vl_moe_config,
}


def _model_class(arch: str) -> Any:
    import transformers

    names = {
        "qwen3": "Qwen3ForCausalLM",
        "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
        "qwen3_vl": "Qwen3VLForConditionalGeneration",
        "qwen3_5": "Qwen3_5ForConditionalGeneration",
        "qwen3_5_moe": "Qwen3_5MoeForConditionalGeneration",
        "qwen3_next": "Qwen3NextForCausalLM",
        "qwen3_vl_moe": "Qwen3VLMoeForConditionalGeneration",
    }
    return getattr(transformers, names[arch])


# RMSNorm classes that scale by (1 + weight): their weights are initialised around 0, not 1.
_ZERO_CENTRED_NORMS = ("Qwen3NextRMSNorm", "Qwen3_5RMSNorm", "Qwen3_5MoeRMSNorm")


@torch.no_grad()
def reinit_weights(model: torch.nn.Module, seed: int) -> None:
    """Deterministic wide-spread init: matrices ~ N(0, gain/sqrt(fan_in)), norms ~ 1, biases small.

    HF's default init (std 0.02) gives nearly flat logits, where greedy ties flip on 1e-7 noise.
    Fused expert tensors [experts, out, in] take fan_in = in; zero-centred norms (scale 1 + w) get
    w ~ 0; GDN decay rates A = exp(A_log) spread over (0.005, 0.2): per-token decays exp(g) of about
    0.8-0.999, so the state carries across 64-token chunks (and the gated norm never sees a core
    output that has all but vanished, where float32 noise would be blown up).
    """
    gen = torch.Generator().manual_seed(seed)
    output_weight = model.get_output_embeddings().weight
    zero_centred = {id(m.weight) for m in model.modules() if type(m).__name__ in _ZERO_CENTRED_NORMS}
    for name, param in model.named_parameters():
        noise = torch.randn(param.shape, generator=gen, dtype=torch.float32)
        if param.dim() >= 2:
            fan_in = param.shape[-1] if param.dim() == 3 else param[0].numel()
            gain = LM_HEAD_GAIN if param is output_weight else WEIGHT_GAIN
            param.copy_(noise * (gain / fan_in**0.5))
        elif name.endswith("A_log"):
            param.copy_(torch.log(0.005 + 0.195 * torch.sigmoid(2.0 * noise)))
        elif name.endswith("bias"):
            param.copy_(noise * 0.05)
        elif id(param) in zero_centred:
            param.copy_(noise * 0.1)
        else:  # norm scales
            param.copy_(1.0 + noise * 0.1)


def _image_processor(arch: str) -> Any:
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    patch = 14 if arch == "qwen2_5_vl" else 16
    factor = patch * MERGE_SIZE
    mean, std = (QWEN25VL_MEAN, QWEN25VL_STD) if arch == "qwen2_5_vl" else (QWEN3VL_MEAN, QWEN3VL_STD)
    return Qwen2VLImageProcessorPil(
        patch_size=patch,
        merge_size=MERGE_SIZE,
        temporal_patch_size=TEMPORAL_PATCH,
        min_pixels=MIN_MERGED_TOKENS * factor * factor,
        max_pixels=MAX_MERGED_TOKENS * factor * factor,
        image_mean=list(mean),
        image_std=list(std),
    )


def _video_processor(arch: str) -> Any:
    """The video processor class transformers uses for the family, with small pixel bounds.

    Qwen2.5-VL's bounds hold per frame; Qwen3-VL's / Qwen3.5's over all sampled frames together."""
    from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    if arch == "qwen2_5_vl":
        factor = 14 * MERGE_SIZE
        return Qwen2VLVideoProcessor(patch_size=14, merge_size=MERGE_SIZE, temporal_patch_size=TEMPORAL_PATCH,
                                     size={"shortest_edge": MIN_MERGED_TOKENS * factor * factor,
                                           "longest_edge": MAX_MERGED_TOKENS * factor * factor},
                                     image_mean=list(QWEN25VL_MEAN), image_std=list(QWEN25VL_STD))
    factor = 16 * MERGE_SIZE
    return Qwen3VLVideoProcessor(patch_size=16, merge_size=MERGE_SIZE, temporal_patch_size=TEMPORAL_PATCH,
                                 size={"shortest_edge": MIN_MERGED_TOKENS * factor * factor,
                                       "longest_edge": 4 * MAX_MERGED_TOKENS * factor * factor},
                                 image_mean=list(QWEN3VL_MEAN), image_std=list(QWEN3VL_STD))


def _write_generation_config(model: Any, ids: SpecialIds) -> None:
    from transformers import GenerationConfig

    model.generation_config = GenerationConfig(
        bos_token_id=ids.endoftext,
        eos_token_id=[ids.im_end, ids.endoftext],
        pad_token_id=ids.endoftext,
        do_sample=False,
    )


def _apply_overrides(config: Any, overrides: Mapping[str, Mapping[str, Any]]) -> None:
    """Sets `overrides["text"]` on the text config and `overrides["vision"]` on the vision config."""
    targets = {"text": config.get_text_config(), "vision": getattr(config, "vision_config", None)}
    for part, fields in overrides.items():
        if targets.get(part) is None:
            raise ValueError(f"{type(config).__name__} has no {part} config to override")
        for name, value in fields.items():
            setattr(targets[part], name, value)


def build_tiny_checkpoint(arch: str, out_dir: Path, seed: int = 0,
                          overrides: Mapping[str, Mapping[str, Any]] | None = None) -> Path:
    """Build a tiny random checkpoint of `arch` in out_dir (sharded float32 safetensors + tokenizer).

    arch is one of `ARCHS`. `overrides`: config fields to set before the model is built, under "text"
    (the text config) and "vision" (the vision config), e.g. wider dims (`testing.wide_models`).
    Returns out_dir.
    """
    from transformers import AutoTokenizer

    if arch not in _CONFIG_BUILDERS:
        raise ValueError(f"unknown tiny arch {arch!r}; expected one of {ARCHS}")
    out_dir = Path(out_dir)
    build_tiny_tokenizer(out_dir)
    tokenizer = AutoTokenizer.from_pretrained(str(out_dir))
    ids = special_ids(tokenizer)
    config = _CONFIG_BUILDERS[arch](_padded_vocab(len(tokenizer)), ids)
    _apply_overrides(config, overrides or {})

    torch.manual_seed(seed)
    model = _model_class(arch)(config).to(torch.float32).eval()
    reinit_weights(model, seed)
    _write_generation_config(model, ids)
    model.save_pretrained(str(out_dir), max_shard_size=SHARD_SIZE)
    if getattr(config, "vision_config", None) is not None:
        _image_processor(arch).save_pretrained(str(out_dir))
        _video_processor(arch).save_pretrained(str(out_dir))
    return out_dir


# --------------------------------------------------------------------------------------------
# HF reference inputs (for parity tests)
# --------------------------------------------------------------------------------------------


def build_hf_inputs(model_dir: Path, text: str, images: list[Image.Image] | None = None) -> dict[str, Any]:
    """Tokenize already-templated text for HF's model, expanding each <|image_pad|> like HF's processor.

    Each `<|image_pad|>` in text becomes grid_t*grid_h*grid_w / merge**2 copies for the matching image.
    Returns input_ids [1, L], attention_mask, and for images pixel_values, image_grid_thw and
    mm_token_type_ids (1 on image tokens) — transformers 5.23 needs the latter for M-RoPE.
    """
    from transformers import AutoTokenizer
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    model_dir = Path(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    images = images or []
    if text.count(IMAGE_PAD) != len(images):
        raise ValueError(f"text has {text.count(IMAGE_PAD)} {IMAGE_PAD} but {len(images)} images were given")
    out: dict[str, Any] = {}
    if images:
        proc = Qwen2VLImageProcessorPil.from_pretrained(str(model_dir))
        feats = proc(images=images, return_tensors="pt")
        grids = feats["image_grid_thw"]
        merge = proc.merge_size
        pieces = text.split(IMAGE_PAD)
        expanded = pieces[0]
        for grid, piece in zip(grids.tolist(), pieces[1:]):
            expanded += IMAGE_PAD * (grid[0] * grid[1] * grid[2] // merge**2) + piece
        text = expanded
        out["pixel_values"] = feats["pixel_values"]
        out["image_grid_thw"] = grids
    input_ids = torch.tensor([tokenizer.encode(text, add_special_tokens=False)], dtype=torch.long)
    out["input_ids"] = input_ids
    out["attention_mask"] = torch.ones_like(input_ids)
    if images:
        image_id = tokenizer.convert_tokens_to_ids(IMAGE_PAD)
        out["mm_token_type_ids"] = (input_ids == image_id).to(torch.int32)
    return out


@torch.no_grad()
def greedy_margins(model: Any, inputs: dict[str, Any], steps: int = 20) -> tuple[list[int], list[float]]:
    """Greedy-decode `steps` tokens with HF and return (tokens, top1 - top2 raw logit margins)."""
    out = model.generate(
        **inputs,
        max_new_tokens=steps,
        min_new_tokens=steps,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
    )
    prompt_len = inputs["input_ids"].shape[1]
    tokens = out.sequences[0, prompt_len:].tolist()
    margins = []
    for logits in out.logits:
        top2 = logits[0].float().topk(2).values
        margins.append(float(top2[0] - top2[1]))
    return tokens, margins


def main(argv: list[str] | None = None) -> None:
    """`python -m testing.tiny_models ARCH OUT_DIR`: build one tiny random checkpoint (for trying the engine without downloads)."""
    import argparse

    parser = argparse.ArgumentParser(description="Build a tiny random-weight checkpoint.")
    parser.add_argument("arch", choices=list(_CONFIG_BUILDERS))
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    build_tiny_checkpoint(args.arch, args.out_dir, args.seed)
    print(f"built a tiny random-weight {args.arch} checkpoint in {args.out_dir}")


if __name__ == "__main__":
    main()
