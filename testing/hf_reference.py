"""HF transformers as the reference: prompt ids, pixels and greedy generation for a chat.

Builds HF's inputs with HF's default processor for the checkpoint (`AutoProcessor`: chat template,
the image processor transformers picks — the torchvision `Qwen2VLImageProcessor` when torchvision is
installed, else `Qwen2VLImageProcessorPil` — and image placeholder expansion), then runs HF
`generate` greedily (float32 eager attention on CPU unless told otherwise) and returns tokens and
per-step log-softmax. Text-only checkpoints use the tokenizer and its chat template.

Without torchvision, HF's Qwen-VL processors do not load (their video processor needs it); there
the inputs are built as those processors build them — chat template, `AutoImageProcessor` (then
the PIL class), each image pad expanded to t*h*w / merge**2 copies, tokenizer — which is what
vlmrun's "auto" image backend matches in such an environment.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import (AutoConfig, AutoImageProcessor, AutoModelForCausalLM, AutoModelForImageTextToText,
                          AutoProcessor, AutoTokenizer)

from vlmrun.processors.pixel_backends import torchvision_available

IMAGE_PAD = "<|image_pad|>"


@dataclass
class HFResult:
    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[torch.Tensor]  # per generated token: [vocab] log-softmax of the raw logits


class HFReference:
    def __init__(self, model_dir: Path, *, dtype: torch.dtype = torch.float32, device: str = "cpu",
                 attn_implementation: str = "eager"):
        self.dir = Path(model_dir)
        self.device = torch.device(device)
        self.config = AutoConfig.from_pretrained(self.dir)
        self.tokenizer = AutoTokenizer.from_pretrained(self.dir)
        self.is_vl = getattr(self.config, "vision_config", None) is not None
        cls = AutoModelForImageTextToText if self.is_vl else AutoModelForCausalLM
        self.model = cls.from_pretrained(self.dir, dtype=dtype, attn_implementation=attn_implementation)
        self.model = self.model.to(self.device).eval()
        self.processor = AutoProcessor.from_pretrained(self.dir) if self.is_vl and torchvision_available() else None
        self.image_processor = AutoImageProcessor.from_pretrained(self.dir) if self.is_vl else None

    def inputs(self, messages: list[dict], **processor_kwargs) -> dict:
        """HF's inputs for a chat. With a video item, the model cards' way: the processor's
        `apply_chat_template(..., tokenize=True, return_dict=True)` decodes and samples it
        (`processor_kwargs`, e.g. fps=1, go to that call)."""
        if self._has_video(messages):
            assert self.processor is not None, "HF's video processors need torchvision"
            return dict(self.processor.apply_chat_template(
                messages, tokenize=True, return_dict=True, add_generation_prompt=True, return_tensors="pt",
                processor_kwargs=processor_kwargs))
        images = [item["image"] for m in messages if isinstance(m["content"], list)
                  for item in m["content"] if item.get("type") == "image"]
        if self.processor is None:  # a text-only checkpoint, or no torchvision
            return self._inputs_by_hand(messages, images)
        text = self.processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return dict(self.processor(text=[text], images=images or None, return_tensors="pt"))

    @staticmethod
    def processor_only(model_dir: Path):
        """HF's default processor of a checkpoint (no model loaded)."""
        return AutoProcessor.from_pretrained(model_dir)

    @staticmethod
    def _has_video(messages: list[dict]) -> bool:
        return any(isinstance(m["content"], list) and any(item.get("type") == "video" for item in m["content"])
                   for m in messages)

    def _inputs_by_hand(self, messages: list[dict], images: list) -> dict:
        """What HF's Qwen-VL processor does, with the tokenizer and `AutoImageProcessor`."""
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        kwargs = {}
        if images:
            proc = self.image_processor(images=images, return_tensors="pt")
            merge = self.image_processor.merge_size
            parts = text.split(IMAGE_PAD)
            assert len(parts) == len(images) + 1
            counts = [int(g.prod()) // merge**2 for g in proc["image_grid_thw"]]
            text = parts[0] + "".join(IMAGE_PAD * n + p for n, p in zip(counts, parts[1:]))
            kwargs = {"pixel_values": proc["pixel_values"], "image_grid_thw": proc["image_grid_thw"]}
        ids = self.tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
        if images:  # transformers 5 computes M-RoPE from these token types, as its processor returns them
            kwargs["mm_token_type_ids"] = (ids == self.tokenizer.convert_tokens_to_ids(IMAGE_PAD)).to(torch.int32)
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), **kwargs}

    @torch.no_grad()
    def generate(self, messages: list[dict], max_new_tokens: int, **processor_kwargs) -> HFResult:
        inputs = {k: v.to(self.device) if hasattr(v, "to") else v
                  for k, v in self.inputs(messages, **processor_kwargs).items()}
        out = self.model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False,
                                  output_logits=True, return_dict_in_generate=True)
        n_prompt = inputs["input_ids"].shape[1]
        tokens = out.sequences[0, n_prompt:].tolist()
        logprobs = [torch.log_softmax(step[0].float(), dim=-1).cpu() for step in out.logits][: len(tokens)]
        return HFResult(inputs["input_ids"][0].tolist(), tokens, logprobs)
