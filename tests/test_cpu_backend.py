"""The CPU attention backend against the torch reference: same outputs, same KV pool writes.

Batches mix prefills (one ending mid-page, one on a page boundary), chunks over a cached prefix,
decodes alone and decodes mixed with prefills, and padding rows on the dummy row; speculative
decoding's verify chunks (drafts of different lengths, beside decodes and prefill chunks); pages are
scattered over the pool (tests/test_flashinfer_plan.py's `make_batch`). float32 and bfloat16; decode and
verify groups both ways: gathered for SDPA, and read in place by the paged decode kernel (paged_decode.c).
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

import pytest
import torch

from tests.kernel_builds import require_paged_decode
from tests.test_flashinfer_plan import HEAD_DIM, HEADS, KV_HEADS, PAGE, make_batch
from vlmrun.cache.kv_pool import ReqToTokenPool
from vlmrun.layers.attention.base import Attention
from vlmrun.layers.attention.cpu_backend import CpuAttnBackend
from vlmrun.layers.attention.factory import BackendSetup, create_attention_backend, resolve_backend_name
from vlmrun.layers.attention.torch_backend import TorchAttnBackend


@pytest.fixture(params=["gather", "paged"])
def cpu_backend(request):
    """The CPU backend class, its decode groups gathered for SDPA or read in place by the paged decode kernel."""
    if request.param == "gather":
        return CpuAttnBackend
    return functools.partial(CpuAttnBackend, paged_decode=CountingKernel(require_paged_decode()))


class CountingKernel:
    """The paged decode kernel, counting its calls (a test's decode groups must reach it)."""

    def __init__(self, kernel):
        self.kernel, self.calls = kernel, 0

    def attend(self, *args, **kwargs):
        self.calls += 1
        return self.kernel.attend(*args, **kwargs)


def run_backend(backend_cls, prefix_lens, extend_lens, padding, dtype, num_heads=HEADS, num_drafts=None):
    pool, rows, fb = make_batch(prefix_lens, extend_lens, padding, dtype=dtype)
    fb.num_drafts_cpu = num_drafts
    backend = backend_cls(pool, rows)
    fb.attn_backend = backend
    layer = Attention(num_heads, KV_HEADS, HEAD_DIM, HEAD_DIM ** -0.5, layer_id=0)
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(fb.num_tokens, num_heads * HEAD_DIM, generator=gen).to(dtype)
    k = torch.randn(fb.num_tokens, KV_HEADS * HEAD_DIM, generator=gen).to(dtype)
    v = torch.randn(fb.num_tokens, KV_HEADS * HEAD_DIM, generator=gen).to(dtype)
    backend.prepare(fb)
    out = backend.forward(q, k, v, layer, fb)
    assert out.shape == (fb.num_tokens, num_heads * HEAD_DIM) and out.dtype == dtype
    if isinstance(getattr(backend, "paged_decode", None), CountingKernel):  # every decode group read in place
        assert backend.paged_decode.calls == len(fb.attn_metadata.decodes)
    return out, pool, fb.num_tokens - padding


@pytest.mark.parametrize("prefix_lens,extend_lens,padding", [
    ([0, 0], [9, 4], 0),  # two prefills
    ([8, 0, 13], [7, 5, 1], 0),  # a chunk over a cached prefix, a prefill, a decode
    ([5, 12, 3, 20], [1, 1, 1, 1], 0),  # a decode step
    ([5, 12, 3], [1, 1, 1], 1),  # a decode step of 3 padded to 4 (one row on the dummy row)
    ([6, 0, 9, 2], [1, 6, 1, 3], 0),  # decodes between prefills and a chunk
    ([0], [1], 0),  # one token, one page
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_heads", [HEADS, KV_HEADS])  # grouped queries and plain MHA
def test_cpu_backend_equals_the_torch_backend(cpu_backend, prefix_lens, extend_lens, padding, dtype, num_heads):
    got, got_pool, real = run_backend(cpu_backend, prefix_lens, extend_lens, padding, dtype, num_heads)
    expected, ref_pool, _ = run_backend(TorchAttnBackend, prefix_lens, extend_lens, padding, dtype, num_heads)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got[:real].float(), expected[:real].float(), atol=tol, rtol=tol)
    assert_same_writes(got_pool, ref_pool, prefix_lens, extend_lens, padding)


@pytest.mark.parametrize("prefix_lens,extend_lens,num_drafts", [
    ([5, 12, 3], [4, 4, 4], [3, 3, 3]),  # every sequence verifies 3 drafts
    ([5, 12, 3, 20, 7], [4, 2, 3, 1, 1], [3, 1, 2, 0, 0]),  # drafts of different lengths beside plain decodes
    ([8, 0, 13, 6, 14, 9], [7, 5, 4, 1, 2, 1], [0, 0, 3, 0, 1, 0]),  # verifies and decodes beside prefill chunks
    ([0, 3], [3, 2], [2, 1]),  # verify chunks with no cached prefix or one token of it
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_heads", [HEADS, KV_HEADS])
def test_verify_steps_equal_the_torch_backend(cpu_backend, prefix_lens, extend_lens, num_drafts, dtype, num_heads):
    """A verify chunk's positions attend as plain decode of each would: the reference runs them as an
    extend (causal over the cached prefix), the CPU backend as query rows of one gather per sequence."""
    got, got_pool, _ = run_backend(cpu_backend, prefix_lens, extend_lens, 0, dtype, num_heads, num_drafts)
    expected, ref_pool, _ = run_backend(TorchAttnBackend, prefix_lens, extend_lens, 0, dtype, num_heads)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), expected.float(), atol=tol, rtol=tol)
    assert_same_writes(got_pool, ref_pool, prefix_lens, extend_lens, 0)


def assert_same_writes(got_pool, ref_pool, prefix_lens, extend_lens, padding) -> None:
    """The pools hold the same K/V, but for the cpu backend's zeros past each sequence's length in a page
    whose first position the step writes (stale_keys.py), worked out here position by position."""
    _, rows, fb = make_batch(prefix_lens, extend_lens, padding)  # (the same page table)
    zeroed = []
    for row, length, fed in zip(fb.req_pool_indices.tolist(), fb.seq_lens_cpu, fb.extend_seq_lens_cpu):
        page_start = (length - 1) // PAGE * PAGE  # the sequence's last page
        if page_start >= length - fed:  # the step writes its first position
            first_slot = int(rows.req_to_token[row, page_start])
            zeroed += [first_slot + p - page_start for p in range(length, page_start + PAGE)]
    assert zeroed, "no sequence starts a page here: nothing to check"
    for got, ref in ((got_pool.k_buffers[0], ref_pool.k_buffers[0]), (got_pool.v_buffers[0], ref_pool.v_buffers[0])):
        expected = ref.clone()
        expected[zeroed] = 0
        assert torch.equal(got, expected)


def test_a_verify_chunk_gathers_its_pages_once(cpu_backend):
    """Sequences are grouped by tokens fed, one gather row per sequence (not per position)."""
    pool, rows, fb = make_batch([5, 12, 3, 20, 7, 8], [4, 2, 4, 1, 1, 6])
    fb.num_drafts_cpu = [3, 1, 3, 0, 0, 0]
    backend = cpu_backend(pool, rows)
    backend.prepare(fb)
    md = fb.attn_metadata
    assert {g.width: g.visible.shape[0] for g in md.decodes} == {4: 2, 2: 1, 1: 2}
    assert {g.width: g.rows.tolist() for g in md.decodes} == {4: [0, 1, 2, 3, 6, 7, 8, 9], 2: [4, 5], 1: [10, 11]}
    assert [(c.start, c.length) for c in md.prefills] == [(12, 6)]
    four = next(g for g in md.decodes if g.width == 4)
    assert four.visible.sum(-1).tolist() == [[6, 7, 8, 9], [4, 5, 6, 7]]  # position j sees prefix + j + 1 keys


def test_auto_is_the_cpu_backend_on_the_cpu_only():
    assert resolve_backend_name("auto", "attention_backend", torch.device("cpu")) == "cpu"
    assert resolve_backend_name("auto", "attention_backend", torch.device("cuda")) == "torch"


def test_the_cpu_backend_off_the_cpu_is_a_clear_error():
    """It reads the page table as host memory: asked for on another device, it says so when built (a meta
    device stands in for CUDA)."""
    caches = SimpleNamespace(kv_pool=None, req_to_token=ReqToTokenPool(4, 16, torch.device("meta")))
    setup = BackendSetup(caches=caches, num_q_heads=4, scaling=0.25, device=torch.device("meta"))
    with pytest.raises(ValueError, match="'cpu' runs on the CPU only"):
        create_attention_backend(setup, "cpu")


@pytest.mark.parametrize("arch", ["qwen3_vl", "qwen3_5"])
def test_engine_on_the_cpu_backend_equals_the_torch_backend_and_hf(request, arch):
    """Whole engines: prompts chunked (max_num_batched_tokens) so chunks run over cached prefixes
    beside decodes, the same conversations twice so the second round hits the prefix cache."""
    from tests.test_engine_parity import assert_matches, params, setup_for
    from vlmrun import LLM

    model_dir, cases, expected = setup_for(request, arch)
    names = list(cases)
    runs = {}
    for backend in ("cpu", "torch"):
        llm = LLM(str(model_dir), dtype="float32", device="cpu", attention_backend=backend,
                  max_num_batched_tokens=48, max_num_seqs=4)
        seen = record_step_kinds(llm.engine.executor.attn_backend) if backend == "cpu" else None
        first = llm.chat([cases[n] for n in names], params(), use_tqdm=False)
        again = llm.chat([cases[n] for n in names], params(), use_tqdm=False)
        assert llm.engine.scheduler.prefix_cache.stats.hits > 0
        if seen is not None:  # the paths this test is for were taken
            assert {"decode_step", "decodes_beside_prefills", "chunk_over_prefix"} <= seen, seen
        runs[backend] = first + again
    for name, ours, ref in zip(names * 2, runs["cpu"], runs["torch"]):
        assert ours.token_ids == ref.token_ids, name
        assert_matches(ours, expected[name], name)


def record_step_kinds(backend) -> set[str]:
    """Wraps the (hybrid or plain) CPU backend's `prepare`; returns the set of step kinds it saw."""
    full = getattr(backend, "full", backend)
    assert isinstance(full, CpuAttnBackend)
    seen: set[str] = set()
    prepare = full.prepare

    def recording(fb):
        prepare(fb)
        md = fb.attn_metadata
        for group in md.decodes:
            seen.add("decode_step" if group.rows is None else "decodes_beside_prefills")
        if any(chunk.mask is not None for chunk in md.prefills):
            seen.add("chunk_over_prefix")

    full.prepare = recording
    return seen
