"""Normalization layers.

`RMSNorm` follows the Qwen/Llama convention: normalize in float32, cast back to the input dtype,
then scale by the learned weight (the multiply happens in the weight's dtype). `rms_norm` is the same
as a function, with a weight that may differ per row (the dense attention's q and k heads, normed together).
"""

from __future__ import annotations

import torch
from torch import nn


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., d] normalized over its last dim in float32, cast back to x's dtype, times `weight` (broadcast
    over x's trailing dims: [d], or [..., d] for a weight per row, e.g. per attention head)."""
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., hidden_size]
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32 and x.is_contiguous() and x.is_cpu:
            # torch's own op: on the CPU the same floats in float32 (x * rsqrt(mean(x^2) + eps) * weight,
            # tests/test_forward_ops.py), one call instead of six (slower on a strided x; other devices have
            # kernels of their own); other dtypes round as HF does: cast back first, then the weight
            return torch.rms_norm(x, self.weight.shape, self.weight, self.eps)
        return rms_norm(x, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"
