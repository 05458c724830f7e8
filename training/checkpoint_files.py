"""Everything of the default checkpoint except its weights: tokenizer, chat template, configs.

The tokenizer is a byte-level BPE (Qwen's pre-tokenisation: NFC, the Qwen split regex, byte-level)
trained on the vocabulary of the synthetic scenes (captions, questions, answers), so every word the
model reads or writes is one token; any other text still encodes, byte by byte. The Qwen special
tokens follow the learned vocabulary, and the chat template is ChatML (Qwen's conversation format).
The model config is a Qwen3.5 (`Qwen3_5ForConditionalGeneration`) at a tiny size: a 3-block vision
tower (patch 16, merge 2) and a 4-layer hybrid text stack (Gated DeltaNet and full attention alternating).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from tokenizers import Regex, Tokenizer, decoders, normalizers, pre_tokenizers
from tokenizers.models import BPE
from tokenizers.trainers import BpeTrainer

from testing.tiny_models import CHAT_TEMPLATE, ENDOFTEXT, IM_END, SPECIAL_TOKENS  # the test tokenizer's Qwen conventions
from testing.scene_splits import TRAIN_SEED, iter_scenes
from vlmrun.shape_scenes import PROMPTS

# Qwen's pre-tokeniser split: contractions, letter runs, single digits, punctuation runs, spaces.
SPLIT_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
RESUME_FILE = "resume_state.pt"  # a training run's snapshot in its output folder, deleted when training ends
TOKENIZER_SCENES = 2000  # scenes whose text trains the BPE (more add no new words)
BPE_MAX_VOCAB = 1024  # an upper bound: merging stops once every word is a single token


@dataclass(frozen=True)
class ModelSize:
    """The knobs of the tiny Qwen3.5 (the rest of the config follows from them)."""

    text_hidden: int = 192
    text_intermediate: int = 512
    text_layers: tuple[str, ...] = ("linear_attention", "full_attention", "linear_attention", "full_attention")
    attn_heads: int = 4
    attn_kv_heads: int = 2
    attn_head_dim: int = 64
    gdn_key_heads: int = 2
    gdn_value_heads: int = 4
    gdn_head_dim: int = 32
    vision_hidden: int = 128
    vision_intermediate: int = 384
    vision_depth: int = 3
    vision_heads: int = 4
    vision_pos_grid: int = 12  # learned position grid side (interpolated to each image's patch grid)
    min_merged_tokens: int = 4
    max_merged_tokens: int = 36


def _corpus() -> list[str]:
    """Every prompt and answer text of the first TOKENIZER_SCENES training scenes."""
    lines = list(PROMPTS)
    for scene in iter_scenes(TRAIN_SEED, 0, TOKENIZER_SCENES):
        lines.append(scene.caption)
        for qa in scene.qa_pairs():
            lines.append(qa.question)
            lines.append(qa.answer)
    return lines


def train_bpe() -> Tokenizer:
    """The byte-level BPE, trained deterministically, with the Qwen special tokens after it."""
    tok = Tokenizer(BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = BpeTrainer(vocab_size=BPE_MAX_VOCAB, min_frequency=2, show_progress=False,
                         initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=[])
    tok.train_from_iterator(_corpus(), trainer=trainer)
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    return tok


def write_tokenizer(out_dir: Path) -> Any:
    """Write tokenizer.json, tokenizer_config.json and chat_template.jinja; return the HF tokenizer."""
    from transformers import AutoTokenizer, Qwen2Tokenizer

    hf_tok = Qwen2Tokenizer(
        tokenizer_object=train_bpe(),
        unk_token=None,
        bos_token=None,
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        add_prefix_space=False,
        model_max_length=1024,
        extra_special_tokens=[t for t in SPECIAL_TOKENS if t not in (IM_END, ENDOFTEXT)],
    )
    hf_tok.chat_template = CHAT_TEMPLATE
    hf_tok.save_pretrained(str(out_dir))
    (Path(out_dir) / "chat_template.jinja").write_text(CHAT_TEMPLATE, encoding="utf-8")
    return AutoTokenizer.from_pretrained(str(out_dir))


def padded_vocab(n: int, multiple: int = 64) -> int:
    return (n + multiple - 1) // multiple * multiple


def build_config(tokenizer: Any, size: ModelSize) -> Any:
    """The Qwen3_5Config of the default model."""
    from transformers import Qwen3_5Config

    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    rotary = int(size.attn_head_dim * 0.25)  # Qwen3.5 rotates a quarter of each head
    half = rotary // 2
    mrope = [half - 2 * (half // 3), half // 3, half // 3]  # t, h, w frequencies, interleaved
    text = dict(
        vocab_size=padded_vocab(len(tokenizer)),
        hidden_size=size.text_hidden,
        intermediate_size=size.text_intermediate,
        num_hidden_layers=len(size.text_layers),
        layer_types=list(size.text_layers),
        num_attention_heads=size.attn_heads,
        num_key_value_heads=size.attn_kv_heads,
        head_dim=size.attn_head_dim,
        linear_conv_kernel_dim=4,
        linear_key_head_dim=size.gdn_head_dim,
        linear_value_head_dim=size.gdn_head_dim,
        linear_num_key_heads=size.gdn_key_heads,
        linear_num_value_heads=size.gdn_value_heads,
        max_position_embeddings=1024,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 10_000.0, "partial_rotary_factor": 0.25,
                         "mrope_section": mrope, "mrope_interleaved": True},
        tie_word_embeddings=False,
        pad_token_id=ids[ENDOFTEXT],
        bos_token_id=ids[ENDOFTEXT],
        eos_token_id=ids[IM_END],
    )
    vision = dict(
        depth=size.vision_depth,
        hidden_size=size.vision_hidden,
        intermediate_size=size.vision_intermediate,
        num_heads=size.vision_heads,
        patch_size=16,
        spatial_merge_size=2,
        temporal_patch_size=2,
        out_hidden_size=size.text_hidden,
        num_position_embeddings=size.vision_pos_grid ** 2,
    )
    return Qwen3_5Config(
        text_config=text,
        vision_config=vision,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False,
        architectures=["Qwen3_5ForConditionalGeneration"],
        dtype="float32",
    )


def write_preprocessor_config(out_dir: Path, size: ModelSize) -> None:
    """preprocessor_config.json: Qwen's image processor with patch 16, merge 2, mean/std 0.5."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    factor = 32
    Qwen2VLImageProcessorPil(
        patch_size=16,
        merge_size=2,
        temporal_patch_size=2,
        min_pixels=size.min_merged_tokens * factor * factor,
        max_pixels=size.max_merged_tokens * factor * factor,
        image_mean=[0.5, 0.5, 0.5],
        image_std=[0.5, 0.5, 0.5],
    ).save_pretrained(str(out_dir))


def generation_config(tokenizer: Any) -> Any:
    from transformers import GenerationConfig

    end = tokenizer.convert_tokens_to_ids(ENDOFTEXT)
    return GenerationConfig(bos_token_id=end, eos_token_id=[tokenizer.convert_tokens_to_ids(IM_END), end],
                            pad_token_id=end, do_sample=False)


def size_dict(size: ModelSize) -> dict[str, Any]:
    return asdict(size)
