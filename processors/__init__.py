"""Input processing for the Qwen VL families: image and video loading and limits, frame sampling,
resize + patchify (torch, CPU or GPU), chat templates and placeholder expansion.

Entry point: `Processor.from_pretrained(checkpoint_dir, limits=ProcessorLimits())`, then
`process_chat(messages)` or `process_prompt(text, images)` -> `ProcessedPrompt(token_ids, mm_items)`.
Bad input raises `InputError` (a ValueError) with a message naming the problem.
"""

from vlmrun.processors.image_io import load_image
from vlmrun.processors.image_processor import (
    ImageProcessor,
    ImageProcessorConfig,
    ProcessedImage,
    smart_resize,
)
from vlmrun.processors.limits import InputError, ProcessorLimits
from vlmrun.processors.pixel_backends import IMAGE_BACKENDS, resolve_image_backend
from vlmrun.processors.placeholders import MMItem, ProcessedPrompt
from vlmrun.processors.processor import Processor
from vlmrun.processors.video_config import VideoProcessorConfig
from vlmrun.processors.video_io import video_decoder
from vlmrun.processors.video_processor import ProcessedVideo, VideoOptions, VideoProcessor

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
    "VideoProcessor",
    "VideoProcessorConfig",
    "VideoOptions",
    "ProcessedVideo",
    "video_decoder",
]
