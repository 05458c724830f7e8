"""The progress bar of an `LLM.generate` / `LLM.chat` call: finished inputs, and the rates of both stages.

    inputs:  37%|████      | 370/1000 [00:12<00:20, 30.1 input/s, prep 41.0/s, gen 240 tok/s]

tqdm counts finished inputs (its own rate: inputs/s, and the ETA); the postfix adds the preprocessing
rate (inputs preprocessed per second) and the generation rate (output tokens per second), both since
the call began, so a starving engine (prep below the input rate) shows at a glance. With no length
(a generator), tqdm shows the count and the rates without a total.
"""

from __future__ import annotations

import time
from typing import Any, Optional


class FeedProgress:
    """A tqdm bar over `total` inputs (None: unknown); `advance` per finished input."""

    def __init__(self, total: Optional[int], enabled: bool = True):
        self.started = time.monotonic()
        self.tokens = 0
        self._bar: Any = None
        if enabled:
            from tqdm.auto import tqdm

            self._bar = tqdm(total=total, desc="inputs", unit="input", dynamic_ncols=True)

    def advance(self, output_tokens: int, preprocessed: int) -> None:
        """One more input finished, with `output_tokens`; `preprocessed` inputs so far."""
        self.tokens += output_tokens
        if self._bar is None:
            return
        elapsed = max(time.monotonic() - self.started, 1e-9)
        self._bar.set_postfix_str(f"prep {preprocessed / elapsed:.1f}/s, gen {self.tokens / elapsed:.0f} tok/s",
                                  refresh=False)
        self._bar.update(1)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
