"""A command's progress line while it loads a model: 'vlmrun: loading WHAT ...' on stderr, then how long it took.

Used by the commands that load a model before their work starts (`serve`, `web`, `run-batch`, `caption`).
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from typing import Iterator, Optional, TextIO


@contextlib.contextmanager
def loading_line(what: str, stream: Optional[TextIO] = None) -> Iterator[None]:
    """'vlmrun: loading WHAT ...' on stderr, ticking the seconds on a terminal, then how long it took."""
    out = stream if stream is not None else sys.stderr
    start = time.monotonic()
    done = threading.Event()
    tty = out.isatty()
    out.write(f"vlmrun: loading {what} ..." + ("" if tty else "\n"))
    out.flush()

    def tick() -> None:
        while not done.wait(1.0):
            out.write(f"\rvlmrun: loading {what} ... {time.monotonic() - start:.0f} s")
            out.flush()

    ticker = threading.Thread(target=tick, name="vlmrun-loading", daemon=True) if tty else None
    if ticker is not None:
        ticker.start()
    ok = False
    try:
        yield
        ok = True
    finally:
        done.set()
        if ticker is not None:
            ticker.join()
        verb = "loaded" if ok else "failed to load"
        out.write(f"{chr(13) if tty else ''}vlmrun: {verb} {what} in {time.monotonic() - start:.1f} s\n")
        out.flush()
