"""What the FlashInfer backend plans with, checked on the CPU against the torch backend.

`build_paged_kv_index` is plain torch: for batches mixing prefills, prefill chunks over a cached
prefix and decodes (pages scattered over the pool, a padding row on the dummy row), attention
computed from the CSR index with FlashInfer's documented semantics (NHD pages, the last page cut
at `kv_last_page_len`, causal masks aligned bottom-right) must equal the torch backend's output.
The kernels themselves run only on CUDA (tests/test_gpu_kernels.py). Also on the CPU: what the
backend refuses (`flashinfer_refusal`: float32, head dims FlashInfer 0.6's kernels lack on a device),
and that the cache plan's reserve holds the decode graphs' shared index buffers.
"""

from __future__ import annotations

import random

import pytest
import torch

from vlmrun.cache.kv_pool import KVPool, ReqToTokenPool, pages_needed, token_slots
from vlmrun.cache.plan import (
    FLASHINFER_FLOAT_WORKSPACE_BYTES,
    FLASHINFER_INT_WORKSPACE_BYTES,
    LONGEST_CONTEXT,
    flashinfer_reserve_bytes,
)
from vlmrun.config import EngineConfig
from vlmrun.forward_batch import ForwardBatch, ForwardMode
from vlmrun.layers.attention.base import Attention
from vlmrun.layers.attention.flashinfer_backend import (
    GraphIndexBuffers,
    PagedKVIndex,
    build_paged_kv_index,
    flashinfer_refusal,
    verify_positions,
)
from vlmrun.layers.attention.kernels import BackendUnavailable, import_fla, import_flashinfer
from vlmrun.layers.attention.torch_backend import TorchAttnBackend

PAGE, HEADS, KV_HEADS, HEAD_DIM = 4, 8, 2, 16


def reference_from_index(q: torch.Tensor, pool: KVPool, index: PagedKVIndex, scale: float) -> torch.Tensor:
    """Attention read through the CSR index as FlashInfer reads it. q [T, H, D] -> [T, H, D]."""
    k_pages = pool.k_buffers[0].view(-1, PAGE, KV_HEADS, pool.head_dim)
    v_pages = pool.v_buffers[0].view(-1, PAGE, KV_HEADS, pool.head_dim)
    kv_indices = index.kv_indices.long()
    out = torch.empty_like(q)
    for i in range(len(index.qo_indptr) - 1):
        q0, q1 = index.qo_indptr[i].item(), index.qo_indptr[i + 1].item()
        pages = kv_indices[index.kv_indptr[i]:index.kv_indptr[i + 1]]
        kv_len = (len(pages) - 1) * PAGE + index.kv_last_page_len[i].item()
        k = k_pages[pages].flatten(0, 1)[:kv_len].repeat_interleave(HEADS // KV_HEADS, dim=1)  # [kv_len, H, D]
        v = v_pages[pages].flatten(0, 1)[:kv_len].repeat_interleave(HEADS // KV_HEADS, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[q0:q1], k) * scale
        q_pos = torch.arange(q1 - q0).view(-1, 1) + kv_len - (q1 - q0)  # bottom-right causal
        scores = scores.masked_fill(torch.arange(kv_len).view(1, -1) > q_pos, float("-inf"))
        out[q0:q1] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
    return out


def make_batch(prefix_lens: list[int], extend_lens: list[int], padding_rows: int = 0, seed: int = 0,
               device: str = "cpu", dtype: torch.dtype = torch.float32, head_dim: int = HEAD_DIM):
    """A pool with requests on shuffled pages, their page-table rows, and the ForwardBatch of one step."""
    rng = random.Random(seed)
    device = torch.device(device)
    num_pages = 64
    pool = KVPool(1, num_pages * PAGE, KV_HEADS, head_dim, dtype, device, PAGE)
    rows = ReqToTokenPool(8, 64, device)
    free = list(range(1, num_pages))
    rng.shuffle(free)
    gen = torch.Generator().manual_seed(seed)
    pool.k_buffers[0].copy_(torch.randn(pool.k_buffers[0].shape, generator=gen).to(dtype))
    pool.v_buffers[0].copy_(torch.randn(pool.v_buffers[0].shape, generator=gen).to(dtype))
    out_loc, seq_lens = [], []
    for row, (prefix, n) in enumerate(zip(prefix_lens, extend_lens)):
        total = prefix + n
        pages = [free.pop() for _ in range((total + PAGE - 1) // PAGE)]
        slots = torch.tensor(token_slots(pages, 0, total, PAGE), dtype=torch.int64)
        rows.req_to_token[row, :total] = slots.to(device)
        out_loc.append(slots[prefix:])
        seq_lens.append(total)
    req_rows = list(range(len(prefix_lens))) + [rows.dummy_row] * padding_rows
    prefix_lens = prefix_lens + [0] * padding_rows
    extend_lens = extend_lens + [1] * padding_rows
    seq_lens = seq_lens + [1] * padding_rows
    out_loc += [torch.zeros(1, dtype=torch.int64)] * padding_rows
    num_tokens = sum(extend_lens)
    long = dict(dtype=torch.int64, device=device)
    fb = ForwardBatch(
        mode=ForwardMode.DECODE if all(n == 1 for n in extend_lens) else ForwardMode.EXTEND,
        input_ids=torch.zeros(num_tokens, **long), positions=torch.zeros(3, num_tokens, **long),
        req_pool_indices=torch.tensor(req_rows, **long), seq_lens=torch.tensor(seq_lens, **long),
        extend_prefix_lens=torch.tensor(prefix_lens, **long), extend_seq_lens=torch.tensor(extend_lens, **long),
        out_cache_loc=torch.cat(out_loc).to(device), seq_lens_cpu=seq_lens, extend_prefix_lens_cpu=prefix_lens,
        extend_seq_lens_cpu=extend_lens, logits_indices=torch.zeros(0, **long))
    return pool, rows, fb


@pytest.mark.parametrize("prefix_lens,extend_lens,padding", [
    ([0, 0], [9, 4], 0),  # two prefills, one ending mid-page, one on a page boundary
    ([8, 0, 13], [7, 5, 1], 0),  # a chunk over a cached prefix, a prefill, a decode
    ([5, 12, 3], [1, 1, 1], 1),  # a decode step of 3 padded to 4 (one row on the dummy row)
    ([0], [1], 0),  # one token, one page
])
def test_index_reads_what_the_torch_backend_reads(prefix_lens, extend_lens, padding):
    pool, rows, fb = make_batch(prefix_lens, extend_lens, padding)
    backend = TorchAttnBackend(pool, rows)
    fb.attn_backend = backend
    layer = Attention(HEADS, KV_HEADS, HEAD_DIM, HEAD_DIM ** -0.5, layer_id=0)
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(fb.num_tokens, HEADS * HEAD_DIM, generator=gen)
    k = torch.randn(fb.num_tokens, KV_HEADS * HEAD_DIM, generator=gen)
    v = torch.randn(fb.num_tokens, KV_HEADS * HEAD_DIM, generator=gen)
    backend.prepare(fb)
    expected = backend.forward(q, k, v, layer, fb).view(-1, HEADS, HEAD_DIM)  # also writes k, v

    index = build_paged_kv_index(rows.req_to_token, fb.req_pool_indices, fb.seq_lens_cpu, fb.extend_seq_lens_cpu,
                                 PAGE)
    assert index.qo_indptr.dtype == index.kv_indptr.dtype == index.kv_indices.dtype == torch.int32
    assert index.qo_indptr.tolist()[-1] == fb.num_tokens
    assert all(1 <= n <= PAGE for n in index.kv_last_page_len.tolist())
    got = reference_from_index(q.view(-1, HEADS, HEAD_DIM), pool, index, HEAD_DIM ** -0.5)
    real = fb.num_tokens - padding  # padding rows' outputs are dropped
    torch.testing.assert_close(got[:real], expected[:real], atol=1e-5, rtol=1e-5)
    if padding:  # padding rows read the dummy page only
        assert index.kv_indices[-padding:].tolist() == [0] * padding


@pytest.mark.parametrize("padding", [0, 1])
def test_verify_step_as_decode_rows_reads_what_the_torch_backend_reads(padding):
    """A verify step (last token + drafts per sequence, one sequence without drafts) planned as one
    decode row per position: each row attends to its sequence up to itself, as the causal extend does."""
    pool, rows, fb = make_batch([8, 13, 5], [4, 1, 3], padding)
    fb.num_drafts_cpu = [3, 0, 2] + [0] * padding
    backend = TorchAttnBackend(pool, rows)
    fb.attn_backend = backend
    layer = Attention(HEADS, KV_HEADS, HEAD_DIM, HEAD_DIM ** -0.5, layer_id=0)
    gen = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(fb.num_tokens, n * HEAD_DIM, generator=gen) for n in (HEADS, KV_HEADS, KV_HEADS))
    backend.prepare(fb)
    expected = backend.forward(q, k, v, layer, fb).view(-1, HEADS, HEAD_DIM)

    positions = verify_positions(fb)
    assert positions is not None and positions[0].tolist() == [0] * 4 + [1] + [2] * 3 + [rows.dummy_row] * padding
    assert positions[1] == [9, 10, 11, 12, 14, 6, 7, 8] + [1] * padding
    index = build_paged_kv_index(rows.req_to_token, positions[0], positions[1], [1] * fb.num_tokens, PAGE)
    got = reference_from_index(q.view(-1, HEADS, HEAD_DIM), pool, index, HEAD_DIM ** -0.5)
    torch.testing.assert_close(got[:fb.num_tokens - padding], expected[:fb.num_tokens - padding], atol=1e-5, rtol=1e-5)
    fb.num_drafts_cpu = None  # not a verify step
    assert verify_positions(fb) is None


def test_fast_backends_give_clear_errors_on_the_cpu():
    with pytest.raises(BackendUnavailable, match="attention_backend='flashinfer' runs on CUDA only"):
        import_flashinfer(torch.device("cpu"))
    with pytest.raises(BackendUnavailable, match="gdn_backend='fla' runs on CUDA only"):
        import_fla(torch.device("cpu"))


def test_engine_option_errors(qwen3_dir):
    from vlmrun import LLM

    with pytest.raises(ValueError, match="runs on CUDA only"):
        LLM(str(qwen3_dir), device="cpu", attention_backend="flashinfer")
    with pytest.raises(ValueError, match="unknown attention_backend 'flash'"):
        LLM(str(qwen3_dir), device="cpu", attention_backend="flash")


def test_missing_package_names_the_extra():
    from vlmrun.layers.attention import kernels

    with pytest.raises(BackendUnavailable, match=r"needs the flashinfer-python package.*pip install 'vlmrun\[gpu\]'"):
        kernels._import("vlmrun_no_such_module", "attention_backend='flashinfer'", "flashinfer-python")


@pytest.mark.parametrize("head_dim,dtype,refused", [
    (128, torch.bfloat16, None),
    (256, torch.float16, None),
    (64, torch.bfloat16, None),
    (96, torch.bfloat16, None),  # FA2 runs it on every GPU (FA3 would not: it is not used)
    (16, torch.bfloat16, "FA2"),  # the tiny test models' head dims: under 64, fewer than 4 MMA tiles
    (32, torch.bfloat16, "FA2"),
    (72, torch.bfloat16, "FA2"),  # not a multiple of 16
    (128, torch.float32, "float16 and bfloat16 only"),  # no float32 entry in its JIT
])
def test_flashinfer_refusal(head_dim, dtype, refused):
    reason = flashinfer_refusal(head_dim, dtype)
    if refused is None:
        assert reason is None
    else:
        assert reason is not None and refused in reason and (str(head_dim) in reason or dtype == torch.float32)


@pytest.mark.parametrize("max_num_seqs,max_model_len,page_size", [(256, None, 16), (8, 4096, 1), (64, 300_000, 16)])
def test_reserve_holds_the_graph_index_buffers(max_num_seqs, max_model_len, page_size):
    """The budget reserve covers the workspaces and the index buffers the backend allocates for a page
    table of max_num_seqs rows (+ the dummy) of max_model_len tokens, the longest context when unset."""
    config = EngineConfig(attention_backend="flashinfer", max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                          page_size=page_size)
    rows = ReqToTokenPool(max_num_seqs, max_model_len or LONGEST_CONTEXT, torch.device("meta"))
    buffers = GraphIndexBuffers.allocate(rows.req_to_token.shape[0],
                                         pages_needed(rows.req_to_token.shape[1], page_size), torch.device("meta"))
    index_bytes = sum(t.numel() * t.element_size() for t in vars(buffers).values())
    workspaces = FLASHINFER_FLOAT_WORKSPACE_BYTES + FLASHINFER_INT_WORKSPACE_BYTES
    assert workspaces + index_bytes <= flashinfer_reserve_bytes(config)
    assert flashinfer_reserve_bytes(EngineConfig(attention_backend="torch")) == 0


def test_a_missing_dependency_is_named(tmp_path, monkeypatch):
    """A package that is installed but whose own import fails names the missing module, not itself."""
    from vlmrun.layers.attention import kernels

    (tmp_path / "vlmrun_fake_kernels.py").write_text("import vlmrun_missing_dependency\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(BackendUnavailable, match="needs the module 'vlmrun_missing_dependency'"):
        kernels._import("vlmrun_fake_kernels", "attention_backend='flashinfer'", "flashinfer-python")
