"""Rotary position embeddings: 1-D RoPE and multimodal (3-D) M-RoPE.

Buffers are made on the CPU explicitly: models are constructed on the meta device and their
buffers moved to the target device afterwards (`vlmrun.models.weights.build_model`).
Both modules map positions to `(cos, sin)` tables of shape [num_tokens, head_dim] in float32 using
the "rotate half" layout (the two halves of head_dim share frequencies). Positions arrive as
`[3, num_tokens]` (rows t, h, w); 1-D RoPE reads row 0.

M-RoPE splits the head_dim // 2 frequencies between the three position rows:
- sectioned (Qwen2-VL / Qwen2.5-VL): contiguous chunks of sizes `mrope_section` = (t, h, w);
- interleaved (Qwen3-VL): frequency j takes row h if j % 3 == 1 and j < 3 * section_h, row w if
  j % 3 == 2 and j < 3 * section_w, row t otherwise.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def rope_parameters(config: Any) -> dict:
    """The rope parameters of a (text) config, whichever way it spells them.

    transformers 5 puts everything in `config.rope_parameters` (with `rope_theta` inside); older
    configs use `rope_scaling` plus a top-level `rope_theta`. Returns a dict with at least
    `rope_type` and `rope_theta`.
    """
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    params = dict(params)
    if "rope_theta" not in params:
        params["rope_theta"] = getattr(config, "rope_theta", None) or 10000.0
    rope_type = params.get("rope_type", params.get("type", "default"))
    params["rope_type"] = "default" if rope_type in (None, "mrope") else rope_type
    return params


def default_rope_parameters(config: Any) -> dict:
    """`rope_parameters(config)`, refusing every rope type but the default (no scaling) one."""
    params = rope_parameters(config)
    if params["rope_type"] != "default":
        raise NotImplementedError(f"rope_type {params['rope_type']!r} is not supported")
    return params


def _inv_freq(head_dim: int, base: float) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float, device="cpu") / head_dim))  # [head_dim // 2]


def _cos_sin(freqs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # freqs: [num_tokens, head_dim // 2] -> cos, sin: [num_tokens, head_dim]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


class RotaryEmbedding(nn.Module):
    """Plain 1-D RoPE (default rope type only)."""

    def __init__(self, head_dim: int, base: float):
        super().__init__()
        self.head_dim = head_dim
        self.register_buffer("inv_freq", _inv_freq(head_dim, base), persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # positions: [3, num_tokens] (row 0 used) or [num_tokens]
        pos = positions[0] if positions.dim() == 2 else positions
        freqs = pos.float()[:, None] * self.inv_freq[None, :]  # [num_tokens, head_dim // 2]
        return _cos_sin(freqs)


class MRotaryEmbedding(nn.Module):
    """3-D M-RoPE; `interleaved` picks the Qwen3-VL layout, otherwise the sectioned Qwen2.5-VL one."""

    def __init__(self, head_dim: int, base: float, mrope_section: list[int], interleaved: bool):
        super().__init__()
        half = head_dim // 2
        if sum(mrope_section) != half:
            raise ValueError(f"mrope_section {mrope_section} must sum to head_dim // 2 = {half}")
        self.head_dim = head_dim
        self.mrope_section = list(mrope_section)
        self.interleaved = interleaved
        self.register_buffer("inv_freq", _inv_freq(head_dim, base), persistent=False)
        # row_of_freq[j]: which position row (0=t, 1=h, 2=w) drives frequency j.
        if interleaved:
            row = torch.zeros(half, dtype=torch.long, device="cpu")
            for r in (1, 2):
                row[r:3 * mrope_section[r]:3] = r
        else:
            row = torch.cat([torch.full((n,), r % 3, dtype=torch.long, device="cpu") for r, n in enumerate(mrope_section)])
        self.register_buffer("row_of_freq", row, persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # positions: [3, num_tokens]; a 1-D [num_tokens] input means the same position on every row
        if positions.dim() == 1:
            positions = positions.unsqueeze(0).expand(3, -1)
        pos = positions.float()[self.row_of_freq]  # [head_dim // 2, num_tokens]
        freqs = pos.t() * self.inv_freq[None, :]  # [num_tokens, head_dim // 2]
        return _cos_sin(freqs)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [num_tokens, num_heads, head_dim]; cos, sin: the forward's `prepared_tables` ([num_tokens, 1,
    head_dim] each, sin with rotate_half's sign: made once for every layer). Computed in float32.

    x * cos + rotate_half(x) * sin, where rotate_half(x) = (-x2, x1): written as x rolled by half a
    head, times sin with rotate_half's sign moved onto the (num_heads times smaller) table, in one
    addcmul; three passes over x instead of six (memory-bound on the CPU).
    """
    half = x.shape[-1] // 2
    xf = x if x.dtype == torch.float32 else x.float()
    out = torch.addcmul(xf * cos, xf.roll(half, dims=-1), sin)
    return out if out.dtype == x.dtype else out.to(x.dtype)


def prepared_tables(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [num_tokens, head_dim] -> [num_tokens, 1, head_dim] float32 each, sin with rotate_half's sign
    on its first half: what `apply_rotary` takes, made once a step when every layer rotates with them."""
    half = sin.shape[-1] // 2
    signed = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)
    return cos.float()[:, None, :], signed.float()[:, None, :]


def build_text_rotary(config: Any, head_dim: int, *, interleaved: bool | None = None) -> nn.Module:
    """The rotary module a text config asks for: M-RoPE when it names an `mrope_section`, else 1-D.

    `interleaved` forces the M-RoPE layout; None reads `mrope_interleaved` from the config (default False).
    """
    params = default_rope_parameters(config)
    base = float(params["rope_theta"])
    section = params.get("mrope_section")
    if section is None:
        return RotaryEmbedding(head_dim, base)
    if interleaved is None:
        interleaved = bool(params.get("mrope_interleaved", False))
    return MRotaryEmbedding(head_dim, base, list(section), interleaved)
