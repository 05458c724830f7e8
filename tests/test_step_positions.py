"""`step_positions`: the step's M-RoPE positions made in one tensor op for the chunks past their prompt
(`ChunkInput.positions` None: `start + i + mrope_delta`), prompt chunks' own positions copied in."""

from __future__ import annotations

import torch

from vlmrun.executor.step_input import ChunkInput, step_positions


def chunk(start: int, n: int, delta: int = 0, positions: torch.Tensor | None = None, drafts: int = 0) -> ChunkInput:
    return ChunkInput(row=1, start=start, token_ids=[5] * n, positions=positions, mrope_delta=delta,
                      kv_slots=torch.zeros(n, dtype=torch.int64), mm_items=(), num_drafts=drafts)


def test_decode_rows_are_start_plus_delta():
    chunks = [chunk(7, 1, delta=-3), chunk(20, 1), chunk(4, 1, delta=11)]
    expected = torch.tensor([4, 20, 15]).expand(3, -1)
    assert torch.equal(step_positions(chunks, [1, 1, 1]), expected)


def test_mixed_step_equals_each_chunks_positions():
    prompt = torch.tensor([[0, 1, 2, 2, 2], [0, 1, 2, 3, 4], [0, 1, 5, 6, 7]])  # an image's M-RoPE rows
    chunks = [chunk(9, 1, delta=-2), chunk(0, 5, positions=prompt), chunk(12, 4, delta=5, drafts=3),
              chunk(3, 2, delta=1)]
    positions = step_positions(chunks, [c.num_tokens for c in chunks])
    assert torch.equal(positions, torch.cat([c.position_ids() for c in chunks], dim=1))
    assert positions[:, 6:10].tolist() == [[17, 18, 19, 20]] * 3
    assert positions.is_contiguous() and positions.dtype == torch.int64
