"""Gated DeltaNet (GDN) reference ops in plain torch, on any device.

The GDN core of a hybrid layer is a depthwise causal conv1d (kernel K, SiLU) over the fused
q | k | v channels, followed by the gated delta rule. Per value head, with the state S [Dv, Dk]:

    S_t = exp(g_t) * S_{t-1}                       decay (g is a log-decay, <= 0)
    S_t = S_t + beta_t * (v_t - S_t k_t) k_t^T      delta-rule write
    o_t = S_t q_t

q and k are L2-normalised per head (eps 1e-6) and q is scaled by 1/sqrt(Dk), as HF's
`use_qk_l2norm_in_kernel=True`. With Hv = Hk * ratio value heads, each q/k head serves `ratio`
consecutive value heads (q/k heads are repeated with repeat_interleave).

State layout: the recurrent state is [..., Hv, Dv, Dk] in float32 (the layout of vlmrun's
`GDNPool`). HF's reference functions keep [..., H, Dk, Dv]: compare with `state.transpose(-1, -2)`.
The conv state is the last K-1 conv inputs, [C, K-1], in the activation dtype.

Extend uses `chunk_gated_delta_rule` (WY / UT form over chunks of 64 tokens), decode uses
`recurrent_gated_delta_rule` (token by token). Both start from and return a float32 state, so a
prompt can be fed in any number of pieces (chunked prefill) with the same result.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from vlmrun.layers.attention.base import GDNAttention

CHUNK_SIZE = 64
L2_EPS = 1e-6


def l2_normalize(x: torch.Tensor, eps: float = L2_EPS) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def split_gdn_heads(y: torch.Tensor, layer: GDNAttention) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Conv output [n, conv_dim] (q | k | v) -> q, k [n, Hk, Dk] and v [n, Hv, Dv]."""
    key_dim = layer.num_k_heads * layer.head_k_dim
    q, k, v = torch.split(y, [key_dim, key_dim, layer.num_v_heads * layer.head_v_dim], dim=-1)
    n = y.shape[0]
    return (q.reshape(n, layer.num_k_heads, layer.head_k_dim), k.reshape(n, layer.num_k_heads, layer.head_k_dim),
            v.reshape(n, layer.num_v_heads, layer.head_v_dim))


# ---------------------------------------------------------------------------------------------
# Causal depthwise conv1d
# ---------------------------------------------------------------------------------------------

def causal_conv1d(x: torch.Tensor, weight: torch.Tensor,
                  state: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence: x [T, C] after the carried conv inputs `state` [C, K-1] (zeros when None); or N
    sequences of one length at once: x [N, T, C], state [N, C, K-1].

    Returns y [T, C] = SiLU(depthwise causal conv) in x's dtype (computed in weight's dtype, as HF)
    and the new state [C, K-1]: the last K-1 inputs, in x's dtype (each with the leading N when batched).
    """
    if x.dim() == 2:
        y, new_state = causal_conv1d(x[None], weight, None if state is None else state[None])
        return y[0], new_state[0]
    channels, kernel = weight.shape
    if state is None:
        state = x.new_zeros(x.shape[0], channels, kernel - 1)
    full = torch.cat([state.to(x.dtype), x.transpose(1, 2)], dim=2)  # [N, C, K-1+T]
    new_state = full[..., full.shape[2] - (kernel - 1):].contiguous()  # [N, C, K-1]
    y = F.conv1d(full.to(weight.dtype), weight.unsqueeze(1), groups=channels)  # [N, C, T]
    return F.silu(y).transpose(1, 2).to(x.dtype), new_state


def causal_conv1d_step(x: torch.Tensor, weight: torch.Tensor,
                       state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode: one token for each of N sequences. x [N, C], state [N, C, K-1] -> (y [N, C], new_state)."""
    full = torch.cat([state.to(x.dtype), x.unsqueeze(-1)], dim=-1)  # [N, C, K]
    y = (full.to(weight.dtype) * weight).sum(dim=-1)  # [N, C]
    return F.silu(y).to(x.dtype), full[..., 1:].contiguous()


# ---------------------------------------------------------------------------------------------
# Gated delta rule
# ---------------------------------------------------------------------------------------------

def _heads_first_fp32(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                      use_qk_l2norm: bool) -> tuple[torch.Tensor, ...]:
    """[N, T, H, D] / [N, T, H] -> float32 [N, Hv, T, D] / [N, Hv, T], q/k heads repeated to Hv."""
    num_k_heads, num_v_heads = k.shape[2], v.shape[2]
    if num_v_heads % num_k_heads:
        raise ValueError(f"num_v_heads={num_v_heads} is not a multiple of num_k_heads={num_k_heads}")
    if num_v_heads != num_k_heads:
        ratio = num_v_heads // num_k_heads
        q = q.repeat_interleave(ratio, dim=2)
        k = k.repeat_interleave(ratio, dim=2)
    q, k, v, g, beta = (t.transpose(1, 2).to(torch.float32).contiguous() for t in (q, k, v, g, beta))
    if use_qk_l2norm:
        q, k = l2_normalize(q), l2_normalize(k)
    return q, k, v, g, beta


def _initial_state(initial_state: Optional[torch.Tensor], n: int, heads: int, dv: int, dk: int,
                   device: torch.device) -> torch.Tensor:
    if initial_state is None:
        return torch.zeros(n, heads, dv, dk, dtype=torch.float32, device=device)
    return initial_state.to(torch.float32)


def chunk_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                           initial_state: Optional[torch.Tensor] = None, *, chunk_size: int = CHUNK_SIZE,
                           use_qk_l2norm: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Extend: the gated delta rule over whole chunks of `chunk_size` tokens.

    q, k: [N, T, Hk, Dk]; v: [N, T, Hv, Dv]; g (log-decay), beta: [N, T, Hv];
    initial_state: [N, Hv, Dv, Dk] (any dtype; zeros when None).
    Returns out [N, T, Hv, Dv] in q's dtype and the final state [N, Hv, Dv, Dk] in float32.

    Inside a chunk, the delta-rule writes are solved at once: with A[i, j] = beta_i (k_i . k_j)
    exp(G_i - G_j) for j < i (G the in-chunk cumulative log-decay), (I + A) U = beta V gives the
    values to write and (I + A) W = beta K exp(G) the keys that read the incoming state. Then
    per chunk: V' = U - W S^T, out = (Q exp(G)) S^T + (Q K^T * decay) V',
    S <- exp(G_last) S + V'^T (K exp(G_last - G)).
    """
    out_dtype = q.dtype
    length = q.shape[1]
    q, k, v, g, beta = _heads_first_fp32(q, k, v, g, beta, use_qk_l2norm)
    q = q * q.shape[-1] ** -0.5
    n, heads, _, dk = k.shape
    dv = v.shape[-1]
    state = _initial_state(initial_state, n, heads, dv, dk, q.device)  # [N, H, Dv, Dk]

    pad = (-length) % chunk_size  # zero tokens at the end: no decay, no write, outputs dropped
    if pad:
        q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
        g, beta = (F.pad(t, (0, pad)) for t in (g, beta))
    num_chunks = (length + pad) // chunk_size
    q, k, v = (t.view(n, heads, num_chunks, chunk_size, -1) for t in (q, k, v))  # [N, H, nc, C, D]
    g, beta = (t.view(n, heads, num_chunks, chunk_size) for t in (g, beta))  # [N, H, nc, C]

    cum_g = g.cumsum(dim=-1)  # [N, H, nc, C] log-decay from the chunk start to each token
    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).tril()
    pair_decay = (cum_g.unsqueeze(-1) - cum_g.unsqueeze(-2)).masked_fill(~causal, float("-inf")).exp()  # [.., C, C]

    k_beta = k * beta.unsqueeze(-1)
    write_system = (k_beta @ k.transpose(-1, -2)) * pair_decay  # strictly-lower part is A (diagonal ignored)
    values = torch.linalg.solve_triangular(write_system, v * beta.unsqueeze(-1), upper=False,
                                           unitriangular=True)  # U [N, H, nc, C, Dv]
    read_keys = torch.linalg.solve_triangular(write_system, k_beta * cum_g.exp().unsqueeze(-1), upper=False,
                                              unitriangular=True)  # W [N, H, nc, C, Dk]
    intra = (q @ k.transpose(-1, -2)) * pair_decay  # [N, H, nc, C, C]
    q_decayed = q * cum_g.exp().unsqueeze(-1)
    k_to_end = k * (cum_g[..., -1:] - cum_g).exp().unsqueeze(-1)
    chunk_decay = cum_g[..., -1].exp()  # [N, H, nc]

    out = torch.empty(n, heads, num_chunks, chunk_size, dv, dtype=torch.float32, device=q.device)
    for i in range(num_chunks):
        state_t = state.transpose(-1, -2)  # [N, H, Dk, Dv]
        new_values = values[:, :, i] - read_keys[:, :, i] @ state_t  # [N, H, C, Dv]
        out[:, :, i] = q_decayed[:, :, i] @ state_t + intra[:, :, i] @ new_values
        state = state * chunk_decay[:, :, i, None, None] + new_values.transpose(-1, -2) @ k_to_end[:, :, i]

    out = out.view(n, heads, num_chunks * chunk_size, dv)[:, :, :length]
    return out.transpose(1, 2).contiguous().to(out_dtype), state


def recurrent_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                               beta: torch.Tensor, initial_state: Optional[torch.Tensor] = None, *,
                               use_qk_l2norm: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode: the gated delta rule token by token. Same shapes and returns as `chunk_gated_delta_rule`."""
    out_dtype = q.dtype
    q, k, v, g, beta = _heads_first_fp32(q, k, v, g, beta, use_qk_l2norm)
    q = q / q.shape[-1] ** 0.5
    n, heads, length, dk = k.shape
    dv = v.shape[-1]
    state = _initial_state(initial_state, n, heads, dv, dk, q.device)  # [N, H, Dv, Dk]
    out = torch.empty(n, heads, length, dv, dtype=torch.float32, device=q.device)
    for t in range(length):
        k_t = k[:, :, t].unsqueeze(-2)  # [N, H, 1, Dk]
        state = state * g[:, :, t].exp()[..., None, None]
        read = (state * k_t).sum(dim=-1)  # [N, H, Dv] what the state predicts for k_t
        delta = (v[:, :, t] - read) * beta[:, :, t].unsqueeze(-1)  # [N, H, Dv]
        state = state + delta.unsqueeze(-1) * k_t
        out[:, :, t] = (state * q[:, :, t].unsqueeze(-2)).sum(dim=-1)
    return out.transpose(1, 2).contiguous().to(out_dtype), state


def recurrent_gated_delta_rule_states(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                                      beta: torch.Tensor, initial_state: torch.Tensor, state_dtype: torch.dtype, *,
                                      use_qk_l2norm: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """`recurrent_gated_delta_rule` that also returns the state after every token, rounded to
    `state_dtype` after each as a state pool of that dtype holds it between decode steps (the next
    token starts from the rounded state): the same values as T one-token calls, each from the state
    the one before left. -> (out [N, T, Hv, Dv], states [N, T, Hv, Dv, Dk] in state_dtype)."""
    out_dtype = q.dtype
    q, k, v, g, beta = _heads_first_fp32(q, k, v, g, beta, use_qk_l2norm)
    q = q / q.shape[-1] ** 0.5
    n, heads, length, dk = k.shape
    dv = v.shape[-1]
    state = initial_state.to(torch.float32)  # [N, H, Dv, Dk]
    out = torch.empty(n, heads, length, dv, dtype=torch.float32, device=q.device)
    states = torch.empty(n, length, heads, dv, dk, dtype=state_dtype, device=q.device)
    for t in range(length):
        k_t = k[:, :, t].unsqueeze(-2)  # [N, H, 1, Dk]
        state = state * g[:, :, t].exp()[..., None, None]
        read = (state * k_t).sum(dim=-1)  # [N, H, Dv]
        delta = (v[:, :, t] - read) * beta[:, :, t].unsqueeze(-1)  # [N, H, Dv]
        state = state + delta.unsqueeze(-1) * k_t
        out[:, :, t] = (state * q[:, :, t].unsqueeze(-2)).sum(dim=-1)
        states[:, t] = state
        state = states[:, t].to(torch.float32)
    return out.transpose(1, 2).contiguous().to(out_dtype), states
