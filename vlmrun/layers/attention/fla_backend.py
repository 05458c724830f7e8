"""The CUDA Gated DeltaNet backend: flash-linear-attention's Triton kernels over the GDN state pool.

Same seam and same results as `TorchGDNBackend` (the reference it is tested against):
  - extend (any batch with a multi-token sequence): every sequence of the step — prefill chunks
    and one-token decodes alike — runs as one variable-length batch: FLA's `causal_conv1d` with
    `cu_seqlens`, then `chunk_gated_delta_rule` with `cu_seqlens`, each starting from the states
    gathered from the sequences' slots and returning the final states, written back;
  - decode: `causal_conv1d_update` and `fused_recurrent_gated_delta_rule` over one token per
    sequence, states gathered and written back by slot (static shapes: CUDA-graph capturable);
  - a step with draft tokens (speculative decoding's verify pass, `fb.num_drafts_cpu`) runs whole on
    the reference, a `TorchGDNBackend` over the same pool (torch ops, on CUDA): it keeps the conv and
    recurrent states after every position of each draft-carrying sequence and `keep_accepted_states`
    puts those after the accepted positions into the slots. FLA 0.6's kernels return only a
    sequence's final state. Such a step's other sequences (decodes, prefill chunks) run there too.
    The pool's layout is the reference's: a step on either backend starts from the states the other left.
FLA keeps the last K conv inputs where the pool keeps K-1: the oldest column is padded with zeros
on the way in (the kernel shifts it out) and dropped on the way out. The recurrent state is
float32 in the pool's [Hv, Dv, Dk] layout (FLA's `state_v_first`).
FLA 0.6's kernels take no slot indices: they read their initial states from, and write their final
states to, tensors with one state per sequence. So a step moves each sequence's recurrent state three
times per layer — gathered from the pool, through the kernel, written back — where a kernel that
reads and writes the pool by slot would move it once (vLLM and SGLang carry such a fork of this
kernel). Nothing else is copied: the dtype casts are no-ops for the float32 pool.

Pinned configs (`pin_fla_configs`, on when `VLMRUN_FLA_PINNED_CONFIGS=1`): FLA's Triton kernels are
autotuned, so their first call per shape compiles every candidate config, ~92 compiles for the 8
autotuned kernels of the forward path per dtype and GDN shape (minutes of a GPU run). Pinned, each
autotuner keeps one config (`PINNED_CONFIGS`, for the forward path; any other FLA kernel its first
candidate), and Triton compiles it once per specialization without benchmarking. The GPU checks and
benchmark pin; an engine without the variable autotunes as FLA does.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Any, Optional, cast

import torch
import torch.nn.functional as F

from vlmrun.cache.gdn_pool import GDNPool
from vlmrun.forward_batch import ForwardBatch, ForwardMode
from vlmrun.layers.attention.base import GDNAttention, GDNBackend
from vlmrun.layers.attention.torch_gdn_backend import GDNMetadata, TorchGDNBackend
from vlmrun.layers.gdn_ops import split_gdn_heads


@dataclass
class FLAMetadata:
    decode: bool  # every sequence feeds one token
    cu_seqlens: Optional[torch.Tensor]  # [batch + 1] int64 on the device (extend only)
    cu_seqlens_cpu: Optional[torch.Tensor]  # the same on the host (FLA plans its chunks from it)


class FLAGDNBackend(GDNBackend):
    verifies_drafts = True  # steps with drafts run on `self.reference`

    def __init__(self, pool: GDNPool):
        from fla.modules.causal_conv1d import causal_conv1d, causal_conv1d_update
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule

        if os.environ.get(PIN_CONFIGS_ENV) == "1":
            pin_fla_configs()
        self.pool = pool
        self._conv, self._conv_update = causal_conv1d, causal_conv1d_update
        self._chunk, self._recurrent = chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
        self.reference = TorchGDNBackend(pool)  # serves the steps with drafts (verify passes)

    def prepare(self, fb: ForwardBatch) -> None:
        if fb.state_slots is None:
            raise ValueError("a hybrid model's ForwardBatch needs state_slots (the GDN slot of each sequence)")
        if fb.num_drafts_cpu is not None and any(fb.num_drafts_cpu):
            self.reference.prepare(fb)  # its GDNMetadata on fb: `forward` and `keep_accepted_states` follow it
        else:
            fb.gdn_metadata = gdn_varlen_metadata(fb)

    def keep_accepted_states(self, metadata: Any, num_accepted: Any) -> None:
        """A verify step's (the reference's metadata); a step without drafts kept nothing."""
        if isinstance(metadata, GDNMetadata):
            self.reference.keep_accepted_states(metadata, num_accepted)

    def forward(self, mixed_qkv: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, conv_weight: torch.Tensor,
                layer: GDNAttention, fb: ForwardBatch) -> torch.Tensor:
        """mixed_qkv [T, conv_dim], g [T, Hv] float32, beta [T, Hv], conv_weight [conv_dim, K] -> [T, Hv, Dv]."""
        if isinstance(fb.gdn_metadata, GDNMetadata):  # a step with drafts, prepared by the reference
            return self.reference.forward(mixed_qkv, g, beta, conv_weight, layer, fb)
        md = cast(FLAMetadata, fb.gdn_metadata)
        slots = fb.state_slots  # [batch]
        conv_state = self.pool.conv_state[layer.layer_id]  # [slots, conv_dim, K-1]
        rec_state = self.pool.recurrent_state[layer.layer_id]  # [slots, Hv, Dv, Dk]
        conv_in = F.pad(conv_state[slots], (1, 0)).to(mixed_qkv.dtype)  # [batch, conv_dim, K]
        state_in = rec_state[slots].to(torch.float32)  # [batch, Hv, Dv, Dk]
        if md.decode:
            y, _ = self._conv_update(mixed_qkv, cache=conv_in, weight=conv_weight,
                                     activation="silu")  # conv_in updated in place
            q, k, v = (t.unsqueeze(1) for t in split_gdn_heads(y, layer))  # [batch, 1, H, D]
            # every optional argument by keyword: after g, FLA's next positional parameter is gk (a per-key decay)
            out, state_out = self._recurrent(q, k, v, g=g.unsqueeze(1), beta=beta.unsqueeze(1),
                                             initial_state=state_in, output_final_state=True,
                                             use_qk_l2norm_in_kernel=True, state_v_first=True)
            conv_out = conv_in
        else:
            y, conv_out = self._conv(mixed_qkv.unsqueeze(0), weight=conv_weight, initial_state=conv_in,
                                     output_final_state=True, activation="silu", cu_seqlens=md.cu_seqlens,
                                     cu_seqlens_cpu=md.cu_seqlens_cpu)
            q, k, v = (t.unsqueeze(0) for t in split_gdn_heads(y[0], layer))  # [1, T, H, D]
            out, state_out = self._chunk(q, k, v, g=g.unsqueeze(0), beta=beta.unsqueeze(0), initial_state=state_in,
                                         output_final_state=True, use_qk_l2norm_in_kernel=True,
                                         state_v_first=True, cu_seqlens=md.cu_seqlens,
                                         cu_seqlens_cpu=md.cu_seqlens_cpu)
        conv_state[slots] = conv_out[..., 1:].to(conv_state.dtype)
        rec_state[slots] = state_out.to(rec_state.dtype)
        return out.squeeze(1) if md.decode else out[0]  # [T, Hv, Dv]


def gdn_varlen_metadata(fb: ForwardBatch) -> FLAMetadata:
    """The step's sequences as FLA's variable-length batch: cu_seqlens from the host lengths (no sync)."""
    if fb.mode is ForwardMode.DECODE:
        return FLAMetadata(decode=True, cu_seqlens=None, cu_seqlens_cpu=None)
    cu = torch.zeros(fb.batch_size + 1, dtype=torch.int64)
    cu[1:] = torch.tensor(fb.extend_seq_lens_cpu, dtype=torch.int64).cumsum(0)
    return FLAMetadata(decode=False, cu_seqlens=cu.to(fb.input_ids.device), cu_seqlens_cpu=cu)


PIN_CONFIGS_ENV = "VLMRUN_FLA_PINNED_CONFIGS"
PIN_CANDIDATES_ATTR = "vlmrun_candidates"  # an autotuner's own configs, kept on it when pinned
# kernel -> (constexpr kwargs, num_warps, num_stages): one of FLA 0.6's own candidates on Hopper for
# each autotuned kernel the forward path runs (`causal_conv1d`, `causal_conv1d_update`,
# `chunk_gated_delta_rule`; `fused_recurrent_gated_delta_rule` is not autotuned). Picked for
# occupancy at decode's batch sizes, not measured: the first GPU run reports the speed they give.
PINNED_CONFIGS: dict[str, tuple[dict[str, int], int, int]] = {  # by module and name: names repeat across FLA
    "fla.modules.causal_conv1d.ops.causal_conv1d_fwd_kernel": ({"BD": 64}, 4, 3),
    "fla.modules.causal_conv1d.ops.causal_conv1d_update_kernel": ({"BD": 64}, 4, 3),
    "fla.modules.norm.l2norm.l2norm_fwd_kernel": ({"BT": 16}, 4, 3),
    "fla.ops.utils.cumsum.chunk_local_cumsum_scalar_kernel": ({}, 2, 3),
    "fla.ops.gated_delta_rule.chunk_fwd.chunk_gated_delta_rule_fwd_kkt_solve_kernel": ({"BK": 64}, 4, 3),
    "fla.ops.gated_delta_rule.wy_fast.recompute_w_u_fwd_kernel": ({}, 4, 3),
    "fla.ops.common.chunk_delta_h.chunk_gated_delta_rule_fwd_kernel_h_blockdim64": ({"BV": 32}, 4, 2),
    "fla.ops.common.chunk_o.chunk_fwd_kernel_o": ({"BK": 64, "BV": 64}, 4, 3),
}


def pin_fla_configs(pins: Optional[dict[str, tuple[dict[str, int], int, int]]] = None) -> dict[str, str]:
    """Leave every Triton autotuner of FLA's loaded modules one config: its pin in `pins`
    (default `PINNED_CONFIGS`), which must be one of its candidates, else its first candidate.
    Returns kernel (module.name) -> "pinned" | "first candidate". Nothing changes when a pin is
    refused; a later call chooses again among the original candidates. Imports the GDN kernels first."""
    import fla.modules.causal_conv1d  # noqa: F401  (their modules define the autotuners)
    import fla.ops.gated_delta_rule  # noqa: F401
    from triton.runtime.autotuner import Autotuner

    pins = PINNED_CONFIGS if pins is None else pins
    chosen: dict[int, tuple[Any, list[Any], list[Any]]] = {}  # id -> (autotuner, its candidates, its one config)
    done: dict[str, str] = {}
    for name, module in list(sys.modules.items()):
        if not name.startswith("fla.") or module is None:
            continue
        for obj in list(vars(module).values()):
            for tuner in _autotuners(obj, Autotuner):
                kernel = _kernel_name(tuner)
                candidates = getattr(tuner, PIN_CANDIDATES_ATTR, None) or list(tuner.configs)
                if kernel in pins:
                    chosen[id(tuner)] = (tuner, candidates, [_matching_config(candidates, kernel, *pins[kernel])])
                    done[kernel] = "pinned"
                else:
                    chosen[id(tuner)] = (tuner, candidates, candidates[:1])
                    done.setdefault(kernel, "first candidate")
    missing = sorted(set(pins) - {k for k, how in done.items() if how == "pinned"})
    if missing:
        raise ValueError(f"FLA has no autotuned kernel named {missing}: update PINNED_CONFIGS")
    for tuner, candidates, one in chosen.values():
        setattr(tuner, PIN_CANDIDATES_ATTR, candidates)
        tuner.configs = one
    return done


def _autotuners(obj: Any, autotuner_cls: type) -> list[Any]:
    """The autotuners in a kernel's wrapper chain (heuristics -> autotune -> jit, any order)."""
    found = []
    for _ in range(8):  # a chain is two or three deep, then the Python function (no .fn)
        if isinstance(obj, autotuner_cls):
            found.append(obj)
        obj = getattr(obj, "fn", None)
        if obj is None:
            break
    return found


def _kernel_name(tuner: Any) -> str:
    """The kernel's module and name, e.g. fla.ops.common.chunk_o.chunk_fwd_kernel_o."""
    fn = tuner.fn
    while hasattr(fn, "fn"):
        fn = fn.fn
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__name__', repr(fn))}"


def _matching_config(candidates: list[Any], kernel: str, kwargs: dict[str, int], num_warps: int,
                     num_stages: int) -> Any:
    for config in candidates:
        if config.kwargs == kwargs and config.num_warps == num_warps and config.num_stages == num_stages:
            return config
    listed = [(c.kwargs, c.num_warps, c.num_stages) for c in candidates]
    raise ValueError(f"the pinned config {(kwargs, num_warps, num_stages)} of FLA's {kernel} is not one of its "
                     f"candidates {listed}")
