"""The engine moves the objects alive after its startup out of the cyclic GC's generations (engine/startup_heap.py):
a full collection during decode then walks only what the steps made, not every library object."""

from __future__ import annotations

import gc

from vlmrun.config import EngineConfig
from vlmrun.engine.engine import Engine


def test_engine_startup_freezes_the_heap(qwen3_vl_dir) -> None:
    gc.unfreeze()
    engine = Engine(EngineConfig(model=str(qwen3_vl_dir), device="cpu", dtype="float32", max_num_seqs=2,
                                 kv_cache_memory_bytes=8 * 1024 * 1024))
    frozen = gc.get_freeze_count()
    assert frozen > 10_000  # the libraries, the model, the tokenizer
    assert gc.get_count()[0] < 1_000  # the young generation starts (next to) empty
    engine.shutdown()
