"""Memory of a long `LLM.generate` call that does not grow with its inputs (issue 47, "flat peak RSS").

- The outputs: each output's token id lists are plain lists whose int objects the call's outputs share
  (`vlmrun.request_output.TokenIdTable`), so an output costs the lists' 8-byte slots per token, not a
  new 28-byte int object per token as the tokenizer and the sampler hand them out.
- The pixels: each prompt's pixel tensors reach the engine in an anonymous mapping of their own
  (`vlmrun/feed/pixel_memory.py`), not in a worker thread's malloc arena where, freed later by the
  engine's thread, they would leave holes.
- The heaps: between steps the input pipeline's `HeapTrimmer` (`vlmrun/executor/cpu_malloc.py`) hands
  the free memory glibc keeps (the CPU engine asks it to keep everything, `keep_freed_memory`) back to
  the kernel once the RSS rose past the working set; checked in a fresh interpreter (the mallopt
  settings are process-wide).
"""

from __future__ import annotations

import ctypes
import json
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from vlmrun import LLM, SamplingParams
from vlmrun.executor.cpu_malloc import HeapTrimmer
from vlmrun.feed.pipeline import InputPipeline, Work
from vlmrun.request_output import TokenIdTable

ROOT = Path(__file__).resolve().parents[1]
glibc_only = pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
                                reason="malloc_trim is glibc's")
WORDS = "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa".split()


@pytest.fixture(scope="module")
def llm(qwen3_vl_dir: Path) -> LLM:
    return LLM(str(qwen3_vl_dir), dtype="float32", device="cpu", max_num_seqs=4, preprocess_workers=1)


def token_list_bytes(lists: list[list[int]]) -> int:
    """Bytes the lists hold: each list, and each int object once (shared ones counted once)."""
    ints = {id(t): sys.getsizeof(t) for ids in lists for t in ids if not -5 <= t <= 256}  # small ints: CPython's own
    return sum(sys.getsizeof(ids) for ids in lists) + sum(ints.values())


def test_outputs_share_their_token_int_objects_and_stay_lists(llm: LLM) -> None:
    prompts = [" ".join(WORDS[(i + j) % len(WORDS)] for j in range(60)) for i in range(12)]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    lists = [o.prompt_token_ids for o in outs] + [c.token_ids for o in outs for c in o.outputs]
    tokens = sum(len(ids) for ids in lists)
    distinct = {t for ids in lists for t in ids}
    assert sum(t > 256 for ids in lists for t in ids) > tokens // 4  # the check needs ids above the small ints
    # one int object per distinct id across the call (today's code: one per token)
    assert len({id(t) for ids in lists for t in ids}) <= len(distinct)
    # held: the lists' slots (8 bytes a token and spare room, a list's header) and the distinct ints;
    # today's code adds 28 bytes for each token above 256
    assert token_list_bytes(lists) < 10 * tokens + 32 * len(distinct) + 100 * len(lists)
    # still vLLM's plain lists: type, equality, indexing, json
    alone = llm.generate([prompts[3]], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                         use_tqdm=False)[0]
    assert type(outs[3].prompt_token_ids) is list and outs[3].prompt_token_ids == alone.prompt_token_ids
    assert outs[3].outputs[0].token_ids == alone.outputs[0].token_ids
    assert json.loads(json.dumps(outs[3].prompt_token_ids)) == alone.prompt_token_ids
    assert outs[3].prompt_token_ids[-1] == alone.prompt_token_ids[-1]


def test_token_id_table_keeps_values_and_order() -> None:
    table = TokenIdTable()
    first = table.list_of([int("151655"), 7, int("151655"), int("99999")])
    second = table.list_of(iter([int("99999"), int("151655")]))
    assert first == [151655, 7, 151655, 99999] and second == [99999, 151655]
    assert first[0] is first[2] is second[1] and first[3] is second[0]
    assert len(table) == 3


class CountingTrimmer(HeapTrimmer):
    def __init__(self) -> None:
        super().__init__(libc=None)
        self.calls = 0

    def after_step(self) -> bool:
        self.calls += 1
        return super().after_step()


def test_the_pipeline_runs_its_heap_trimmer_after_every_step(llm: LLM) -> None:
    steps = []
    heap = CountingTrimmer()
    pipeline = InputPipeline(llm.engine, llm.engine.process, workers=1, prefetch=2, heap=heap)
    step = llm.engine.step
    llm.engine.step = lambda: steps.append(1) or step()  # type: ignore[method-assign]
    try:
        works = (Work(f"t{i}", f"Count to {i}.", [SamplingParams(temperature=0, max_tokens=3)]) for i in range(5))
        assert len(list(pipeline.stream(works))) == 5
    finally:
        del llm.engine.step
    assert heap.calls == len(steps) > 0


HEAP = """
import json, torch
from vlmrun.executor.cpu_malloc import HeapTrimmer, keep_freed_memory, rss_bytes

assert keep_freed_memory()  # as the CPU engine does: freed blocks stay in the process
heap = HeapTrimmer(32 << 20)
heap.after_step()  # the working set
blocks = [torch.ones(1 << 18) for _ in range(256)]  # 256 MiB in 1 MiB blocks, touched, then freed
del blocks
held = rss_bytes()
trimmed = heap.after_step()
after = rss_bytes()
again = [heap.after_step() for _ in range(3)]  # no growth since: no trim
print(json.dumps({"held": held, "trimmed": trimmed, "after": after, "again": again, "trims": heap.trims}))
"""


@glibc_only
def test_freed_memory_kept_by_malloc_goes_back_once_it_passes_the_slack() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    out = subprocess.run([sys.executable, "-c", HEAP], cwd=ROOT, env=env, check=True, capture_output=True,
                         text=True).stdout
    result = json.loads(out.strip().splitlines()[-1])
    assert result["trimmed"] and result["trims"] == 1, result
    assert result["held"] - result["after"] > 200 << 20, result  # the freed 256 MiB left the RSS
    assert result["again"] == [False, False, False], result


def test_heap_trimmer_is_a_no_op_without_glibc() -> None:
    heap = HeapTrimmer(0, libc=None)
    assert [heap.after_step() for _ in range(3)] == [False, False, False] and heap.trims == 0


class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                     "fsmblks", "uordblks", "fordblks", "keepcost")]


def malloc_in_use() -> int:
    """Bytes glibc's malloc has handed out (heap blocks + its own mappings)."""
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = MallInfo2
    info = libc.mallinfo2()
    return info.uordblks + info.hblkhd


@glibc_only
def test_pixels_reach_the_engine_outside_the_malloc_heaps(llm: LLM) -> None:
    held: list = []  # each prompt's pixel tensors as the engine got them (kept past the engine's drop)
    add = llm.engine.add_request

    def holding(rid: str, prompt: Any, *args: Any, **kwargs: Any) -> Any:
        held.extend(item.pixel_values for item in prompt.mm_items)
        return add(rid, prompt, *args, **kwargs)

    llm.engine.add_request = holding  # type: ignore[method-assign]
    try:
        images = [Image.fromarray(np.full((224, 224, 3), i * 20, dtype=np.uint8)) for i in range(8)]
        llm.generate([{"prompt": "Look.", "images": [im]} for im in images], SamplingParams(max_tokens=1),
                     use_tqdm=False)
    finally:
        del llm.engine.add_request
    pixel_bytes = sum(t.numel() * t.element_size() for t in held)
    assert len(held) == 8 and pixel_bytes > 8 << 20
    before = malloc_in_use()
    held.clear()
    # their memory was never malloc's (today's code: the workers' malloc blocks, all of it freed here)
    assert before - malloc_in_use() < pixel_bytes // 4
