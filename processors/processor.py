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
`AutoProcessor` / `AutoVideoProcessor` find them (`processor_files.video_prompt_style`,
`VideoProcessorConfig`); where the checkpoint's files name no class, its family's registry line says
(`vlmrun.families`, by config.json's `architectures`). The pad tokens and their expansion are
`placeholders.py`'s.
"""

from __future__ import annotations

import os
import threading
from typing import Any, Mapping, Sequence

import torch
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from vlmrun.families import media_style
from vlmrun.processors.chat import ImageRef, MediaRef, VideoRef, check_unicode, parse_messages
from vlmrun.processors.image_io import OpenedImage, describe_source, open_image
from vlmrun.processors.image_processor import ImageProcessor, ImageProcessorConfig, ProcessedImage
from vlmrun.processors.limits import InputError, ProcessorLimits, check_media_count, check_video_tokens, quote
from vlmrun.processors.placeholders import (IMAGE_PAD, VIDEO_PAD, VISION_END, VISION_START, MediaPiece,
                                            ProcessedPrompt, expand_placeholders, find_token_id,
                                            find_vision_token_ids)
from vlmrun.processors.processor_kwargs import apply_processor_kwargs, check_processor_kwargs
from vlmrun.processors.processor_files import architectures, load_chat_template, read_chat_template, video_prompt_style
from vlmrun.processors.video_config import VideoProcessorConfig
from vlmrun.processors.video_processor import ProcessedVideo, VideoOptions, VideoProcessor, is_frames_with_metadata


class Processor:
    """Input processing for one checkpoint: tokenizer, chat template, image processor, limits."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, chat_template: str | None,
                 image_processor: ImageProcessor | None, limits: ProcessorLimits | None = None,
                 device: str | torch.device = "cpu", source: str = "",
                 video_processor: VideoProcessor | None = None, video_prompt: str = "qwen3",
                 mm_processor_kwargs: Mapping[str, Any] | None = None) -> None:
        self.tokenizer = tokenizer
        # options for every image / video that sets none itself and gets none from its call (vLLM's engine-wide
        # mm_processor_kwargs; `processor_kwargs.py`)
        self.mm_processor_kwargs = check_processor_kwargs(mm_processor_kwargs or {})
        self.video_prompt = video_prompt  # "qwen3": timestamped groups (Qwen3VLProcessor); "qwen2": one run
        self.chat_template = chat_template
        self.image_processor = image_processor
        self.video_processor = video_processor
        self.limits = limits or ProcessorLimits()
        self.device = torch.device(device)
        self.source = source
        self.load_args: tuple[str, dict[str, Any]] | None = None  # set by from_pretrained: how to load it again
        self.vision_token_ids = find_vision_token_ids(tokenizer, required=image_processor is not None)
        self._forbidden_text = tuple(t for t in (IMAGE_PAD, VIDEO_PAD) if find_token_id(tokenizer, t) is not None)

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, limits: ProcessorLimits | None = None, *,
                        device: str | torch.device = "cpu", image_backend: str = "auto",
                        chat_template: str | None = None,
                        mm_processor_kwargs: Mapping[str, Any] | None = None) -> "Processor":
        """Load from a local checkpoint directory.

        chat template: `chat_template` when given (a file path or the template itself, `load_chat_template`),
        else `chat_template.jinja`, else `chat_template.json`, else the tokenizer config.
        image processor: `preprocessor_config.json` (or `processor_config.json`); a checkpoint
        without one is text-only and any image given to it is an InputError.
        image_backend: "auto" | "torchvision" | "pil" (`ImageProcessor`).
        """
        path = os.fspath(path)
        if not os.path.isdir(path):
            raise FileNotFoundError(f"processor: {path!r} is not a checkpoint directory")
        tokenizer = AutoTokenizer.from_pretrained(path)
        config = ImageProcessorConfig.from_pretrained(path)
        media = media_style(architectures(path))  # the family's styles, where the checkpoint's files name no class
        video_config = VideoProcessorConfig.from_pretrained(path, media.video) if config else None
        processor = cls(
            tokenizer,
            load_chat_template(chat_template) if chat_template is not None else read_chat_template(path, tokenizer),
            ImageProcessor(config, image_backend) if config is not None else None,
            limits,
            device=device,
            source=path,
            video_processor=VideoProcessor(video_config) if video_config is not None else None,
            video_prompt=video_prompt_style(path, media.prompt),
            mm_processor_kwargs=mm_processor_kwargs,
        )
        processor.load_args = (path, {"limits": limits, "device": str(device), "image_backend": image_backend,
                                      "chat_template": chat_template,
                                      "mm_processor_kwargs": dict(mm_processor_kwargs or {})})
        return processor

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        """Pickled as how it was loaded (a preprocessing worker process loads its own copy once): the
        checkpoint folder and `from_pretrained`'s options; TypeError for one not made by `from_pretrained`."""
        if self.load_args is None:
            raise TypeError("only a Processor made by Processor.from_pretrained can be pickled (it is sent as "
                            "its checkpoint folder and options)")
        return _load_processor, self.load_args

    # ----------------------------------------------------------------------------------------

    @property
    def image_token_id(self) -> int | None:
        return self.vision_token_ids.image_pad if self.vision_token_ids else None

    @property
    def supports_images(self) -> bool:
        return self.image_processor is not None

    def process_prompt(self, text: str, images: Sequence[Any] = (), *, videos: Sequence[Any] = (),
                       add_generation_prompt: bool = True, mm_processor_kwargs: Mapping[str, Any] | None = None,
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
        return self.process_chat([{"role": "user", "content": content}], add_generation_prompt=add_generation_prompt,
                                 mm_processor_kwargs=mm_processor_kwargs, device=device)

    def process_chat(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True, *,
                     tools: list[dict[str, Any]] | None = None,
                     chat_template_kwargs: Mapping[str, Any] | None = None,
                     chat_template: str | None = None,
                     continue_final_message: bool = False,
                     mm_processor_kwargs: Mapping[str, Any] | None = None,
                     device: str | torch.device | None = None,
                     cancel: threading.Event | None = None) -> ProcessedPrompt:
        """Render `messages` with the chat template, preprocess their images, tokenize.

        chat_template_kwargs: extra template variables (e.g. {"enable_thinking": False}).
        chat_template: a template used instead of the checkpoint's (a file path or the template itself).
        continue_final_message: the last message (the assistant's) is left open for the model to continue
            (no end-of-turn after it); not together with add_generation_prompt (vLLM's rule).
        mm_processor_kwargs: options for every image / video without its own (`processor_kwargs.py`).
        cancel: once set (the client left), the work stops before the next image or video (InputError).
        Raises InputError for bad messages or images.
        """
        check_continuation(add_generation_prompt, continue_final_message)
        template_messages, refs = parse_messages(messages, self._forbidden_text)
        apply_processor_kwargs(refs, mm_processor_kwargs)
        image_refs, video_refs = self._check_media(refs)
        text = self.render(template_messages, add_generation_prompt, tools=tools,
                           chat_template_kwargs=chat_template_kwargs, chat_template=chat_template,
                           continue_final_message=continue_final_message)
        for pad, n, what in ((IMAGE_PAD, len(image_refs), "image"), (VIDEO_PAD, len(video_refs), "video")):
            if text.count(pad) != n:
                raise InputError(
                    f"the chat template wrote {text.count(pad)} {what} placeholders for {n} {what}s "
                    f"(does this template support {what}s in these messages?)"
                )
        images, videos = self._process_media(image_refs, video_refs, device, cancel)
        text = self._write_video_timestamps(text, videos)
        check_unicode(text, "the prompt")  # what no message check saw: tools, template variables
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        return expand_placeholders(ids, self._pieces(images, videos, device), text, self.vision_token_ids,
                                   self._merge_size())

    def process_raw(self, prompt: str | Sequence[int], images: Sequence[Any] = (), *, videos: Sequence[Any] = (),
                    mm_processor_kwargs: Mapping[str, Any] | None = None,
                    device: str | torch.device | None = None) -> ProcessedPrompt:
        """vLLM's raw prompt: text (tokenized as is, no chat template) or token ids, holding one
        `<|image_pad|>` (`<|video_pad|>`) per image (video), as `<|vision_start|><|image_pad|><|vision_end|>`;
        the k-th placeholder is expanded to the k-th image's tokens. A count that does not match is
        an InputError. Items are given as `process_prompt` takes them.
        """
        _, refs = parse_messages([{"role": "user", "content": _media_items("image", images)
                                   + _media_items("video", videos)}])
        apply_processor_kwargs(refs, mm_processor_kwargs)
        image_refs, video_refs = self._check_media(refs)
        if isinstance(prompt, str):
            check_unicode(prompt, "the prompt")
            counts = {"image": prompt.count(IMAGE_PAD), "video": prompt.count(VIDEO_PAD)}
        else:
            prompt = _token_ids(prompt, self.tokenizer)
            ids = self.vision_token_ids
            counts = {"image": prompt.count(ids.image_pad) if ids else 0,
                      "video": prompt.count(ids.video_pad) if ids and ids.video_pad is not None else 0}
            if video_refs and self.video_prompt == "qwen3":
                raise InputError("videos with prompt_token_ids are not supported by this model's prompt style "
                                 "(its video placeholders carry timestamps): pass the text as 'prompt'")
        for kind, pad, n in (("image", IMAGE_PAD, len(image_refs)), ("video", VIDEO_PAD, len(video_refs))):
            if counts[kind] != n:
                raise InputError(f"the prompt has {counts[kind]} {pad} placeholders for {n} {kind}s (write "
                                 f"{VISION_START}{pad}{VISION_END} once per {kind}, in order)")
        images, videos = self._process_media(image_refs, video_refs, device, None)
        if isinstance(prompt, str):
            text = self._write_video_timestamps(prompt, videos)
            token_ids = self.tokenizer.encode(text)  # the tokenizer's own special tokens, as vLLM's text prompt
        else:
            text, token_ids = "", prompt
        return expand_placeholders(token_ids, self._pieces(images, videos, device), text, self.vision_token_ids,
                                   self._merge_size())

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, *,
               tools: list[dict[str, Any]] | None = None,
               chat_template_kwargs: Mapping[str, Any] | None = None,
               chat_template: str | None = None, continue_final_message: bool = False) -> str:
        """The chat template (`chat_template` when given, else the checkpoint's) applied to already-parsed
        messages (images as {"type": "image"})."""
        template = load_chat_template(chat_template) if chat_template is not None else self.chat_template
        if template is None:
            raise ValueError(
                f"checkpoint {self.source!r} has no chat template (looked for chat_template.jinja, "
                "chat_template.json and tokenizer_config.json 'chat_template')"
            )
        kwargs = dict(chat_template_kwargs or {})
        try:
            return self.tokenizer.apply_chat_template(
                messages, tools=tools, chat_template=template,
                add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message,
                tokenize=False, **kwargs,
            )
        except InputError:
            raise
        except Exception as exc:  # jinja raise_exception(...) for bad roles / orders, undefined fields
            raise InputError(f"the chat template rejected the messages: {exc}") from None

    # ----------------------------------------------------------------------------------------

    def _check_media(self, refs: list[MediaRef]) -> tuple[list[ImageRef], list[VideoRef]]:
        """The images and the videos of `refs`; InputError past the per-prompt limits or where the model
        takes none."""
        apply_processor_kwargs(refs, self.mm_processor_kwargs)  # after the call's own: those win
        image_refs = [r for r in refs if isinstance(r, ImageRef)]
        video_refs = [r for r in refs if isinstance(r, VideoRef)]
        check_media_count(len(image_refs), len(video_refs), self.limits)
        if image_refs and self.image_processor is None:
            raise InputError("this model does not accept images (text-only checkpoint: no preprocessor_config.json)")
        if video_refs and (self.video_processor is None or self.vision_token_ids.video_pad is None):
            raise InputError("this model does not accept videos")
        return image_refs, video_refs

    def _process_media(self, image_refs: list[ImageRef], video_refs: list[VideoRef],
                       device: str | torch.device | None, cancel: threading.Event | None
                       ) -> tuple[list[ProcessedImage], list[ProcessedVideo]]:
        """Every image (headers checked before any is decoded) and every video, preprocessed."""
        opened = [self._open_image(ref, k) for k, ref in enumerate(image_refs)]  # bytes and headers only
        self._check_image_tokens(opened, image_refs)
        images = [self._process_image(image, ref, k, device, cancel)
                  for k, (image, ref) in enumerate(zip(opened, image_refs))]
        return images, self._process_videos(video_refs, cancel)

    def _pieces(self, images: list[ProcessedImage], videos: list[ProcessedVideo],
                device: str | torch.device | None) -> dict[str, list[MediaPiece]]:
        """What each placeholder of the prompt stands for, per kind, in order."""
        target = device or self.device
        return {"image": [MediaPiece(im.pixel_values, im.grid_thw, im.hash, "image") for im in images],
                "video": [p for v in videos for p in self._video_pieces(v, target)]}

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
                                                        max_tokens=self.limits.video_token_budget - tokens)
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

    def _video_pieces(self, video: ProcessedVideo, device: str | torch.device) -> list[MediaPiece]:
        """qwen2 prompt: the whole video is one piece; qwen3 prompt: one piece per temporal group."""
        pixels = video.pixel_values.to(device)
        if self.video_prompt != "qwen3":
            return [MediaPiece(pixels, video.grid_thw, video.hash, "video", video.second_per_grid_t)]
        t, h, w = video.grid_thw
        return [MediaPiece(pixels[k * h * w:(k + 1) * h * w], (1, h, w), f"{video.hash}:{k}", "video")
                for k in range(t)]

    def _merge_size(self) -> int:
        """Patches merged per token along each side (the vision config's merge_size); 1 without vision."""
        vision = self.image_processor or self.video_processor
        return vision.config.merge_size if vision is not None else 1


def check_continuation(add_generation_prompt: bool, continue_final_message: bool) -> None:
    """vLLM's rule: a reply is either started (add_generation_prompt) or the last message continued."""
    if continue_final_message and add_generation_prompt:
        raise InputError("continue_final_message and add_generation_prompt cannot both be true "
                         "(continue_final_message continues the last message instead of starting a reply)")


def _image_error(exc: InputError, ref: ImageRef, index: int) -> InputError:
    return InputError(f"image {index + 1} ({describe_source(ref.source)}): {exc}")


def _load_processor(path: str, options: dict[str, Any]) -> Processor:
    """`Processor.from_pretrained(path, **options)`: how a pickled Processor is loaded again."""
    return Processor.from_pretrained(path, **options)


def _stop_if_cancelled(cancel: threading.Event | None) -> None:
    if cancel is not None and cancel.is_set():
        raise InputError("cancelled: the request's client has gone")


def _token_ids(ids: Sequence[int], tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """`prompt_token_ids` checked: a non-empty list of ids the tokenizer has."""
    if isinstance(ids, (str, bytes)) or not isinstance(ids, Sequence):
        raise InputError(f"prompt_token_ids must be a list of token ids, got {type(ids).__name__}")
    vocab = len(tokenizer)
    for k, tid in enumerate(ids):
        if isinstance(tid, bool) or not isinstance(tid, int) or not 0 <= tid < vocab:
            raise InputError(f"prompt_token_ids[{k}] = {quote(tid)} is not a token id (0 to {vocab - 1})")
    return list(ids)


def _media_items(kind: str, sources: Any) -> list[dict[str, Any]]:
    """Chat items of one kind for `process_prompt`: one bare source, or a list of sources / item dicts."""
    if sources is None:
        return []
    if isinstance(sources, (str, bytes)) or not isinstance(sources, Sequence) or is_frames_with_metadata(sources):
        sources = [sources]  # one item passed bare (a path, bytes, an array, a PIL image, vLLM's (frames, metadata))
    return [{"type": kind, **s} if isinstance(s, Mapping) else {"type": kind, kind: s} for s in sources]
