"""Keep the objects alive after the engine's startup out of Python's cyclic garbage collector.

A started engine holds millions of long-lived objects (the imported libraries, the model, the
tokenizer). The collector's oldest generation holds them all, and a full collection walks all of
them: on the host-overhead benchmark's model (bench/bench_host_overhead.py) one such pass took
175 ms, once in 47 decode steps at batch 256 (3.7 ms a step on average, more than the step itself).
`freeze_startup_heap` moves every object the collector tracks into the permanent generation
(`gc.freeze`, what CPython offers for this; it costs microseconds), so later full collections walk
only the objects made since. It does not collect first: that pass costs about 0.2 s an engine, and the
garbage it would find is what startup left, once. Objects frozen are still freed by reference
counting; a cycle among them is freed only after `gc.unfreeze()` (the test suite unfreezes after each
test, tests/conftest.py).
"""

from __future__ import annotations

import gc


def freeze_startup_heap() -> None:
    """Freeze everything the collector tracks now (the engine has just started)."""
    gc.freeze()
