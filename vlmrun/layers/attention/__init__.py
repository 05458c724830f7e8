"""Attention layer and backends."""

from vlmrun.layers.attention.base import Attention, AttentionBackend

__all__ = ["Attention", "AttentionBackend"]
