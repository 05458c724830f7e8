"""Padded decode's batches (executor/bucketed_steps.py `BucketedStepInputs`) come from the one `ForwardBatch.build`,
reading the static buffers a CUDA graph replays (`device_lens`), with host lengths equal to the device's."""

from __future__ import annotations

import torch

from vlmrun.executor.bucketed_steps import PAD_GDN_SLOT, BucketedStepInputs
from vlmrun.forward_batch import ForwardBatch, ForwardMode
from vlmrun.host_to_device import upload

CPU = torch.device("cpu")


def to_cpu(t: torch.Tensor) -> torch.Tensor:
    return upload(t, CPU)


def step(prefixes: list[int], lens: list[int]) -> ForwardBatch:
    """A step of sequences feeding `lens[i]` tokens after `prefixes[i]` cached ones (rows 1.., slots 100..)."""
    n, tokens = len(lens), sum(lens)
    return ForwardBatch.build(
        input_ids=torch.arange(10, 10 + tokens), positions=torch.arange(tokens).expand(3, -1).contiguous(),
        req_pool_indices=torch.arange(1, n + 1), extend_prefix_lens=prefixes, extend_seq_lens=lens,
        out_cache_loc=torch.arange(100, 100 + tokens), logits_indices=torch.arange(tokens), to_device=to_cpu,
        state_slots=torch.arange(2, n + 2), num_drafts=[k - 1 for k in lens])


def assert_consistent(fb: ForwardBatch) -> None:
    assert fb.seq_lens.tolist() == fb.seq_lens_cpu
    assert fb.extend_prefix_lens.tolist() == fb.extend_prefix_lens_cpu
    assert fb.extend_seq_lens.tolist() == fb.extend_seq_lens_cpu
    assert fb.seq_lens_cpu == [p + n for p, n in zip(fb.extend_prefix_lens_cpu, fb.extend_seq_lens_cpu)]


def test_build_takes_lengths_already_on_the_device():
    seq, prefix, extend = torch.tensor([4, 6]), torch.tensor([3, 5]), torch.ones(2, dtype=torch.int64)
    fb = ForwardBatch.build(input_ids=torch.zeros(2, dtype=torch.int64), positions=torch.zeros(3, 2, dtype=torch.int64),
                            req_pool_indices=torch.tensor([1, 2]), extend_prefix_lens=[3, 5], extend_seq_lens=[1, 1],
                            out_cache_loc=torch.tensor([7, 8]), logits_indices=torch.arange(2), to_device=to_cpu,
                            device_lens=(seq, prefix, extend))
    assert fb.seq_lens is seq and fb.extend_prefix_lens is prefix and fb.extend_seq_lens is extend
    assert fb.mode is ForwardMode.DECODE and fb.seq_lens_cpu == [4, 6]


def test_padded_batches_come_from_the_factory_over_the_static_buffers(monkeypatch):
    built = []
    build = ForwardBatch.build.__func__

    def spying(cls, **kwargs):
        built.append(kwargs.get("device_lens") is not None)
        return build(cls, **kwargs)

    inputs = BucketedStepInputs(max_batch=8, dummy_row=9, hybrid=True, device=CPU, width=3)
    decode, verify = step([4, 7, 2], [1, 1, 1]), step([5, 3], [3, 2])
    monkeypatch.setattr(ForwardBatch, "build", classmethod(spying))

    padded = inputs.fill(decode, 4)
    assert padded.mode is ForwardMode.DECODE and padded.batch_size == 4 and padded.num_drafts_cpu is None
    assert padded.seq_lens.data_ptr() == inputs.seq_lens.data_ptr()  # the buffers a graph reads
    assert padded.input_ids.data_ptr() == inputs.input_ids.data_ptr()
    assert padded.req_pool_indices.tolist() == [1, 2, 3, 9] and padded.state_slots.tolist() == [2, 3, 4, PAD_GDN_SLOT]
    assert padded.seq_lens_cpu == [5, 8, 3, 1]
    assert_consistent(padded)

    padded, real = inputs.fill_verify(verify, 4)
    assert padded.mode is ForwardMode.EXTEND and padded.num_tokens == 12 and padded.num_drafts_cpu == [2] * 4
    assert padded.seq_lens.data_ptr() == inputs.seq_lens.data_ptr()
    assert real.tolist() == [0, 1, 2, 3, 4] and padded.input_ids[:6].tolist() == [10, 11, 12, 13, 14, 0]
    assert padded.seq_lens_cpu == [8, 6, 3, 3]
    assert_consistent(padded)
    assert built == [True, True]  # both through the one factory, on the buffers
