"""Training-time speed-ups that leave the model's maths unchanged.

The Qwen3.5 vision patch embedding is a Conv3d whose kernel equals its stride and its input, i.e.
one matrix product per patch; on CPU, oneDNN's Conv3d (forward + backward) is ~20x slower than the
same product as `F.linear`. `linear_patch_embed` swaps the module's forward for that product on the
same weights while training; `restore_patch_embed` puts HF's own forward back (evaluation and the
saved checkpoint use HF's code, exactly as shipped).
"""

from __future__ import annotations

import types

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
