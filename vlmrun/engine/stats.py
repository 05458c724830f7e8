"""`EngineStats`: what the engine holds at one moment (`Engine.stats()`), one frozen record."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from vlmrun.spec_decode.metrics import SpecDecodeStats


@dataclass(frozen=True)
class EngineStats:
    """What the engine holds at one moment (`Engine.stats()`): queues, cache occupancy, counters, weights."""

    num_running: int = 0
    num_waiting: int = 0
    kv_pages_used: int = 0
    kv_pages_total: int = 0  # usable pages (the dummy page not counted)
    req_rows_used: int = 0
    req_rows_total: int = 0
    gdn_slots_used: Optional[int] = None  # None: the model has no GDN state pool
    gdn_slots_total: Optional[int] = None  # usable slots (the dummy slot not counted)
    num_preemptions: int = 0
    prefix_query_tokens: int = 0  # prompt tokens looked up in the prefix cache
    prefix_hit_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    weight_bytes: tuple[int, ...] = ()  # the model's parameter bytes per device: one, or each TP rank's
    spec_decode: Optional[SpecDecodeStats] = None  # speculative decoding's counters, all requests; None: off

    @property
    def kv_usage(self) -> float:
        return self.kv_pages_used / self.kv_pages_total if self.kv_pages_total else 0.0

    @property
    def gdn_usage(self) -> Optional[float]:
        if self.gdn_slots_used is None or not self.gdn_slots_total:
            return None
        return self.gdn_slots_used / self.gdn_slots_total
