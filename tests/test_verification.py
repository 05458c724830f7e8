"""`Verification` (spec_decode/verify.py): a step's verification as one object: its rows, and acceptance on the
device equal to acceptance on the host, for a step that mixes speculating, plain and mid-prompt chunks."""

from __future__ import annotations

import torch

from vlmrun.layers.sampling_batch import SamplingRow
from vlmrun.sampling_params import SamplingParams
from vlmrun.spec_decode.verify import Verification, count_accepted


def test_no_drafts_no_verification() -> None:
    row = SamplingRow(SamplingParams(temperature=0.0), [1, 2], [3])
    assert Verification.of([row, None], [[], []]) is None


def test_acceptance_on_device_equals_host() -> None:
    greedy = SamplingParams(temperature=0.0)
    rows = [SamplingRow(greedy, [1], [2]), None, SamplingRow(greedy, [4], [5]), SamplingRow(greedy, [6], [7])]
    drafts = [[10, 11, 12], [], [20], [30, 31]]  # chunk 1 ends mid-prompt: it neither samples nor drafts
    verification = Verification.of(rows, drafts)
    positions = verification.position_rows([None] * 4)
    assert len(positions) == 4 + 2 + 3  # 1 + drafts positions per sampling chunk
    assert [list(r.output_token_ids) for r in positions[:4]] == [[2], [2, 10], [2, 10, 11], [2, 10, 11, 12]]
    sampled = [10, 11, 99, 7, 21, 5, 30, 31, 8]  # chunk 0 keeps 2 drafts, chunk 2 none, chunk 3 both
    first_rows = [0, 4, 4, 6]
    on_device = verification.accepted_on_device(torch.tensor(sampled), first_rows, None, torch.device("cpu"))
    on_host = [count_accepted(sampled[f:f + 1 + len(d)], d) if d else 0 for f, d in zip(first_rows, drafts)]
    assert on_device.tolist() == on_host == [2, 0, 0, 2]
    verification.before_sampling(64, torch.device("cpu"))
    assert [verification.emitted(sampled[f:f + 1 + len(d)], d, s) for f, d, s in
            zip(first_rows, drafts, verification.seeded) if d] == [2, 0, 2]
