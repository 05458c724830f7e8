"""Multimodal helpers: M-RoPE position computation and the vision stage."""

from vlmrun.multimodal.mrope import compute_mrope_positions

__all__ = ["compute_mrope_positions"]
