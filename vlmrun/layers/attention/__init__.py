"""Attention layer and backends."""

from vlmrun.layers.attention.base import Attention, AttentionBackend, LinearAttention

__all__ = ["Attention", "AttentionBackend", "LinearAttention"]
