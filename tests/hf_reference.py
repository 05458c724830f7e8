"""HF transformers as the reference: prompt ids, pixels and greedy generation for a chat.

Builds HF's inputs the way HF's Qwen VL processors do (chat template → text, each image pad
expanded to grid_t*grid_h*grid_w/merge² copies → tokenizer) with HF's own PIL image processor,
then runs HF `generate` greedily (float32 eager attention on CPU unless told otherwise) and returns
tokens and per-step log-softmax.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText, AutoTokenizer

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
        if self.is_vl:
            from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

            self.image_processor = Qwen2VLImageProcessorPil.from_pretrained(self.dir)

    def inputs(self, messages: list[dict]) -> dict:
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        images = [item["image"] for m in messages if isinstance(m["content"], list)
                  for item in m["content"] if item.get("type") == "image"]
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
            image_id = self.tokenizer.convert_tokens_to_ids(IMAGE_PAD)
            kwargs["mm_token_type_ids"] = (ids == image_id).to(torch.int32)
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), **kwargs}

    @torch.no_grad()
    def generate(self, messages: list[dict], max_new_tokens: int) -> HFResult:
        inputs = {k: v.to(self.device) for k, v in self.inputs(messages).items()}
        out = self.model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False,
                                  output_logits=True, return_dict_in_generate=True)
        n_prompt = inputs["input_ids"].shape[1]
        tokens = out.sequences[0, n_prompt:].tolist()
        logprobs = [torch.log_softmax(step[0].float(), dim=-1).cpu() for step in out.logits][: len(tokens)]
        return HFResult(inputs["input_ids"][0].tolist(), tokens, logprobs)
