"""Training-time speed-ups that leave the model's maths unchanged (only float rounding differs).

- The Qwen3.5 vision patch embedding is a Conv3d whose kernel equals its stride and its input, i.e.
  one matrix product per patch; on CPU, oneDNN's Conv3d (forward + backward) is ~20x slower than the
  same product as `F.linear`. `linear_patch_embed` swaps the module's forward for that product on the
  same weights; `restore_patch_embed` puts HF's own forward back.
- HF's torch Gated DeltaNet runs the sequence in chunks of 64 (padding it to a multiple of 64, with a
  Python loop over the chunk's rows); the training sequences are ~60-100 tokens, so chunks of 32
  halve the work. `short_gdn_chunks` sets that for the duration of a `with` block.

Evaluation and the saved checkpoint use HF's code exactly as shipped.
"""

from __future__ import annotations

import contextlib
import functools
import types
from typing import Iterator

import torch
import torch.nn.functional as F


def _linear_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    weight = self.proj.weight.reshape(self.embed_dim, -1)  # [embed, C*T*P*P], the order of pixel_values rows
    return F.linear(hidden_states.reshape(-1, weight.shape[1]).to(weight.dtype), weight, self.proj.bias)


def linear_patch_embed(model: torch.nn.Module) -> None:
    embed = model.model.visual.patch_embed
    embed.forward = types.MethodType(_linear_forward, embed)


def restore_patch_embed(model: torch.nn.Module) -> None:
    embed = model.model.visual.patch_embed
    if "forward" in embed.__dict__:
        del embed.forward


@contextlib.contextmanager
def short_gdn_chunks(chunk_size: int = 32) -> Iterator[None]:
    from transformers.models.qwen3_5 import modeling_qwen3_5

    original = modeling_qwen3_5.torch_chunk_gated_delta_rule
    modeling_qwen3_5.torch_chunk_gated_delta_rule = functools.partial(original, chunk_size=chunk_size)
    try:
        yield
    finally:
        modeling_qwen3_5.torch_chunk_gated_delta_rule = original
