"""`last_dim_argmax` gives `torch.argmax(x, dim=-1)`'s indices: the first maximum, NaN counting as the
maximum, on rows full of ties, NaN and infinities, at sizes that take the blocked path (each block width)
and sizes that do not (few logits, no dividing width, non-contiguous), and in the sampler's greedy step."""

from __future__ import annotations

import pytest
import torch

from vlmrun.layers.argmax import MIN_ELEMENTS, block_width, last_dim_argmax

NAN, INF = float("nan"), float("inf")


def awkward_logits(rows: int, vocab: int, gen: torch.Generator) -> torch.Tensor:
    """Small integers (ties everywhere) with NaN, +inf and -inf sprinkled in, some rows all -inf or all NaN,
    some rows whose maximum sits in the last entry or in two blocks at once."""
    x = torch.randint(-4, 4, (rows, vocab), generator=gen).float()
    r = torch.rand(rows, vocab, generator=gen)
    x[r < 0.0005] = NAN
    x[(r > 0.5) & (r < 0.5005)] = INF
    x[(r > 0.6) & (r < 0.7)] = -INF
    x[::7] = -INF
    x[3::11] = NAN
    x[5::13, -1] = 1e30  # the maximum in the last entry
    x[6::13, 0] = x[6::13, vocab // 2] = 1e30  # the same maximum in two blocks: the first wins
    return x


@pytest.mark.parametrize("vocab", [512, 4096, 16384, 151936, 248320, 16448, 32 * 257])
def test_blocked_argmax_equals_torch_argmax(vocab: int) -> None:
    gen = torch.Generator().manual_seed(vocab)
    rows = max(-(-MIN_ELEMENTS // vocab), 130)
    assert block_width(vocab) is not None  # each of these takes the blocked path
    for _ in range(3):
        x = awkward_logits(rows, vocab, gen)
        assert x.numel() >= MIN_ELEMENTS
        assert torch.equal(last_dim_argmax(x), x.argmax(dim=-1))
        y = torch.randn(rows, vocab, generator=gen)  # plain logits: no ties
        assert torch.equal(last_dim_argmax(y), y.argmax(dim=-1))


def test_block_width_per_vocabulary() -> None:
    assert block_width(512) == 32 and block_width(151936) == 128 and block_width(248320) == 128
    assert block_width(16384 + 64) == 64  # 128 does not divide it
    assert block_width(8191) is None and block_width(32) is None  # a prime; a single block


@pytest.mark.parametrize("shape", [(1, 512), (0, 512), (300, 8191), (130, 1000)])
def test_the_plain_argmax_where_blocks_do_not_pay_or_fit(shape: tuple[int, int]) -> None:
    x = awkward_logits(*shape, torch.Generator().manual_seed(1))
    assert torch.equal(last_dim_argmax(x), x.argmax(dim=-1))
    wide = awkward_logits(256, 1024, torch.Generator().manual_seed(2))[:, :512]  # non-contiguous
    assert torch.equal(last_dim_argmax(wide), wide.argmax(dim=-1))


def test_the_sampler_takes_it_for_greedy_rows(monkeypatch) -> None:
    """The all-greedy step and the greedy rows of a mixed step go through last_dim_argmax, same tokens."""
    from vlmrun.layers import sampler as sampler_module
    from vlmrun.layers.sampler import Sampler
    from vlmrun.layers.sampling_batch import SamplingBatch
    from vlmrun.sampling_params import SamplingParams

    calls = []
    monkeypatch.setattr(sampler_module, "last_dim_argmax", lambda x: calls.append(x.shape) or last_dim_argmax(x))
    gen = torch.Generator().manual_seed(3)
    logits = awkward_logits(256, 512, gen).nan_to_num(nan=0.0)
    greedy = [(SamplingParams(temperature=0.0), [1], [], None, [0], None)] * 256
    out = Sampler().sample(logits, SamplingBatch.build(greedy, 512, device="cpu"))
    assert torch.equal(out.token_ids, logits.argmax(dim=-1)) and calls == [(256, 512)]
    calls.clear()  # half greedy, half sampled: the race's argmax and the greedy rows' both
    mixed = greedy[:128] + [(SamplingParams(temperature=0.8, seed=5), [1], [], None, [0], None)] * 128
    out = Sampler(torch.Generator().manual_seed(4)).sample(logits, SamplingBatch.build(mixed, 512, device="cpu"))
    assert torch.equal(out.token_ids[:128], logits[:128].argmax(dim=-1)) and calls == [(256, 512), (256, 512)]
