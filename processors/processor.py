"""`Processor`: chat messages (or prompt + images) -> token ids + preprocessed images.

The flow matches transformers' Qwen-VL processors: render the chat template to text (one
`<|vision_start|><|image_pad|><|vision_end|>` per image), preprocess every image, expand its
`<|image_pad|>` to t*h*w // merge**2 copies and tokenize without adding special tokens. Here the
text is tokenized with one pad per image and the pad ids are expanded afterwards (same ids: the pad
is a special token, matched before any BPE, so N copies in the text tokenize to N pad ids).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import torch
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from processors.chat import ImageRef, parse_messages
from processors.image_io import describe_source, load_image
from processors.image_processor import ImageProcessor, ImageProcessorConfig, ProcessedImage
from processors.limits import InputError, ProcessorLimits, check_image_count

IMAGE_PAD = "<|image_pad|>"
VIDEO_PAD = "<|video_pad|>"
VISION_START = "<|vision_start|>"
VISION_END = "<|vision_end|>"


@dataclass
class MMItem:
    """One image of a prompt.

    hash: content hash of the preprocessed pixels (encoder-cache / prefix-cache key).
    offset: index in token_ids of the image's first `<|image_pad|>` token.
    length: number of `<|image_pad|>` tokens (= grid t*h*w // merge**2 = rows of its embedding).
    pixel_values: [t*h*w, 3*T*P*P] float32.
    grid_thw: (t, h, w) in patches.
    """

    hash: str
    offset: int
    length: int
    pixel_values: torch.Tensor
    grid_thw: tuple[int, int, int]


@dataclass
class ProcessedPrompt:
    """token_ids: the full prompt, image placeholders expanded; mm_items in prompt order.

    text: the rendered chat template (one `<|image_pad|>` per image), for logging / debugging.
    """

    token_ids: list[int]
    mm_items: list[MMItem] = field(default_factory=list)
    text: str = ""


@dataclass(frozen=True)
class VisionTokenIds:
    image_pad: int
    vision_start: int
    vision_end: int
    video_pad: int | None = None


class Processor:
    """Input processing for one checkpoint: tokenizer, chat template, image processor, limits."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, chat_template: str | None,
                 image_processor: ImageProcessor | None, limits: ProcessorLimits | None = None,
                 device: str | torch.device = "cpu", source: str = "") -> None:
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.image_processor = image_processor
        self.limits = limits or ProcessorLimits()
        self.device = torch.device(device)
        self.source = source
        self.vision_token_ids = _vision_token_ids(tokenizer, required=image_processor is not None)
        self._forbidden_text = tuple(t for t in (IMAGE_PAD, VIDEO_PAD) if _token_id(tokenizer, t) is not None)

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, limits: ProcessorLimits | None = None, *,
                        device: str | torch.device = "cpu", image_backend: str = "auto") -> "Processor":
        """Load from a local checkpoint directory.

        chat template: `chat_template.jinja`, else `chat_template.json`, else the tokenizer config.
        image processor: `preprocessor_config.json` (or `processor_config.json`); a checkpoint
        without one is text-only and any image given to it is an InputError.
        image_backend: "auto" | "torchvision" | "pil" (`ImageProcessor`).
        """
        path = os.fspath(path)
        if not os.path.isdir(path):
            raise FileNotFoundError(f"processor: {path!r} is not a checkpoint directory")
        tokenizer = AutoTokenizer.from_pretrained(path)
        config = ImageProcessorConfig.from_pretrained(path)
        return cls(
            tokenizer,
            _read_chat_template(path, tokenizer),
            ImageProcessor(config, image_backend) if config is not None else None,
            limits,
            device=device,
            source=path,
        )

    # ----------------------------------------------------------------------------------------

    @property
    def image_token_id(self) -> int | None:
        return self.vision_token_ids.image_pad if self.vision_token_ids else None

    @property
    def supports_images(self) -> bool:
        return self.image_processor is not None

    def process_prompt(self, text: str, images: Sequence[Any] = (), *,
                       add_generation_prompt: bool = True,
                       device: str | torch.device | None = None) -> ProcessedPrompt:
        """One user turn: the images first (in order), then the text.

        An element of `images` may also be an image item dict (with sizing options), e.g.
        {"image": src, "max_pixels": 200_000}.
        """
        if not isinstance(text, str):
            raise InputError(f"prompt must be a string, got {type(text).__name__}")
        if isinstance(images, (str, bytes)) or not isinstance(images, Sequence):
            images = [images]  # a single image passed bare
        content: list[dict[str, Any]] = []
        for image in images:
            if isinstance(image, Mapping):
                content.append({"type": "image", **image})
            else:
                content.append({"type": "image", "image": image})
        content.append({"type": "text", "text": text})
        return self.process_chat([{"role": "user", "content": content}],
                                 add_generation_prompt=add_generation_prompt, device=device)

    def process_chat(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True, *,
                     tools: list[dict[str, Any]] | None = None,
                     chat_template_kwargs: Mapping[str, Any] | None = None,
                     device: str | torch.device | None = None) -> ProcessedPrompt:
        """Render `messages` with the chat template, preprocess their images, tokenize.

        chat_template_kwargs: extra template variables (e.g. {"enable_thinking": False}).
        Raises InputError for bad messages or images.
        """
        template_messages, refs = parse_messages(messages, self._forbidden_text)
        check_image_count(len(refs), self.limits)
        if refs and self.image_processor is None:
            raise InputError("this model does not accept images (text-only checkpoint: no preprocessor_config.json)")
        text = self.render(template_messages, add_generation_prompt, tools=tools,
                           chat_template_kwargs=chat_template_kwargs)
        n_placeholders = text.count(IMAGE_PAD)
        if n_placeholders != len(refs):
            raise InputError(
                f"the chat template wrote {n_placeholders} image placeholders for {len(refs)} images "
                "(does this template support images in these messages?)"
            )
        processed = [self._process_image(ref, k, device) for k, ref in enumerate(refs)]
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        return self._expand(ids, processed, text)

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, *,
               tools: list[dict[str, Any]] | None = None,
               chat_template_kwargs: Mapping[str, Any] | None = None) -> str:
        """The chat template applied to already-parsed messages (images as {"type": "image"})."""
        if self.chat_template is None:
            raise ValueError(
                f"checkpoint {self.source!r} has no chat template (looked for chat_template.jinja, "
                "chat_template.json and tokenizer_config.json 'chat_template')"
            )
        kwargs = dict(chat_template_kwargs or {})
        try:
            return self.tokenizer.apply_chat_template(
                messages, tools=tools, chat_template=self.chat_template,
                add_generation_prompt=add_generation_prompt, tokenize=False, **kwargs,
            )
        except InputError:
            raise
        except Exception as exc:  # jinja raise_exception(...) for bad roles / orders, undefined fields
            raise InputError(f"the chat template rejected the messages: {exc}") from None

    def process_image(self, source: Any, *, min_pixels: int | None = None, max_pixels: int | None = None,
                      resized_height: int | None = None, resized_width: int | None = None,
                      device: str | torch.device | None = None) -> ProcessedImage:
        """Load and preprocess one image (no tokens)."""
        ref = ImageRef(source, min_pixels, max_pixels, resized_height, resized_width)
        if self.image_processor is None:
            raise InputError("this model does not accept images (text-only checkpoint: no preprocessor_config.json)")
        return self._process_image(ref, 0, device, single=True)

    # ----------------------------------------------------------------------------------------

    def _process_image(self, ref: ImageRef, index: int, device: str | torch.device | None,
                       single: bool = False) -> ProcessedImage:
        assert self.image_processor is not None
        try:
            image = load_image(ref.source, self.limits)
            return self.image_processor.preprocess(image, device=device or self.device, **ref.size_options())
        except InputError as exc:
            if single:
                raise
            raise InputError(f"image {index + 1} ({describe_source(ref.source)}): {exc}") from None

    def _expand(self, ids: list[int], images: list[ProcessedImage], text: str) -> ProcessedPrompt:
        """Replace the k-th `<|image_pad|>` id by num_tokens(image k) copies; record MMItems."""
        if not images:
            return ProcessedPrompt(token_ids=list(ids), mm_items=[], text=text)
        assert self.vision_token_ids is not None and self.image_processor is not None
        pad = self.vision_token_ids.image_pad
        out: list[int] = []
        items: list[MMItem] = []
        k = 0
        for tok in ids:
            if tok != pad:
                out.append(tok)
                continue
            if k >= len(images):
                raise InputError("more image placeholder tokens than images in the prompt")
            image = images[k]
            length = self.image_processor.num_tokens(image.grid_thw)
            items.append(MMItem(hash=image.hash, offset=len(out), length=length,
                                pixel_values=image.pixel_values, grid_thw=image.grid_thw))
            out.extend([pad] * length)
            k += 1
        if k != len(images):
            raise InputError(f"the tokenized prompt has {k} image placeholders for {len(images)} images")
        return ProcessedPrompt(token_ids=out, mm_items=items, text=text)


def _token_id(tokenizer: PreTrainedTokenizerBase, token: str) -> int | None:
    """Id of `token` if the tokenizer has it as a single token, else None."""
    tid = tokenizer.convert_tokens_to_ids(token)
    if tid is None or (isinstance(tid, int) and tid < 0):
        return None
    if tokenizer.unk_token_id is not None and tid == tokenizer.unk_token_id and token != tokenizer.unk_token:
        return None
    return int(tid)


def _vision_token_ids(tokenizer: PreTrainedTokenizerBase, required: bool) -> VisionTokenIds | None:
    ids = {name: _token_id(tokenizer, tok) for name, tok in
           (("image_pad", IMAGE_PAD), ("vision_start", VISION_START), ("vision_end", VISION_END))}
    missing = [name for name, tid in ids.items() if tid is None]
    if missing:
        if required:
            raise ValueError(f"the tokenizer of this vision-language checkpoint lacks the tokens {missing}")
        return None
    return VisionTokenIds(video_pad=_token_id(tokenizer, VIDEO_PAD), **ids)  # type: ignore[arg-type]


def _read_chat_template(path: str, tokenizer: PreTrainedTokenizerBase) -> str | None:
    jinja = os.path.join(path, "chat_template.jinja")
    if os.path.isfile(jinja):
        with open(jinja, encoding="utf-8") as fh:
            return fh.read()
    js = os.path.join(path, "chat_template.json")
    if os.path.isfile(js):
        with open(js, encoding="utf-8") as fh:
            template = json.load(fh).get("chat_template")
        if isinstance(template, str) and template:
            return template
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # named templates: use the default one
        template = template.get("default")
    elif isinstance(template, list):  # the serialized list-of-{name, template} form
        template = next((t.get("template") for t in template if t.get("name") == "default"), None)
    return template if isinstance(template, str) and template else None
