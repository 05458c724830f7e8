"""Input processing for the Qwen VL families: image loading and limits, resize + patchify (torch,
CPU or GPU), chat templates and image placeholder expansion.

Entry point: `Processor.from_pretrained(checkpoint_dir, limits=ProcessorLimits())`, then
`process_chat(messages)` or `process_prompt(text, images)` -> `ProcessedPrompt(token_ids, mm_items)`.
Bad input raises `InputError` (a ValueError) with a message naming the problem.
"""

from processors.image_io import load_image
from processors.image_processor import (
    ImageProcessor,
    ImageProcessorConfig,
    ProcessedImage,
    smart_resize,
)
from processors.limits import InputError, ProcessorLimits
from processors.pixel_backends import IMAGE_BACKENDS, resolve_image_backend
from processors.processor import MMItem, ProcessedPrompt, Processor

__all__ = [
    "InputError",
    "ProcessorLimits",
    "Processor",
    "ProcessedPrompt",
    "MMItem",
    "load_image",
    "smart_resize",
    "ImageProcessor",
    "ImageProcessorConfig",
    "ProcessedImage",
    "IMAGE_BACKENDS",
    "resolve_image_backend",
]
