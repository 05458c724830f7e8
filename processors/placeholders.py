"""Vision placeholder tokens: their ids in a tokenizer, and each media item's one pad expanded to its run.

The rendered chat text holds one `<|image_pad|>` (`<|video_pad|>`) per image (video, or temporal
group of a video); tokenized, that is one pad id each (the pad is a special token, matched before
any BPE). `expand_placeholders` turns the k-th pad of a kind into t*h*w // merge**2 copies, one per
row of the k-th `MediaPiece`'s embedding, and records an `MMItem` for the run.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers import PreTrainedTokenizerBase

from vlmrun.processors.limits import InputError

IMAGE_PAD = "<|image_pad|>"
VIDEO_PAD = "<|video_pad|>"
VISION_START = "<|vision_start|>"
VISION_END = "<|vision_end|>"


@dataclass
class MMItem:
    """One image (or video, or temporal group of a video) of a prompt: one run of pad tokens.

    hash: content hash of the preprocessed pixels (encoder-cache / prefix-cache key).
    offset: index in token_ids of the item's first pad token.
    length: number of pad tokens (= grid t*h*w // merge**2 = rows of its embedding).
    pixel_values: [t*h*w, 3*T*P*P] float32; None once the engine has encoded the item (its embedding
        then stays pinned in the engine's encoder cache while the item lives: `vlmrun.multimodal.vision_stage`).
    grid_thw: (t, h, w) in patches.
    kind: "image" or "video".
    second_per_grid_t: seconds per temporal group of a "qwen2"-style video (its temporal M-RoPE
        step is this times the model's tokens_per_second); None for images and "qwen3" videos.
    """

    hash: str
    offset: int
    length: int
    pixel_values: torch.Tensor | None
    grid_thw: tuple[int, int, int]
    kind: str = "image"
    second_per_grid_t: float | None = None


@dataclass
class ProcessedPrompt:
    """token_ids: the full prompt, image placeholders expanded; mm_items in prompt order.

    text: the rendered chat template (one `<|image_pad|>` per image), for logging / debugging.
    cache_salt: vLLM's per-prompt prefix-cache salt: pages cached under one salt serve only prompts of
    that salt (None: no salt; vlmrun/cache/prefix_cache.py).
    """

    token_ids: list[int]
    mm_items: list[MMItem] = field(default_factory=list)
    text: str = ""
    cache_salt: str | None = None


@dataclass
class MediaPiece:
    """What one pad token of the rendered text stands for, before expansion."""

    pixel_values: torch.Tensor
    grid_thw: tuple[int, int, int]
    hash: str
    kind: str
    second_per_grid_t: float | None = None


@dataclass(frozen=True)
class VisionTokenIds:
    """The tokenizer's ids of the vision tokens (`video_pad` None where the tokenizer has none)."""

    image_pad: int
    vision_start: int
    vision_end: int
    video_pad: int | None = None


def expand_placeholders(ids: list[int], pieces: dict[str, list[MediaPiece]], text: str,
                        pad_ids: VisionTokenIds | None, merge_size: int) -> ProcessedPrompt:
    """Replace the k-th image (video) pad id by the k-th image (video) piece's tokens; record MMItems."""
    if not pieces["image"] and not pieces["video"]:
        return ProcessedPrompt(token_ids=list(ids), mm_items=[], text=text)
    assert pad_ids is not None
    pads = {pad_ids.image_pad: "image", pad_ids.video_pad: "video"}
    out: list[int] = []
    items: list[MMItem] = []
    used = {"image": 0, "video": 0}
    for tok in ids:
        kind = pads.get(tok)
        if kind is None:
            out.append(tok)
            continue
        if used[kind] >= len(pieces[kind]):
            raise InputError(f"more {kind} placeholder tokens than {kind}s in the prompt")
        piece = pieces[kind][used[kind]]
        t, h, w = piece.grid_thw
        length = t * h * w // merge_size**2
        items.append(MMItem(hash=piece.hash, offset=len(out), length=length, pixel_values=piece.pixel_values,
                            grid_thw=piece.grid_thw, kind=kind, second_per_grid_t=piece.second_per_grid_t))
        out.extend([tok] * length)
        used[kind] += 1
    for kind, n in used.items():
        if n != len(pieces[kind]):
            raise InputError(f"the tokenized prompt has {n} {kind} placeholders for {len(pieces[kind])} {kind}s")
    return ProcessedPrompt(token_ids=out, mm_items=items, text=text)


def find_token_id(tokenizer: PreTrainedTokenizerBase, token: str) -> int | None:
    """Id of `token` if the tokenizer has it as a single token, else None."""
    tid = tokenizer.convert_tokens_to_ids(token)
    if tid is None or (isinstance(tid, int) and tid < 0):
        return None
    if tokenizer.unk_token_id is not None and tid == tokenizer.unk_token_id and token != tokenizer.unk_token:
        return None
    return int(tid)


def find_vision_token_ids(tokenizer: PreTrainedTokenizerBase, required: bool) -> VisionTokenIds | None:
    """The vision token ids; None for a text-only tokenizer (a ValueError if `required`)."""
    ids = {name: find_token_id(tokenizer, tok) for name, tok in
           (("image_pad", IMAGE_PAD), ("vision_start", VISION_START), ("vision_end", VISION_END))}
    missing = [name for name, tid in ids.items() if tid is None]
    if missing:
        if required:
            raise ValueError(f"the tokenizer of this vision-language checkpoint lacks the tokens {missing}")
        return None
    return VisionTokenIds(video_pad=find_token_id(tokenizer, VIDEO_PAD), **ids)  # type: ignore[arg-type]
