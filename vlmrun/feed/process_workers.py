"""Preprocessing in worker processes: one spawned process per worker thread of the prefetch.

    worker thread i ──pipe: the input──▶ process i: prepare(input) (its own processor, loaded once)
                    ◀──pipe: the ProcessedPrompt (pixel tensors through shared memory) or the error──

The prefetch (`prefetch.py`) keeps its worker threads: with process workers each thread hands its
input to its own process and waits for the answer, so the slots, the order and the error handling are
the threads' (a thread waiting on a pipe holds no GIL). What the processes add is the GIL: an input's
decode, resize, chat template and tokenizer run in another interpreter.

- `prepare` is pickled to each process when it starts (a `vlmrun.feed.prepare` object: its `Processor`
  travels as its checkpoint folder and options and is loaded again there, once); then only inputs go
  down the pipe. A prompt comes back through `torch.multiprocessing`'s pickler: its tensors' storage
  moves into shared memory, no copy of the pixels through the pipe. The caller copies the pixels out
  of it at once (`owned`) into a mapping of their own (`pixel_memory.py`, as the threads' are): a
  shared storage holds a file descriptor while it lives, and the prefetch and the engine hold hundreds
  of prompts (1,024 descriptors is a common limit).
- A bad input fails alone with its error, as with threads. A process that dies on an input (a crash
  in a decoder, the OOM killer) fails that input ("the preprocessing worker process died ...") and is
  started again for the next one.
- Processes are spawned, not forked (a fork of a process running torch's threads can deadlock), run
  as daemons with one torch thread, ignore SIGINT (Ctrl-C reaches the caller, whose `close` stops them)
  and end when their pipe closes (the caller gone, even killed). `close` asks, then terminates, then
  kills: no process outlives the call.
- Spawn starts each process by importing the caller's main script (as `__mp_main__`), as vLLM's
  multiprocessing does: a script must keep its work under `if __name__ == "__main__":`. `main_is_guarded`
  tells whether it looks so ("auto" takes processes only then).
"""

from __future__ import annotations

import signal
import sys
from typing import Any, Callable, Optional

import torch
import torch.multiprocessing as torch_mp

from vlmrun.feed.pixel_memory import map_pixels
from vlmrun.processors import InputError, ProcessedPrompt

POLL_S = 0.05  # how often a waiting thread looks whether its process is alive
STOP_WAIT_S = 2.0  # how long `close` waits for a process to leave on its own before terminating it


def main_is_guarded() -> bool:
    """Whether a spawned process may import this process's main module: there is no main script (a
    REPL, a notebook, `python -c`), it runs as a module (`python -m`: its own guard is then its business)
    or its source has an `if __name__ == "__main__":` block."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if path is None or getattr(main, "__spec__", None) is not None:
        return True
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            source = fh.read()
    except OSError:
        return False
    return any(f"__name__ == {q}__main__{q}" in source for q in ('"', "'"))


def owned(prompt: ProcessedPrompt) -> ProcessedPrompt:
    """`prompt` with its pixel tensors copied out of shared memory (a memcpy; the descriptor closes)."""
    return map_pixels(prompt)


def serve(conn: Any, prepare: Callable[[Any], ProcessedPrompt]) -> None:
    """A worker process's loop: an input in, ("ok", prompt) or ("error", message) out; ends on None or EOF."""
    from vlmrun.feed.prefetch import describe_error

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the caller stops us (close, or our pipe closing)
    torch.set_num_threads(1)
    while True:
        try:
            source = conn.recv()
        except (EOFError, OSError):
            return
        if source is None:
            return
        try:
            answer = ("ok", prepare(source))
        except Exception as exc:  # noqa: BLE001 - any failure of one input is that input's error
            answer = ("error", describe_error(exc))
        try:
            conn.send(answer)
        except Exception as exc:  # noqa: BLE001 - a prompt that cannot be sent back is still its input's error
            conn.send(("error", f"the processed prompt could not be sent back: {describe_error(exc)}"))


class WorkerProcess:
    """One spawned process running `serve(prepare)`; `run` sends it an input and waits (one at a time)."""

    def __init__(self, prepare: Callable[[Any], ProcessedPrompt], name: str = "vlmrun-prep"):
        self.prepare = prepare
        self.name = name
        self.restarts = 0  # processes started again after one died
        self._context = torch_mp.get_context("spawn")
        self._conn: Any = None
        self.process: Any = None
        self._start()

    def _start(self) -> None:
        parent, child = self._context.Pipe()
        self.process = self._context.Process(target=serve, args=(child, self.prepare), name=self.name, daemon=True)
        self.process.start()
        child.close()  # ours is only the parent's end: the process sees EOF once we close it
        self._conn = parent

    def run(self, source: Any, stopped: Callable[[], bool] = lambda: False) -> ProcessedPrompt:
        """The processed prompt of `source`; InputError with the process's error message when it failed,
        or when the process died on it (it is started again for the next input)."""
        self._conn.send(source)  # pickled whole before anything is written: an input that cannot be pickled
        # raises here and leaves the pipe clean
        while not self._conn.poll(POLL_S):
            if not self.process.is_alive() or stopped():
                return self._lost(stopped())
        try:
            status, value = self._conn.recv()
        except (EOFError, OSError):
            return self._lost(False)
        if status == "error":
            raise InputError(value)
        return owned(value)

    def _lost(self, stopped: bool) -> ProcessedPrompt:
        if stopped:
            raise InputError("preprocessing stopped")
        self.process.join(timeout=STOP_WAIT_S)
        code = self.process.exitcode
        self._conn.close()
        self.restarts += 1
        self._start()
        raise InputError(f"the preprocessing worker process died on this input (exit code {code}); "
                         f"a new one was started")

    def close(self) -> None:
        """Stop the process: asked to leave, then terminated, then killed."""
        try:
            self._conn.send(None)
        except (OSError, ValueError):
            pass
        self._conn.close()
        self.process.join(timeout=STOP_WAIT_S)
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(timeout=STOP_WAIT_S)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()

    @property
    def pid(self) -> Optional[int]:
        return self.process.pid
