"""The paged decode kernel (vlmrun/layers/attention/paged_decode.c) against torch's SDPA over gathered pages.

The reference here is written out independently of the CPU backend: each sequence's keys and values taken
position by position from the pool through its pages, SDPA with the keys past what each query position sees
masked out. Shapes: the head dims the kernel is used with and an odd one, GQA groups 1 to 7, plain decode
(width 1) and verify rows (width 3), float32 and bfloat16 pools, one and two threads; pages scattered over the
pool. Then the build itself: one library per ISA torch runs (each gives the same values), reused from the cache,
and no kernel (the backend gathers) without a compiler, off Linux, or switched off.
"""

from __future__ import annotations

import logging
import platform

import pytest
import torch
import torch.nn.functional as F

from tests.kernel_builds import require_paged_decode
from vlmrun.cache.kv_pool import KVPool, ReqToTokenPool
from vlmrun.layers.attention import paged_decode
from vlmrun.layers.attention.cpu_backend import CpuAttnBackend
from vlmrun.layers.attention.paged_decode import build_paged_decode, compiler_flags, load_paged_decode
from vlmrun.layers.cpu_kernels import cpu_features


@pytest.fixture(scope="module")
def kernel():
    return require_paged_decode()


def make_case(seqs, kv_heads, group, head_dim, width, dtype, page=16, seed=0):
    """A pool with `seqs` sequences on scattered pages; q [seqs * width, heads, head_dim]; sees [seqs, width]."""
    gen = torch.Generator().manual_seed(seed)
    lens = torch.randint(width, 5 * page, (seqs,), generator=gen)  # tokens in the cache, the fed ones included
    max_pages = int(-(-lens.max() // page))
    num_pages = seqs * max_pages + 8
    order = torch.randperm(num_pages, generator=gen)
    pages = order[:seqs * max_pages].view(seqs, max_pages).contiguous()
    k = torch.randn(num_pages * page, kv_heads, head_dim, generator=gen).to(dtype)
    v = torch.randn(num_pages * page, kv_heads, head_dim, generator=gen).to(dtype)
    q = torch.randn(seqs * width, kv_heads * group, head_dim, generator=gen).to(dtype)
    sees = (lens - (width - 1))[:, None] + torch.arange(width)  # position j sees prefix + j + 1 keys
    return q, k, v, pages, sees.contiguous(), page


def reference(q, k, v, pages, sees, page, scale):
    """SDPA per sequence over its keys gathered position by position (float32), the unseen ones masked."""
    seqs, width = sees.shape
    heads, head_dim = q.shape[1], q.shape[2]
    kv_heads = k.shape[1]
    out = torch.empty(seqs * width, heads, head_dim)
    for b in range(seqs):
        n = int(sees[b].max())
        slots = torch.tensor([int(pages[b, pos // page]) * page + pos % page for pos in range(n)])
        keys, values = k[slots].float().transpose(0, 1), v[slots].float().transpose(0, 1)  # [kv_heads, n, head_dim]
        rows = q[b * width:(b + 1) * width].float().transpose(0, 1)  # [heads, width, head_dim]
        mask = torch.arange(n)[None, :] < sees[b][:, None]  # [width, n]
        got = F.scaled_dot_product_attention(rows, keys.repeat_interleave(heads // kv_heads, 0),
                                             values.repeat_interleave(heads // kv_heads, 0), attn_mask=mask, scale=scale)
        out[b * width:(b + 1) * width] = got.transpose(0, 1)
    return out


@pytest.mark.parametrize("head_dim", [16, 64, 128, 72])
@pytest.mark.parametrize("group", [1, 2, 7])
@pytest.mark.parametrize("width", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernel_equals_sdpa_over_gathered_pages(kernel, head_dim, group, width, dtype):
    q, k, v, pages, sees, page = make_case(9, 2, group, head_dim, width, dtype)
    scale = head_dim ** -0.5
    got = kernel.attend(q, k, v, pages, sees, page, scale)
    assert got.dtype == dtype and got.shape == q.shape
    tol = 2e-6 if dtype == torch.float32 else 1e-2  # (bfloat16: the output's own rounding)
    torch.testing.assert_close(got.float(), reference(q, k, v, pages, sees, page, scale), atol=tol, rtol=tol)


def test_large_scores_keep_their_softmax(kernel):
    """Scores far from 0 (q x 60: differences of hundreds): the row maximum taken out, the tiny weights cut at
    e^-87 as SDPA's underflow to 0, the rest as SDPA's."""
    q, k, v, pages, sees, page = make_case(7, 2, 2, 64, 3, torch.float32, seed=9)
    q = q * 60
    torch.testing.assert_close(kernel.attend(q, k, v, pages, sees, page, 0.125),
                               reference(q, k, v, pages, sees, page, 0.125), atol=2e-5, rtol=2e-5)


def test_no_scratch_memory_is_an_error_not_a_wrong_answer(kernel):
    """A scratch row the kernel cannot allocate (here: keys for 2^54 positions) makes it return 1 and write
    nothing; `attend` turns that into a MemoryError."""
    q = torch.randn(1, 2, 16)
    out = torch.full_like(q, 7.0)
    pool, one = torch.zeros(16, 2, 16), torch.ones(1, 1, dtype=torch.int64)
    failed = kernel._fn(q.data_ptr(), pool.data_ptr(), pool.data_ptr(), 0, one.data_ptr(), 2 ** 50, one.data_ptr(),
                        1, 1, 2, 1, 16, 16, 0.25, out.data_ptr(), 1)
    assert failed == 1 and (out == 7.0).all()


def test_two_threads_give_the_same_values(kernel):
    q, k, v, pages, sees, page = make_case(33, 4, 2, 64, 1, torch.float32, seed=3)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = kernel.attend(q, k, v, pages, sees, page, 0.125)
        torch.set_num_threads(2)
        two = kernel.attend(q, k, v, pages, sees, page, 0.125)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)  # each (sequence, KV head) computed the same way by whichever thread


def test_a_nan_stays_in_its_own_sequence(kernel):
    """A sequence whose keys hold a NaN gets NaN; the other sequences' rows are as without it."""
    q, k, v, pages, sees, page = make_case(6, 2, 2, 64, 1, torch.float32, seed=5)
    clean = kernel.attend(q, k, v, pages, sees, page, 0.125)
    k[int(pages[2, 0]) * page] = float("nan")  # sequence 2's first key
    got = kernel.attend(q, k, v, pages, sees, page, 0.125)
    assert got[2].isnan().all()
    others = [b for b in range(6) if b != 2]
    assert torch.equal(got[others], clean[others])


def supported_builds() -> list[str]:
    """The capabilities this CPU runs, as torch names them (a build for each is checked here)."""
    here = cpu_features().capability
    return {"AVX512": ["DEFAULT", "AVX2", "AVX512"], "AVX2": ["DEFAULT", "AVX2"]}.get(here, ["DEFAULT"])


@pytest.mark.parametrize("capability", ["DEFAULT", "AVX2", "AVX512"])
def test_each_isa_build_gives_the_values(kernel, tmp_path, capability):
    if capability not in supported_builds():
        pytest.skip(f"this CPU (torch capability {cpu_features().capability}) does not run {capability} code")
    built = build_paged_decode(tmp_path, kernel.compiler, capability)
    assert ("-mavx512f" in built.flags) == (capability == "AVX512") and ("-mavx2" in built.flags) == (capability != "DEFAULT")
    q, k, v, pages, sees, page = make_case(5, 2, 2, 64, 3, torch.float32, seed=7)
    torch.testing.assert_close(built.attend(q, k, v, pages, sees, page, 0.125),
                               reference(q, k, v, pages, sees, page, 0.125), atol=2e-6, rtol=2e-6)


def test_each_isa_and_compiler_has_its_own_library(kernel, tmp_path):
    """The cache key covers the flags (one library per ISA in one folder) and the compiler command (`$CC` may be
    a command with arguments: "env gcc" here)."""
    default = build_paged_decode(tmp_path, kernel.compiler, "DEFAULT")
    other = build_paged_decode(tmp_path, f"env {kernel.compiler}", "DEFAULT")  # (a version line of its own? same)
    assert other.path == default.path  # the same compiler underneath: the same library
    if "AVX2" in supported_builds():
        assert build_paged_decode(tmp_path, kernel.compiler, "AVX2").path != default.path


def test_a_cached_library_that_does_not_load_is_built_again(kernel, tmp_path):
    first = build_paged_decode(tmp_path / "a", kernel.compiler, "DEFAULT")  # (loaded: its file is left as it is)
    cut = tmp_path / "b" / first.path.name
    cut.parent.mkdir()
    cut.write_bytes(first.path.read_bytes()[:100])  # a build cut short, under the name a build would take
    again = build_paged_decode(tmp_path / "b", kernel.compiler, "DEFAULT")
    assert again.path == cut and cut.stat().st_size == first.path.stat().st_size
    q, k, v, pages, sees, page = make_case(3, 2, 2, 16, 1, torch.float32)
    torch.testing.assert_close(again.attend(q, k, v, pages, sees, page, 0.25),
                               reference(q, k, v, pages, sees, page, 0.25), atol=2e-6, rtol=2e-6)


def test_a_build_is_reused_from_the_cache(kernel, tmp_path, monkeypatch):
    first = build_paged_decode(tmp_path, kernel.compiler, "DEFAULT")
    stamp = first.path.stat().st_mtime_ns
    calls = []
    real_run = paged_decode.subprocess.run
    monkeypatch.setattr(paged_decode.subprocess, "run", lambda cmd, **kw: calls.append(cmd) or real_run(cmd, **kw))
    again = build_paged_decode(tmp_path, kernel.compiler, "DEFAULT")
    assert again.path == first.path and again.path.stat().st_mtime_ns == stamp
    assert [cmd[1] for cmd in calls] == ["--version"]  # the compiler asked its version, not run on the source
    assert list(tmp_path.iterdir()) == [first.path]  # (no temporary left behind)


def test_the_isa_flags_follow_torchs_capability():
    assert not any(f.startswith("-mavx") for f in compiler_flags("DEFAULT") + compiler_flags("SVE256"))
    assert "-mavx2" in compiler_flags("AVX2") and "-mavx512f" not in compiler_flags("AVX2")
    assert {"-mavx512f", "-mavx512bw", "-mavx512dq", "-mavx512vl"} <= set(compiler_flags("AVX512"))
    assert "-ffast-math" not in compiler_flags("AVX512")  # infinities and NaN keep their meaning


@pytest.fixture
def fresh_load(monkeypatch, tmp_path):
    """`load_paged_decode` as a new process calls it, with its cache in `tmp_path`."""
    monkeypatch.setenv("VLMRUN_KERNEL_CACHE", str(tmp_path))
    paged_decode._load_once.cache_clear()
    yield load_paged_decode
    paged_decode._load_once.cache_clear()


def test_without_a_compiler_the_backend_gathers(fresh_load, monkeypatch, caplog):
    monkeypatch.setenv("CC", "/nonexistent/cc")
    with caplog.at_level(logging.WARNING, logger=paged_decode.__name__):
        assert fresh_load() is None
    if platform.system() == "Linux":
        assert "could not be built" in caplog.text and "copies each step's KV pages" in caplog.text


def test_switched_off_it_is_not_built(fresh_load, monkeypatch, tmp_path):
    monkeypatch.setenv("VLMRUN_CPU_PAGED_DECODE", "0")
    assert fresh_load() is None
    assert not any(tmp_path.iterdir())


def test_switched_off_after_a_load_the_next_backends_gather(kernel, monkeypatch):
    assert load_paged_decode() is not None
    monkeypatch.setenv("VLMRUN_CPU_PAGED_DECODE", "0")
    assert load_paged_decode() is None


def test_a_float8_pool_gathers(kernel):
    """The kernel reads float32 and bfloat16 pools; a float8 one is dequantized as its pages are gathered."""
    rows = ReqToTokenPool(4, 64, torch.device("cpu"))
    fp8 = KVPool(1, 64, 2, 16, torch.float8_e4m3fn, torch.device("cpu"), page_size=16, compute_dtype=torch.bfloat16)
    bf16 = KVPool(1, 64, 2, 16, torch.bfloat16, torch.device("cpu"), page_size=16)
    assert CpuAttnBackend(fp8, rows, paged_decode=kernel).paged_decode is None
    assert CpuAttnBackend(bf16, rows, paged_decode=kernel).paged_decode is kernel
