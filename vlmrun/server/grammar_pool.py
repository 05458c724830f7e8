"""Client grammars compiled where they cannot hold anyone else up: `GrammarPool`.

A structured-output request's constraint compiles (xgrammar: seconds to minutes for a large one, and
not interruptible once started) in this pool's own few threads, never in the light pool that parses
bodies and tokenizes text, nor on the engine thread. Bounds, each checked before the work it bounds:

- size: `GrammarLimits` (the constraint's text, the number of choices): a 400 when the body is parsed
  (`protocol.py`; a forced tool call's grammar: its tools' size, `chat_handler.py`), before this pool;
- count: at most `max_pending` compiles queued or running, an abandoned one included (it runs to its
  end); one more is a 429 (retry later), never a wait behind them;
- time: a client waits at most `timeout_s` for its compile (then a 400: the constraint is too
  complex); the compile finishes in the background and its grammar is cached;
- clients gone: a compile whose client left (its `cancel` event set) before a thread took it up is
  not started at all.

A grammar already compiled (cached, or pinned on its spec) costs nothing here: no thread, no count.
After a compile of at least `TRIM_SOURCE_CHARS`, `after_large_compile` runs on the event loop (the
server hands the compile's transient memory back to the kernel, `memory.py`).
"""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Optional

from vlmrun.server.errors import APIError, bad_request
from vlmrun.structured import StructuredOutputError, StructuredOutputsParams


TRIM_SOURCE_CHARS = 16 * 1024


class CompileSkipped(Exception):
    """The client left before its compile started: nothing was compiled."""


class GrammarPool:
    def __init__(self, compile_spec: Callable[[StructuredOutputsParams], Any],
                 is_cached: Callable[[StructuredOutputsParams], bool], workers: int = 2, max_pending: int = 8,
                 timeout_s: float = 30.0, after_large_compile: Optional[Callable[[], None]] = None):
        self.compile_spec = compile_spec
        self.is_cached = is_cached
        self.after_large_compile = after_large_compile
        self.max_pending = max_pending
        self.timeout_s = timeout_s
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="vlmrun-grammar")
        self._pending = 0  # compiles queued or running (their clients gone or not)
        self._lock = threading.Lock()

    @property
    def pending(self) -> int:
        return self._pending

    async def compile(self, spec: Optional[StructuredOutputsParams], cancel: threading.Event) -> None:
        """Compile `spec` (cached afterwards, and pinned on it); StructuredOutputError if it does not compile,
        a 429 when `max_pending` compiles are under way, a 400 past `timeout_s`."""
        if spec is None or self.is_cached(spec):
            return
        with self._lock:
            if self._pending >= self.max_pending:
                raise APIError(429, f"the server is compiling {self._pending} structured-output constraints; "
                                    "retry shortly", type="rate_limit_error", code="grammar_compiles_busy",
                               headers={"Retry-After": "1"})
            self._pending += 1
        try:
            future = self._pool.submit(self._run, spec, cancel)
        except BaseException:
            self._release()
            raise
        try:
            await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(future)), self.timeout_s)
        except asyncio.TimeoutError:
            raise bad_request(f"the output constraint did not compile within {self.timeout_s:g} s: simplify it",
                              param="structured_outputs", code="grammar_too_complex") from None
        except asyncio.CancelledError:
            cancel.set()  # the client left: a compile not started yet never starts
            raise
        finally:
            if self.after_large_compile is not None and len(spec.source) >= TRIM_SOURCE_CHARS:
                self.after_large_compile()

    def _run(self, spec: StructuredOutputsParams, cancel: threading.Event) -> None:
        try:
            if cancel.is_set():
                raise CompileSkipped()
            self.compile_spec(spec)
        finally:
            self._release()

    def _release(self) -> None:
        with self._lock:
            self._pending -= 1

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


__all__ = ["CompileSkipped", "GrammarPool", "StructuredOutputError"]
