"""`FLAGDNBackend` (gdn_backend="fla") through a speculative-decoding verify step, against plain decode.

On the CPU through Triton's interpreter (a process of its own: tests/test_fla_verify.py runs it; the
interpreter must be on before triton is imported, tests/triton_interpret.py). One GDN layer over four
sequences sharing a GDN pool, on `FLAGDNBackend`: prompts prefilled (FLA's varlen conv and chunked
delta rule), a plain decode step (FLA's conv update and fused recurrent delta rule), a verify step (3
drafts, 1 draft, a plain decode and a prefill chunk: it runs on the backend's `TorchGDNBackend`, and
must equal, bit for bit, a `TorchGDNBackend` run of the step over a copy of the pool), then
`keep_accepted_states` (2, 1 and 0 drafts accepted, the same bits as the copy's), and another FLA
decode step from the kept states.
The same tokens fed one step at a time on the torch reference (`TorchGDNBackend`, its own pool, no
drafts) must give the same outputs at every fed position and the same slot states after each step
(float32, within `TOLERANCE`: FLA's kernels round differently). Prints one line; exits non-zero on a
mismatch.
"""

from __future__ import annotations

import tests.triton_interpret  # noqa: F401  (first: TRITON_INTERPRET=1 and the shims)

import torch

from tests.test_gdn_pool import CONV_DIM, DK, DV, HK, HV, KERNEL, Stream, gdn_batch, make_pool
from vlmrun.layers.attention.base import GDNAttention, GDNBackend
from vlmrun.layers.attention.fla_backend import FLAGDNBackend, FLAMetadata
from vlmrun.layers.attention.torch_gdn_backend import TorchGDNBackend

LAYER = 1  # of the pool's two: the other layer's states must stay untouched
TOLERANCE = 1e-5
PROMPT = 20


class Streams:
    """Four sequences' random GDN inputs; sequence s lives in GDN slot s + 1."""

    def __init__(self):
        self.streams = [Stream(28, seed) for seed in range(1, 5)]
        self.weight = torch.randn(CONV_DIM, KERNEL, generator=torch.Generator().manual_seed(0)) * 0.5

    def step(self, backend: GDNBackend, layer: GDNAttention, feeds: list[tuple[int, int, int, int]]):
        """feeds: (sequence, first position, tokens, drafts among them) -> (outputs [T, Hv, Dv], the step's fb)."""
        fb = gdn_batch(backend, [n for _, _, n, _ in feeds], [p for _, p, _, _ in feeds], [s + 1 for s, _, _, _ in feeds])
        if any(d for _, _, _, d in feeds):
            fb.num_drafts_cpu = [d for _, _, _, d in feeds]
            backend.prepare(fb)
        parts = [(self.streams[s], p, n) for s, p, n, _ in feeds]
        x = torch.cat([st.x[p:p + n] for st, p, n in parts])  # [T, conv_dim]
        g = torch.cat([st.g[p:p + n] for st, p, n in parts])
        beta = torch.cat([st.beta[p:p + n] for st, p, n in parts])
        return backend.forward(x, g, beta, self.weight, layer, fb), fb


def slot_states(backend: GDNBackend, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
    pool = backend.pool  # type: ignore[attr-defined]
    return pool.conv_state[LAYER, slot].clone(), pool.recurrent_state[LAYER, slot].clone()


def assert_close(got: torch.Tensor, want: torch.Tensor, what: str) -> float:
    gap = (got - want).abs().max().item()
    assert gap <= TOLERANCE, f"{what}: max |FLA backend - reference| {gap:.2e}"  # NaN fails too
    return gap


def check() -> str:
    """Asserts the scenario of the module docstring; returns the report line."""
    streams = Streams()
    layer = GDNAttention(LAYER, HK, HV, DK, DV, KERNEL)
    prompts = [(s, 0, PROMPT, 0) for s in range(3)]

    # The reference: plain decode, one token per step; outputs and slot states after each token.
    ref = TorchGDNBackend(make_pool())
    streams.step(ref, layer, prompts)
    streams.step(ref, layer, [(3, 0, 8, 0)])  # sequence 3's first prompt chunk
    want_out: dict[tuple[int, int], torch.Tensor] = {}  # (sequence, position) -> [Hv, Dv]
    want_state: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}  # after that position
    for t in range(PROMPT, PROMPT + 5):
        out, _ = streams.step(ref, layer, [(s, t, 1, 0) for s in range(3)])
        for s in range(3):
            want_out[s, t] = out[s]
            want_state[s, t] = slot_states(ref, s + 1)
    out, _ = streams.step(ref, layer, [(3, 8, 6, 0)])  # sequence 3's second prompt chunk
    want_chunk, want_state[3, 13] = out, slot_states(ref, 4)
    out, _ = streams.step(ref, layer, [(3, 14, 1, 0)])
    want_out[3, 14], want_state[3, 14] = out[0], slot_states(ref, 4)

    fla = FLAGDNBackend(make_pool())
    assert fla.verifies_drafts
    streams.step(fla, layer, prompts)  # FLA's extend kernels
    streams.step(fla, layer, [(3, 0, 8, 0)])
    other_layer = fla.pool.recurrent_state[1 - LAYER].clone()
    gaps = []

    out, fb = streams.step(fla, layer, [(s, PROMPT, 1, 0) for s in range(3)])  # FLA's decode kernels
    assert isinstance(fb.gdn_metadata, FLAMetadata) and fb.gdn_metadata.decode
    gaps += [assert_close(out[s], want_out[s, PROMPT], f"decode, sequence {s}") for s in range(3)]

    t = PROMPT + 1  # a verify step: 3 drafts, 1 draft, a plain decode, a prefill chunk
    verify = [(0, t, 4, 3), (1, t, 2, 1), (2, t, 1, 0), (3, 8, 6, 0)]
    twin = TorchGDNBackend(make_pool())  # the reference on a copy of the pool: the delegate must equal it
    twin.pool.conv_state.copy_(fla.pool.conv_state)
    twin.pool.recurrent_state.copy_(fla.pool.recurrent_state)
    twin_out, twin_fb = streams.step(twin, layer, verify)
    out, fb = streams.step(fla, layer, verify)
    assert not isinstance(fb.gdn_metadata, FLAMetadata), "a step with drafts runs on the reference"
    assert torch.equal(out, twin_out)
    rows = {(0, t + j): j for j in range(4)} | {(1, t): 4, (1, t + 1): 5, (2, t): 6}
    gaps += [assert_close(out[row], want_out[key], f"verify, sequence {key[0]} position {key[1]}")
             for key, row in rows.items()]
    gaps.append(assert_close(out[7:], want_chunk, "prefill chunk beside the verify"))
    fla.keep_accepted_states(fb.gdn_metadata, torch.tensor([2, 1, 0, 0]))
    twin.keep_accepted_states(twin_fb.gdn_metadata, [2, 1, 0, 0])
    assert torch.equal(fla.pool.conv_state, twin.pool.conv_state)
    assert torch.equal(fla.pool.recurrent_state, twin.pool.recurrent_state)
    kept = {0: t + 2, 1: t + 1, 2: t, 3: 13}  # the position each slot's state must follow
    for s, pos in kept.items():
        conv, rec = slot_states(fla, s + 1)
        gaps.append(assert_close(conv, want_state[s, pos][0], f"conv state of sequence {s} after {pos}"))
        gaps.append(assert_close(rec, want_state[s, pos][1], f"recurrent state of sequence {s} after {pos}"))

    out, fb = streams.step(fla, layer, [(s, pos + 1, 1, 0) for s, pos in kept.items()])  # FLA again
    assert isinstance(fb.gdn_metadata, FLAMetadata)
    for i, (s, pos) in enumerate(kept.items()):
        gaps.append(assert_close(out[i], want_out[s, pos + 1], f"decode after the verify, sequence {s}"))
        conv, rec = slot_states(fla, s + 1)
        gaps.append(assert_close(rec, want_state[s, pos + 1][1], f"recurrent state of sequence {s} after {pos + 1}"))
        gaps.append(assert_close(conv, want_state[s, pos + 1][0], f"conv state of sequence {s} after {pos + 1}"))
    assert torch.equal(fla.pool.recurrent_state[1 - LAYER], other_layer)
    return (f"FLA prefill and decode, reference verify, FLA decode vs plain decode: {len(gaps)} comparisons, "
            f"max |gap| {max(gaps):.2e} (tolerance {TOLERANCE:.0e})")


if __name__ == "__main__":
    print(check())
