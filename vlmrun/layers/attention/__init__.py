"""Attention layers, the two backend interfaces, the backends and their factory."""

from vlmrun.layers.attention.base import Attention, AttentionBackend, GDNAttention, GDNBackend
from vlmrun.layers.attention.factory import create_attention_backend

__all__ = ["Attention", "AttentionBackend", "GDNAttention", "GDNBackend", "create_attention_backend"]
