"""`Processor`: chat messages (or prompt + images / videos) -> token ids + preprocessed media.

The flow matches transformers' Qwen-VL processors: render the chat template to text (one
`<|vision_start|><|image_pad|><|vision_end|>` per image, `<|video_pad|>` likewise per video),
preprocess every image and video, expand each pad to t*h*w // merge**2 copies and tokenize without
adding special tokens. Here the text is tokenized with one pad per item and the pad ids are
expanded afterwards (same ids: the pad is a special token, matched before any BPE, so N copies in
the text tokenize to N pad ids).

Videos in a "qwen3" prompt (the checkpoint's processor class is `Qwen3VLProcessor`: Qwen3-VL,
Qwen3.5) first have their one `<|video_pad|>` replaced in the text by
`<t seconds><|vision_start|><|video_pad|><|vision_end|>` per temporal group, as `Qwen3VLProcessor`
writes it; each group is then its own MMItem of grid (1, h, w) (the vision towers attend within a
temporal group only, so encoding the groups apart gives the same rows). The prompt style follows the
processor class and the frames follow the video processor class, each found as transformers'
`AutoProcessor` / `AutoVideoProcessor` find them (`video_prompt_style`, `VideoProcessorConfig`).
"""

from __future__ import annotations

import json
import os
import threading
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import torch
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from vlmrun.processors.chat import ImageRef, VideoRef, check_unicode, parse_messages
from vlmrun.processors.image_io import OpenedImage, describe_source, open_image
from vlmrun.processors.image_processor import ImageProcessor, ImageProcessorConfig, ProcessedImage
from vlmrun.processors.limits import InputError, ProcessorLimits, check_image_count, check_video_tokens
from vlmrun.processors.video_config import VideoProcessorConfig, read_json, video_style
from vlmrun.processors.video_processor import ProcessedVideo, VideoOptions, VideoProcessor

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
    pixel_values: [t*h*w, 3*T*P*P] float32.
    grid_thw: (t, h, w) in patches.
    kind: "image" or "video".
    second_per_grid_t: seconds per temporal group of a "qwen2"-style video (its temporal M-RoPE
        step is this times the model's tokens_per_second); None for images and "qwen3" videos.
    """

    hash: str
    offset: int
    length: int
    pixel_values: torch.Tensor
    grid_thw: tuple[int, int, int]
    kind: str = "image"
    second_per_grid_t: float | None = None


@dataclass
class _Piece:
    """What one pad token of the rendered text stands for, before expansion."""

    pixel_values: torch.Tensor
    grid_thw: tuple[int, int, int]
    hash: str
    kind: str
    second_per_grid_t: float | None = None


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
                 device: str | torch.device = "cpu", source: str = "",
                 video_processor: VideoProcessor | None = None, video_prompt: str = "qwen3") -> None:
        self.tokenizer = tokenizer
        self.video_prompt = video_prompt  # "qwen3": timestamped groups (Qwen3VLProcessor); "qwen2": one run
        self.chat_template = chat_template
        self.image_processor = image_processor
        self.video_processor = video_processor
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
        model_style = video_style(_model_type(path))
        video_config = VideoProcessorConfig.from_pretrained(path, model_style) if config else None
        return cls(
            tokenizer,
            _read_chat_template(path, tokenizer),
            ImageProcessor(config, image_backend) if config is not None else None,
            limits,
            device=device,
            source=path,
            video_processor=VideoProcessor(video_config) if video_config is not None else None,
            video_prompt=video_prompt_style(path, model_style),
        )

    # ----------------------------------------------------------------------------------------

    @property
    def image_token_id(self) -> int | None:
        return self.vision_token_ids.image_pad if self.vision_token_ids else None

    @property
    def supports_images(self) -> bool:
        return self.image_processor is not None

    def process_prompt(self, text: str, images: Sequence[Any] = (), *, videos: Sequence[Any] = (),
                       add_generation_prompt: bool = True,
                       device: str | torch.device | None = None) -> ProcessedPrompt:
        """One user turn: the images first (in order), then the videos, then the text.

        An element of `images` may also be an image item dict (with sizing options), e.g.
        {"image": src, "max_pixels": 200_000}; of `videos`, a video item dict, e.g.
        {"video": path, "fps": 1.0}. A bare video is a path / URL / bytes or an array [T, H, W, 3];
        a list of frames must come as {"video": [...]} (a bare list is a list of videos).
        """
        if not isinstance(text, str):
            raise InputError(f"prompt must be a string, got {type(text).__name__}")
        content = _media_items("image", images) + _media_items("video", videos)
        content.append({"type": "text", "text": text})
        return self.process_chat([{"role": "user", "content": content}],
                                 add_generation_prompt=add_generation_prompt, device=device)

    def process_chat(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True, *,
                     tools: list[dict[str, Any]] | None = None,
                     chat_template_kwargs: Mapping[str, Any] | None = None,
                     device: str | torch.device | None = None,
                     cancel: threading.Event | None = None) -> ProcessedPrompt:
        """Render `messages` with the chat template, preprocess their images, tokenize.

        chat_template_kwargs: extra template variables (e.g. {"enable_thinking": False}).
        cancel: once set (the client left), the work stops before the next image or video (InputError).
        Raises InputError for bad messages or images.
        """
        template_messages, refs = parse_messages(messages, self._forbidden_text)
        image_refs = [r for r in refs if isinstance(r, ImageRef)]
        video_refs = [r for r in refs if isinstance(r, VideoRef)]
        check_image_count(len(refs), self.limits)
        if image_refs and self.image_processor is None:
            raise InputError("this model does not accept images (text-only checkpoint: no preprocessor_config.json)")
        if video_refs and (self.video_processor is None or self.vision_token_ids.video_pad is None):
            raise InputError("this model does not accept videos")
        text = self.render(template_messages, add_generation_prompt, tools=tools,
                           chat_template_kwargs=chat_template_kwargs)
        for pad, n, what in ((IMAGE_PAD, len(image_refs), "image"), (VIDEO_PAD, len(video_refs), "video")):
            if text.count(pad) != n:
                raise InputError(
                    f"the chat template wrote {text.count(pad)} {what} placeholders for {n} {what}s "
                    f"(does this template support {what}s in these messages?)"
                )
        opened = [self._open_image(ref, k) for k, ref in enumerate(image_refs)]  # bytes and headers only
        self._check_image_tokens(opened, image_refs)
        images = [self._process_image(image, ref, k, device, cancel)
                  for k, (image, ref) in enumerate(zip(opened, image_refs))]
        videos = self._process_videos(video_refs, cancel)
        text = self._write_video_timestamps(text, videos)
        check_unicode(text, "the prompt")  # what no message check saw: tools, template variables
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        target = device or self.device
        pieces = {"image": [_Piece(im.pixel_values, im.grid_thw, im.hash, "image") for im in images],
                  "video": [p for v in videos for p in self._video_pieces(v, target)]}
        return self._expand(ids, pieces, text)

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

    # ----------------------------------------------------------------------------------------

    def _open_image(self, ref: ImageRef, index: int) -> OpenedImage:
        try:
            return open_image(ref.source, self.limits)
        except InputError as exc:
            raise _image_error(exc, ref, index) from None

    def _check_image_tokens(self, opened: list[OpenedImage], refs: list[ImageRef]) -> None:
        """InputError, before any image is decoded, when an image's options resize it past
        `limits.max_image_pixels`, or the images alone need more tokens than a prompt may have
        (`limits.max_prompt_tokens`): their sizes come from the headers."""
        if not opened:
            return
        assert self.image_processor is not None
        total = 0
        for k, (image, ref) in enumerate(zip(opened, refs)):
            try:
                first, size = self.image_processor.plan(*image.size, **ref.size_options())
                if first is not None and first[0] * first[1] > self.limits.max_image_pixels:
                    raise InputError(f"its options resize it to {first[1]}x{first[0]} = {first[0] * first[1]:,} "
                                     f"pixels, more than the limit of {self.limits.max_image_pixels:,}")
                total += self.image_processor.num_tokens(self.image_processor.grid(size))
            except InputError as exc:
                raise _image_error(exc, ref, k) from None
        limit = self.limits.max_prompt_tokens
        if limit is not None and total > limit:
            raise InputError(f"the {len(opened)} image(s) of this request need {total:,} tokens, more than a prompt "
                             f"may have ({limit:,}); refused before any was decoded")

    def _process_image(self, image: OpenedImage, ref: ImageRef, index: int, device: str | torch.device | None,
                       cancel: threading.Event | None = None) -> ProcessedImage:
        assert self.image_processor is not None
        _stop_if_cancelled(cancel)
        try:
            return self.image_processor.preprocess(image.decode(), device=device or self.device,
                                                   **ref.size_options())
        except InputError as exc:
            raise _image_error(exc, ref, index) from None

    def _process_videos(self, refs: list[VideoRef], cancel: threading.Event | None = None) -> list[ProcessedVideo]:
        if not refs:
            return []
        assert self.video_processor is not None
        videos: list[ProcessedVideo] = []
        tokens = 0
        for k, ref in enumerate(refs):
            _stop_if_cancelled(cancel)
            try:
                video = self.video_processor.preprocess(ref.source, self.limits, VideoOptions(**ref.options),
                                                        max_tokens=self.limits.max_video_tokens - tokens)
            except InputError as exc:
                raise InputError(f"video {k + 1} ({describe_source(ref.source)}): {exc}") from None
            tokens += self.video_processor.num_tokens(video.grid_thw)
            check_video_tokens(tokens, self.limits)
            videos.append(video)
        return videos

    def _write_video_timestamps(self, text: str, videos: list[ProcessedVideo]) -> str:
        """qwen3 style: each video's pad becomes `<t seconds><|vision_start|><|video_pad|><|vision_end|>`
        per temporal group (as `Qwen3VLProcessor.replace_video_token` writes it, one pad per group here)."""
        if not videos or self.video_prompt != "qwen3":
            return text
        parts = text.split(VIDEO_PAD)
        out = [parts[0]]
        for video, rest in zip(videos, parts[1:]):
            out.extend(f"<{t:.1f} seconds>{VISION_START}{VIDEO_PAD}{VISION_END}" for t in video.timestamps)
            out.append(rest)
        return "".join(out)

    def _video_pieces(self, video: ProcessedVideo, device: str | torch.device) -> list[_Piece]:
        """qwen2 prompt: the whole video is one piece; qwen3 prompt: one piece per temporal group."""
        pixels = video.pixel_values.to(device)
        if self.video_prompt != "qwen3":
            return [_Piece(pixels, video.grid_thw, video.hash, "video", video.second_per_grid_t)]
        t, h, w = video.grid_thw
        return [_Piece(pixels[k * h * w:(k + 1) * h * w], (1, h, w), f"{video.hash}:{k}", "video")
                for k in range(t)]

    def _expand(self, ids: list[int], pieces: dict[str, list[_Piece]], text: str) -> ProcessedPrompt:
        """Replace the k-th image (video) pad id by the k-th image (video) piece's tokens; record MMItems."""
        if not pieces["image"] and not pieces["video"]:
            return ProcessedPrompt(token_ids=list(ids), mm_items=[], text=text)
        assert self.vision_token_ids is not None
        pads = {self.vision_token_ids.image_pad: "image", self.vision_token_ids.video_pad: "video"}
        merge = (self.image_processor or self.video_processor).config.merge_size  # type: ignore[union-attr]
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
            length = t * h * w // merge**2
            items.append(MMItem(hash=piece.hash, offset=len(out), length=length, pixel_values=piece.pixel_values,
                                grid_thw=piece.grid_thw, kind=kind, second_per_grid_t=piece.second_per_grid_t))
            out.extend([tok] * length)
            used[kind] += 1
        for kind, n in used.items():
            if n != len(pieces[kind]):
                raise InputError(f"the tokenized prompt has {n} {kind} placeholders for {len(pieces[kind])} {kind}s")
        return ProcessedPrompt(token_ids=out, mm_items=items, text=text)


def _image_error(exc: InputError, ref: ImageRef, index: int) -> InputError:
    return InputError(f"image {index + 1} ({describe_source(ref.source)}): {exc}")


def _stop_if_cancelled(cancel: threading.Event | None) -> None:
    if cancel is not None and cancel.is_set():
        raise InputError("cancelled: the request's client has gone")


def _media_items(kind: str, sources: Any) -> list[dict[str, Any]]:
    """Chat items of one kind for `process_prompt`: one bare source, or a list of sources / item dicts."""
    if sources is None:
        return []
    if isinstance(sources, (str, bytes)) or not isinstance(sources, Sequence):
        sources = [sources]  # one item passed bare (a path, bytes, an array, a PIL image)
    return [{"type": kind, **s} if isinstance(s, Mapping) else {"type": kind, kind: s} for s in sources]


def _model_type(path: str) -> str | None:
    return _json_field(path, "config.json", "model_type")


def video_prompt_style(path: str, model_style: str) -> str:
    """How the checkpoint's processor class writes videos into the prompt: "qwen3" (`Qwen3VLProcessor`:
    timestamped groups) or "qwen2" (`Qwen2VLProcessor`, `Qwen2_5_VLProcessor`: one run of pads).

    The class is found where `AutoProcessor` looks: `processor_config.json`, `preprocessor_config.json`
    (`video_preprocessor_config.json` only without it), `tokenizer_config.json`, `config.json`; else the
    model type decides (`model_style`)."""
    has_image_config = os.path.isfile(os.path.join(path, "preprocessor_config.json"))
    files = ("processor_config.json", "preprocessor_config.json" if has_image_config else
             "video_preprocessor_config.json", "tokenizer_config.json", "config.json")
    for name in files:
        named = _json_field(path, name, "processor_class")
        if named is not None:
            if str(named).startswith("Qwen3VL"):
                return "qwen3"
            if str(named).startswith(("Qwen2VL", "Qwen2_5_VL")):
                return "qwen2"
            break
    return model_style


def _json_field(path: str, name: str, key: str) -> Any:
    """`key` of the JSON object in file `name` of the checkpoint, None when either is missing."""
    data = read_json(os.path.join(path, name))
    return data.get(key) if isinstance(data, dict) else None


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
