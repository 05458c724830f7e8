"""The docs' claims that code can check (issue 48): field and method lists written out in
docs/contracts.md equal the code's, and the numbers docs/architecture.md states are the constants'."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from vlmrun.cache import plan
from vlmrun.executor.base import Executor
from vlmrun.executor.step_input import ChunkInput

DOCS = Path(__file__).resolve().parent.parent / "docs"


def _written_call(text: str, name: str) -> list[str]:
    """The argument names of the first `name(a, b, ...)` written in `text` (across line breaks)."""
    match = re.search(re.escape(name) + r"\(([^)]*)\)", text)
    assert match, f"{name}(...) is not written out"
    return [arg.strip() for arg in match.group(1).replace("\n", " ").split(",")]


def _public_methods(protocol: type) -> set[str]:
    return {n for n, v in vars(protocol).items() if callable(v) and not n.startswith("_")}


def test_contracts_lists_every_chunk_input_field():
    written = _written_call((DOCS / "contracts.md").read_text(encoding="utf-8"), "ChunkInput")
    assert written == [f.name for f in dataclasses.fields(ChunkInput)]


def test_contracts_lists_the_executor_interface():
    text = (DOCS / "contracts.md").read_text(encoding="utf-8")
    match = re.search(r"`vlmrun\.executor\.base\.Executor` \(([^)]*)\)", text)
    assert match, "the Executor interface is not listed"
    listed = set(re.findall(r"`(\w+)`", match.group(1)))
    assert listed == _public_methods(Executor) | set(Executor.__annotations__)


def test_architecture_states_the_gdn_budget_share():
    text = (DOCS / "architecture.md").read_text(encoding="utf-8")
    assert "`GDN_MAX_BUDGET_SHARE` (half)" in text and plan.GDN_MAX_BUDGET_SHARE == 0.5


def test_a_written_call_is_read_across_lines():
    assert _written_call("see `F(a, b,\nc)` here", "F") == ["a", "b", "c"]
