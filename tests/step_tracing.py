"""One engine step under a Python trace or profile hook: the tests that count the Python a step runs per request."""

from __future__ import annotations

import sys
from typing import Any, Callable

Hook = Callable[[Any, str, Any], Any]


def step_under_hook(engine: Any, hook: Hook, *, lines: bool) -> list:
    """`engine.step()` with `hook` installed: as a trace function (`lines`: it sees "line" events and returns
    itself for the frames it follows) or else as a profile function (its "call" events); the previous hook is
    put back. Returns the step's updates."""
    get, install = (sys.gettrace, sys.settrace) if lines else (sys.getprofile, sys.setprofile)
    previous = get()
    install(hook)
    try:
        return engine.step()
    finally:
        install(previous)
