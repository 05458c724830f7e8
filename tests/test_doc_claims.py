"""The docs' claims that code can check (issue 48): field and method lists written out in
docs/contracts.md and docs/architecture.md equal the code's, the defaults and numbers they state are
the code's, the cache plan lowers `max_num_seqs` where docs/architecture.md says, the files a kernel
family touches are the ones it names, and the syncs docs/host_syncs.md lists still read the device."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import re
from pathlib import Path

import pytest
import torch

from tests.doc_symbols import split_top_level
from vlmrun.cache import plan
from vlmrun.cache.kv_pool import ReqToTokenPool
from vlmrun.config import CacheShape, EngineConfig
from vlmrun.executor.base import Executor
from vlmrun.executor.mtp_steps import MTPStep
from vlmrun.executor.step_input import ChunkInput
from vlmrun.layers.attention.factory import ATTENTION_BACKENDS, GDN_BACKENDS, BackendSetup
from vlmrun.layers.moe import FusedExperts
from vlmrun.models.blocks.vision_common import VisionEmbeddings
from vlmrun.multimodal.vision_stage import VisionStage
from vlmrun.parallel import TensorParallel
from vlmrun.processors.placeholders import MMItem, ProcessedPrompt

REPO = Path(__file__).resolve().parent.parent
DOCS = REPO / "docs"


def _doc(name: str) -> str:
    return (DOCS / name).read_text(encoding="utf-8")


def _written_call(text: str, name: str) -> list[str]:
    """The argument names of the first `name(a, b: T, c [shape], ...)` written in `text` (across line
    breaks): each argument's leading name, without its type or shape."""
    match = re.search(r"(?<![\w.])" + re.escape(name) + r"\(([^)]*)\)", text)
    assert match, f"{name}(...) is not written out"
    args = split_top_level(match.group(1).replace("\n", " "))
    return [re.search(r"[A-Za-z_]\w*", arg).group(0) for arg in args]  # past a diagram's "│" at a line start


def _field_names(cls: type) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)]


def _public_methods(protocol: type) -> set[str]:
    return {n for n, v in vars(protocol).items() if callable(v) and not n.startswith("_")}


def _interface() -> set[str]:
    return _public_methods(Executor) | set(Executor.__annotations__)


# ------------------------------------------------------------------------------------ lists of fields


@pytest.mark.parametrize("doc, cls", [
    ("contracts.md", ChunkInput),
    ("contracts.md", MMItem),
    ("contracts.md", ProcessedPrompt),
    ("contracts.md", plan.Caches),
    ("contracts.md", BackendSetup),
    ("contracts.md", VisionEmbeddings),
    ("architecture.md", ProcessedPrompt),
    ("architecture.md", MMItem),
    ("architecture.md", TensorParallel),
])
def test_a_written_out_record_lists_every_field_in_order(doc: str, cls: type) -> None:
    assert _written_call(_doc(doc), cls.__name__) == _field_names(cls)


def test_contracts_lists_the_executor_interface() -> None:
    match = re.search(r"`vlmrun\.executor\.base\.Executor` \(([^)]*)\)", _doc("contracts.md"))
    assert match, "the Executor interface is not listed"
    assert set(re.findall(r"`(\w+)`", match.group(1))) == _interface()


def test_architecture_lists_the_executor_interface() -> None:
    match = re.search(r"`Executor`: (.*?)\): `ModelRunner`", _doc("architecture.md"), re.S)
    assert match, "the Executor interface is not listed"
    assert set(re.findall(r"`(\w+)", match.group(1))) == _interface()


# ------------------------------------------------------------------------------------ defaults and numbers


def test_architecture_states_the_gdn_budget_share() -> None:
    assert "`GDN_MAX_BUDGET_SHARE` (half)" in _doc("architecture.md") and plan.GDN_MAX_BUDGET_SHARE == 0.5


def test_the_documented_cache_defaults_are_the_codes() -> None:
    text = _doc("architecture.md")
    page_size = re.search(r"Pages of `page_size` \(default (\d+)\)", text)
    assert page_size and int(page_size.group(1)) == EngineConfig().page_size
    budget = re.search(r"`kv_cache_memory_bytes` \(CPU default (\d+) GiB\)", text)
    assert budget and int(budget.group(1)) << 30 == plan.CPU_KV_BUDGET_BYTES
    budget = re.search(r"`kv_cache_memory_bytes`, (\d+) GiB on CPU", _doc("contracts.md"))
    assert budget and int(budget.group(1)) << 30 == plan.CPU_KV_BUDGET_BYTES
    dummy = re.search(r"`ReqToTokenPool\.dummy_row` \(= max_reqs\)", _doc("contracts.md"))
    assert dummy and ReqToTokenPool(3, 8, torch.device("cpu")).dummy_row == 3


def test_max_num_seqs_is_lowered_only_past_the_whole_budget() -> None:
    """architecture.md: GDN slots are taken first; only when `max_num_seqs + 1` of them do not fit in the
    whole budget is `max_num_seqs` lowered, to what half the budget holds."""
    text = re.sub(r"\s+", " ", _doc("architecture.md"))
    assert "The GDN state pool has `max_num_seqs + 1` slots" in text
    assert "if `max_num_seqs` of them do not fit in the whole budget, `max_num_seqs` is lowered" in text
    shape = CacheShape(num_attention_layers=1, num_kv_heads=1, head_dim=8, num_gdn_layers=1, gdn_conv_dim=32,
                       gdn_conv_kernel=4, gdn_num_v_heads=2, gdn_head_v_dim=8, gdn_head_k_dim=8)
    per_request = plan.gdn_bytes_per_request(shape, torch.float32, torch.float32)
    per_token = plan.kv_bytes_per_token(shape, torch.float32)

    def seqs(budget: int) -> int:
        planned = plan.plan_cache_memory(shape, budget, dtype=torch.float32, gdn_state_dtype=torch.float32,
                                         max_num_seqs=8, max_model_len=64, page_size=4, max_model_len_fixed=False)
        assert planned.num_gdn_slots == planned.max_num_seqs + 1  # "The GDN state pool has `max_num_seqs + 1` slots"
        return planned.max_num_seqs

    fits = 9 * per_request + 8 * per_token  # the slots take far more than half, and fit: kept
    assert 9 * per_request > fits * plan.GDN_MAX_BUDGET_SHARE and seqs(fits) == 8
    short = 9 * per_request - 1  # one byte short of the slots: lowered to what half the budget holds
    assert seqs(short) == int(short * plan.GDN_MAX_BUDGET_SHARE) // per_request - 1 < 8


# ------------------------------------------------------------------------------------ what a kernel family touches


def _names_a_fast_backend(path: Path, fast: set[str]) -> bool:
    """Whether a module writes a fast backend's name as a string or imports that backend's module."""
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Constant) and node.value in fast:
            return True
        if (isinstance(node, ast.ImportFrom) and (node.module or "").startswith("vlmrun.layers.attention.")
                and any(name in node.module.rsplit(".", 1)[1] for name in fast)):
            return True
    return False


def test_architecture_names_the_files_a_kernel_family_touches() -> None:
    """The files outside layers/attention/ that name a fast backend ("torch" and "cpu" are also device and
    option names everywhere) are the ones the paragraph on kernel families names."""
    match = re.search(r"A new kernel family is an entry in those tables(.*?)tests/test_doc_claims\.py",
                      _doc("architecture.md"), re.S)
    assert match, "the paragraph on kernel families is missing"
    named = set(re.findall(r"`([\w/]+\.py)`", match.group(1)))
    fast = (set(ATTENTION_BACKENDS) | set(GDN_BACKENDS)) - {"torch", "cpu"}
    attention = REPO / "vlmrun" / "layers" / "attention"
    touching = {p.relative_to(REPO / "vlmrun").as_posix() for p in (REPO / "vlmrun").rglob("*.py")
                if attention not in p.parents and _names_a_fast_backend(p, fast)}
    assert fast and touching == {name.removeprefix("vlmrun/") for name in named}


# ------------------------------------------------------------------------------------ the syncs left


SYNC_OWNERS = {"FusedExperts": FusedExperts, "MTPStep": MTPStep, "VisionStage": VisionStage}
HOST_READS = (".tolist()", ".item()", ".cpu()", ".synchronize()", "all_gather_object(")


def test_each_sync_host_syncs_lists_still_reads_the_device() -> None:
    section = _doc("host_syncs.md").split("## What still syncs", 1)[1].split("\n## ", 1)[0]
    listed = re.findall(r"`(\w+)\.(\w+)`", section)
    assert listed, "host_syncs.md lists no sync"
    for owner, method in listed:
        assert owner in SYNC_OWNERS, f"host_syncs.md names {owner}.{method}: add {owner} to SYNC_OWNERS"
        source = inspect.getsource(getattr(SYNC_OWNERS[owner], method))
        assert any(read in source for read in HOST_READS), f"{owner}.{method} no longer reads the device"


# ------------------------------------------------------------------------------------ the readers themselves


def test_a_written_call_is_read_across_lines_with_types_and_shapes() -> None:
    assert _written_call("see `F(a, b,\nc)` here", "F") == ["a", "b", "c"]
    assert _written_call("`G(x: int, y [n, m], z: str | None)`", "G") == ["x", "y", "z"]
    assert _written_call("`H.F(q)` then `F(r)`", "F") == ["r"]
    assert _written_call("│ → F(a, b,\n  │   c)", "F") == ["a", "b", "c"]
