"""Qwen3: the text-only decoder (`DenseTextModel` with 1-D RoPE) and its LM head."""

from __future__ import annotations

from typing import Any, Optional

import torch

from vlmrun.forward_batch import ForwardBatch
from vlmrun.layers.rotary import build_text_rotary
from vlmrun.models.base import Model
from vlmrun.models.blocks.text_decoder import DenseTextModel, text_head_dim
from vlmrun.parallel import SINGLE, TensorParallel


class Qwen3ForCausalLM(Model):
    """`model` (DenseTextModel) + `lm_head`; loads the HF names as they are."""

    def __init__(self, config: Any, tp: TensorParallel = SINGLE):
        super().__init__(config, tp)
        if getattr(config, "use_sliding_window", False):
            raise NotImplementedError("Qwen3 sliding-window attention layers are not supported")
        bias = bool(getattr(config, "attention_bias", False))
        self.model = DenseTextModel(config, build_text_rotary(config, text_head_dim(config)),
                                    lambda i: self.make_mlp(config, i), qkv_bias=bias, o_bias=bias, tp=tp)
        self.lm_head = self.make_lm_head(self.model.embed_tokens)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        return self.model(input_ids, positions, fb)

    def checkpoint_name(self, hf_name: str) -> Optional[str]:
        return hf_name
