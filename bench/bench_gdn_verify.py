"""The torch GDN backend's verify pass of one layer against the plain decode steps it stands for.

N sequences (`--seqs`, several values) each verify 1 + k positions (`--drafts`, default 3) at the
bundled model's GDN shapes (2 key heads / 4 value heads of 32, conv kernel 4), float32, from random
states: `TorchGDNBackend` runs them as one verify group (the states after every position kept) and,
as the peer, as 1 + k one-token decode steps of the same backend. The outputs and the states after
every position must be bit-equal (checked); prints the median milliseconds of each over `--calls`.

    OMP_NUM_THREADS=1 python -m bench.bench_gdn_verify [--seqs 1 16 256] [--drafts 3] [--calls 100]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from bench.common import describe_run
from vlmrun.layers.attention.base import GDNAttention
from vlmrun.layers.attention.torch_gdn_backend import TorchGDNBackend, VerifyGroup
from vlmrun.layers.cpu_kernels import _cpu_model_name as cpu_model_name

HK, HV, DK, DV, KERNEL = 2, 4, 32, 32, 4
CONV_DIM = 2 * HK * DK + HV * DV


class Pool:
    """The two state tensors the backend reads, one layer, slot 0 the dummy."""

    def __init__(self, seqs: int, gen: torch.Generator):
        self.conv_state = torch.randn(1, seqs + 1, CONV_DIM, KERNEL - 1, generator=gen)
        self.recurrent_state = torch.randn(1, seqs + 1, HV, DV, DK, generator=gen) * 0.1


def median_ms(run, calls: int) -> float:
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def measure(seqs: int, width: int, calls: int) -> None:
    gen = torch.Generator().manual_seed(seqs)
    layer = GDNAttention(0, HK, HV, DK, DV, KERNEL)
    x = torch.randn(seqs, width, CONV_DIM, generator=gen)
    g = -torch.rand(seqs, width, HV, generator=gen)
    beta = torch.rand(seqs, width, HV, generator=gen)
    weight = torch.randn(CONV_DIM, KERNEL, generator=gen)
    slots = torch.arange(1, seqs + 1)
    start = Pool(seqs, gen)

    def fresh() -> TorchGDNBackend:
        pool = Pool(seqs, gen)
        pool.conv_state.copy_(start.conv_state)
        pool.recurrent_state.copy_(start.recurrent_state)
        return TorchGDNBackend(pool)

    def verify(backend: TorchGDNBackend) -> tuple[torch.Tensor, VerifyGroup]:
        group = VerifyGroup(width, slots, None, torch.arange(seqs))
        out = backend._verify(x.flatten(0, 1), g.flatten(0, 1), beta.flatten(0, 1), weight, group, layer,
                              backend.pool.conv_state[0], backend.pool.recurrent_state[0])
        return out.view(seqs, width, HV, DV), group

    def decode_steps(backend: TorchGDNBackend) -> tuple[torch.Tensor, list[torch.Tensor]]:
        outs, states = [], []
        for t in range(width):
            outs.append(backend._decode(x[:, t], g[:, t], beta[:, t], weight, slots, layer,
                                        backend.pool.conv_state[0], backend.pool.recurrent_state[0]))
            states.append(backend.pool.recurrent_state[0][slots].clone())
        return torch.stack(outs, dim=1), states

    out, group = verify(fresh())
    ref, ref_states = decode_steps(fresh())
    assert torch.equal(out, ref), "verify outputs differ from decode steps"
    assert all(torch.equal(group.recurrent_states[0][:, t], ref_states[t]) for t in range(width))
    verify_ms = median_ms(lambda: verify(fresh()), calls)
    decode_ms = median_ms(lambda: decode_steps(fresh()), calls)
    setup_ms = median_ms(fresh, calls)  # copying the pool, in both timings
    print(f"{seqs} sequences x {width} positions: verify pass {verify_ms - setup_ms:.3f} ms, "
          f"{width} decode steps {decode_ms - setup_ms:.3f} ms (bit-equal)", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", type=int, nargs="+", default=[1, 16, 256])
    parser.add_argument("--drafts", type=int, default=3)
    parser.add_argument("--calls", type=int, default=100)
    args = parser.parse_args()
    print(describe_run("bench.bench_gdn_verify"), "|", cpu_model_name(), flush=True)
    for seqs in args.seqs:
        measure(seqs, 1 + args.drafts, args.calls if seqs < 256 else max(10, args.calls // 5))


if __name__ == "__main__":
    main()
