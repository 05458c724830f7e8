"""Gated DeltaNet reference ops: chunked = recurrent, pieces = whole, parity with HF's torch functions.

vlmrun keeps the recurrent state as [..., Hv, Dv, Dk]; HF keeps [..., H, Dk, Dv], so states are
transposed when compared with HF.
"""

from __future__ import annotations

import pytest
import torch
from transformers.models.qwen3_5 import modeling_qwen3_5 as hf
from transformers.utils import logging as hf_logging

from vlmrun.layers.gdn_ops import (
    causal_conv1d,
    causal_conv1d_step,
    chunk_gated_delta_rule,
    recurrent_gated_delta_rule,
)

hf_logging.set_verbosity_error()  # HF notes that flash-linear-attention is missing and falls back to torch

ATOL = 1e-5
HK, HV, DK, DV, K = 2, 4, 16, 8, 4  # GQA-style grouping: each q/k head serves two value heads


def rand_inputs(length: int, n: int = 1, seed: int = 0, dtype: torch.dtype = torch.float32):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(n, length, HK, DK, generator=gen)
    k = torch.randn(n, length, HK, DK, generator=gen)
    v = torch.randn(n, length, HV, DV, generator=gen)
    g = -torch.rand(n, length, HV, generator=gen) * 0.5  # log-decay <= 0
    beta = torch.rand(n, length, HV, generator=gen)
    return tuple(t.to(dtype) for t in (q, k, v)) + (g, beta.to(dtype))


def rand_state(n: int = 1, seed: int = 1) -> torch.Tensor:
    return torch.randn(n, HV, DV, DK, generator=torch.Generator().manual_seed(seed)) * 0.5  # [N, Hv, Dv, Dk]


def close(a: torch.Tensor, b: torch.Tensor, atol: float = ATOL) -> None:
    torch.testing.assert_close(a, b, atol=atol, rtol=1e-5)


@pytest.mark.parametrize("length", [1, 5, 63, 64, 65, 130, 200])
def test_chunked_extend_from_nonzero_state_equals_recurrence(length):
    q, k, v, g, beta = rand_inputs(length, n=2)
    state = rand_state(n=2)
    out_c, state_c = chunk_gated_delta_rule(q, k, v, g, beta, state)
    out_r, state_r = recurrent_gated_delta_rule(q, k, v, g, beta, state)
    close(out_c, out_r)
    close(state_c, state_r)
    assert state_c.dtype == state_r.dtype == torch.float32


def gdn_core(x, weight, g, beta, conv_state, rec_state, rule=chunk_gated_delta_rule):
    """Conv + split + delta rule for one sequence, as the backend runs it: x [T, conv_dim]."""
    y, conv_state = causal_conv1d(x, weight, conv_state)
    q, k, v = torch.split(y, [HK * DK, HK * DK, HV * DV], dim=-1)
    t = x.shape[0]
    out, rec_state = rule(q.view(1, t, HK, DK), k.view(1, t, HK, DK), v.view(1, t, HV, DV), g[None], beta[None],
                          rec_state)
    return out[0], conv_state, rec_state


@pytest.mark.parametrize("pieces", [[200], [100, 100], [64, 136], [63, 1, 136], [65, 70, 65], [1, 63, 64, 72],
                                    [130, 3, 67], [2, 2, 196]])
def test_extend_in_pieces_equals_one_extend(pieces):
    total = sum(pieces)
    gen = torch.Generator().manual_seed(3)
    conv_dim = 2 * HK * DK + HV * DV
    x = torch.randn(total, conv_dim, generator=gen)
    weight = torch.randn(conv_dim, K, generator=gen) * 0.5
    g = -torch.rand(total, HV, generator=gen) * 0.5
    beta = torch.rand(total, HV, generator=gen)
    conv0 = torch.randn(conv_dim, K - 1, generator=gen)
    rec0 = rand_state()

    whole_out, whole_conv, whole_rec = gdn_core(x, weight, g, beta, conv0, rec0)
    outs, conv_state, rec_state, start = [], conv0, rec0, 0
    for n in pieces:
        rule = recurrent_gated_delta_rule if n == 1 else chunk_gated_delta_rule  # as the backend decides
        out, conv_state, rec_state = gdn_core(x[start:start + n], weight, g[start:start + n],
                                              beta[start:start + n], conv_state, rec_state, rule)
        outs.append(out)
        start += n
    close(torch.cat(outs), whole_out)
    close(conv_state, whole_conv)
    close(rec_state, whole_rec)


@pytest.mark.parametrize("length", [1, 37, 64, 150])
@pytest.mark.parametrize("with_state", [False, True])
def test_chunked_matches_hf(length, with_state):
    q, k, v, g, beta = rand_inputs(length, n=2, seed=length)
    state = rand_state(n=2) if with_state else None
    ref_out, ref_state = hf.torch_chunk_gated_delta_rule(
        q, k, v, g=g, beta=beta, initial_state=None if state is None else state.transpose(-1, -2),
        output_final_state=True, use_qk_l2norm_in_kernel=True)
    out, final = chunk_gated_delta_rule(q, k, v, g, beta, state)
    close(out, ref_out)
    close(final, ref_state.transpose(-1, -2))


@pytest.mark.parametrize("length", [1, 9])
def test_recurrent_matches_hf(length):
    q, k, v, g, beta = rand_inputs(length, n=3, seed=7)
    state = rand_state(n=3)
    ref_out, ref_state = hf.torch_recurrent_gated_delta_rule(
        q, k, v, g=g, beta=beta, initial_state=state.transpose(-1, -2), output_final_state=True,
        use_qk_l2norm_in_kernel=True)
    out, final = recurrent_gated_delta_rule(q, k, v, g, beta, state)
    close(out, ref_out)
    close(final, ref_state.transpose(-1, -2))


def test_without_l2norm_matches_hf():
    q, k, v, g, beta = rand_inputs(70, seed=11)
    q, k = q * 0.2, k * 0.2  # keep the un-normalised rule stable
    ref_out, ref_state = hf.torch_chunk_gated_delta_rule(q, k, v, g=g, beta=beta, output_final_state=True)
    out, final = chunk_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm=False)
    close(out, ref_out)
    close(final, ref_state.transpose(-1, -2))


def test_qk_are_l2_normalised_inside():
    q, k, v, g, beta = rand_inputs(80, seed=5)
    out, state = chunk_gated_delta_rule(q, k, v, g, beta)
    out2, state2 = chunk_gated_delta_rule(q * 3.0, k * 0.25, v, g, beta)
    close(out, out2)
    close(state, state2)


@pytest.mark.parametrize("length", [1, 3, 10])
def test_causal_conv1d_matches_hf(length):
    gen = torch.Generator().manual_seed(length)
    channels = 24
    x = torch.randn(length, channels, generator=gen)
    weight = torch.randn(channels, K, generator=gen)
    ref = hf.causal_conv1d_fn(x.t()[None], weight, activation="silu")[0].t()
    y, state = causal_conv1d(x, weight)
    close(y, ref)
    padded = torch.cat([torch.zeros(K - 1, channels), x])
    close(state, padded[-(K - 1):].t())


def test_causal_conv1d_with_state_equals_longer_sequence():
    gen = torch.Generator().manual_seed(2)
    channels = 12
    x = torch.randn(9, channels, generator=gen)
    weight = torch.randn(channels, K, generator=gen)
    whole, whole_state = causal_conv1d(x, weight)
    head, state = causal_conv1d(x[:2], weight)  # shorter than the kernel
    tail, state = causal_conv1d(x[2:], weight, state)
    close(torch.cat([head, tail]), whole)
    close(state, whole_state)


def test_causal_conv1d_step_matches_hf_update():
    gen = torch.Generator().manual_seed(4)
    n, channels = 3, 20
    x = torch.randn(n, channels, generator=gen)
    weight = torch.randn(channels, K, generator=gen)
    state = torch.randn(n, channels, K - 1, generator=gen)
    hf_state = torch.cat([torch.randn(n, channels, 1, generator=gen), state], dim=-1)  # HF keeps K inputs
    ref = hf.causal_conv1d_update(x[..., None], hf_state, weight, activation="silu")[..., 0]
    y, new_state = causal_conv1d_step(x, weight, state)
    close(y, ref)
    close(new_state, hf_state[..., 1:])


def test_state_stays_float32_with_bf16_inputs():
    q, k, v, g, beta = rand_inputs(90, seed=9, dtype=torch.bfloat16)
    state = rand_state().to(torch.bfloat16)
    out, final = chunk_gated_delta_rule(q, k, v, g, beta, state)
    assert out.dtype == torch.bfloat16 and final.dtype == torch.float32
    ref_out, ref_state = chunk_gated_delta_rule(q.float(), k.float(), v.float(), g, beta.float(), state.float())
    close(final, ref_state)  # the math runs in float32 from the same (bf16-valued) inputs
    close(out.float(), ref_out, atol=0.05)  # only the output is rounded to bf16
    out_r, final_r = recurrent_gated_delta_rule(q[:, :1], k[:, :1], v[:, :1], g[:, :1], beta[:, :1], state)
    assert out_r.dtype == torch.bfloat16 and final_r.dtype == torch.float32


@pytest.mark.gpu
def test_ops_on_cuda_match_cpu():
    q, k, v, g, beta = rand_inputs(150, n=2, seed=12)
    state = rand_state(n=2)
    cpu = chunk_gated_delta_rule(q, k, v, g, beta, state)
    gpu = chunk_gated_delta_rule(*(t.cuda() for t in (q, k, v, g, beta, state)))
    for a, b in zip(cpu, gpu):
        close(b.cpu(), a, atol=1e-4)
    cpu = recurrent_gated_delta_rule(q[:, :3], k[:, :3], v[:, :3], g[:, :3], beta[:, :3], state)
    gpu = recurrent_gated_delta_rule(*(t.cuda() for t in (q[:, :3], k[:, :3], v[:, :3], g[:, :3], beta[:, :3], state)))
    for a, b in zip(cpu, gpu):
        close(b.cpu(), a, atol=1e-4)
