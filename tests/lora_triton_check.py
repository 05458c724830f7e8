"""The Triton LoRA kernels (`vlmrun.lora.triton_ops`) against the torch update of `vlmrun.lora.layers`.

`check(device)` runs every case on `device` in float32 and bfloat16 and returns the report lines and
whether all passed: the op on random slots, ranks (zero-padded below the slot's, as the manager writes
them), blocks (fused q | k | v parts), odd sizes, row spans of several adapters and of none, a slot's
rows over several tiles, padding rows past the spans; `LinearLoRA.add` and `ExpertsLoRA.add` (an
expert's routed tokens, `ExpertsLoRA.select`) over a padded decode's rows through a `LoRABatch` made for
each kernel and padded as the manager pads it (`LoRABatch.padded_to`). Rows without an adapter must come
back bit for bit.

Run as a script (tests/test_lora_triton.py does, with TRITON_INTERPRET=1 in its environment, so the
interpreter is on before triton is imported) it runs the cases on the CPU and exits non-zero on a
mismatch; tests/test_lora_triton.py's gpu tests call `check("cuda")` in their own process.
"""

from __future__ import annotations

import os
from typing import Optional

import torch

from vlmrun.lora.layers import NO_ADAPTER, ExpertsLoRA, LinearLoRA, LoRABatch, LoRAContext, low_rank_update

TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 3e-2}  # |kernel - torch| <= tol * (1 + |torch|)
# (slots, max_rank, blocks, in, out, spans as (slot, rows), padding rows): odd sizes, several tiles
CASES = [
    (3, 4, 1, 72, 100, [(0, 5), (NO_ADAPTER, 3), (2, 20), (0, 2), (1, 1)], 3),
    (4, 8, 3, 40, 130, [(3, 1), (1, 1), (NO_ADAPTER, 1), (2, 1), (0, 1)], 3),  # decode rows, fused parts
    (2, 16, 2, 96, 33, [(NO_ADAPTER, 7), (1, 37), (0, 4)], 0),  # a slot's rows over three tiles
    (4, 4, 1, 16, 16, [(2, 3), (NO_ADAPTER, 2)], 1),  # one slot and the base model
]


def random_slots(slots: int, max_rank: int, blocks: int, n_in: int, n_out: int, dtype: torch.dtype,
                 g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """a [slots, blocks * max_rank, in], b [out, slots, blocks * max_rank]: each slot its own rank <= max_rank,
    each block's part of b only its own output rows (a fused layer's layout), the rest zero."""
    k = blocks * max_rank
    a = torch.zeros(slots, k, n_in)
    b = torch.zeros(n_out, slots, k)
    edges = [round(i * n_out / blocks) for i in range(blocks + 1)]
    for s in range(slots):
        r = int(torch.randint(1, max_rank + 1, (1,), generator=g))
        for p in range(blocks):
            cols = slice(p * max_rank, p * max_rank + r)
            a[s, cols] = torch.randn(r, n_in, generator=g) / n_in ** 0.5
            b[edges[p]:edges[p + 1], s, cols] = torch.randn(edges[p + 1] - edges[p], r, generator=g) / r ** 0.5
    return a.to(dtype), b.to(dtype)


def gap(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / (1 + |want|), infinite on a NaN or an infinity."""
    err = (got.float() - want.float()).abs() / (1 + want.float().abs())
    return float("inf") if not torch.isfinite(err).all() else err.max().item()


def check_op(case: tuple, dtype: torch.dtype, device: str, seed: int) -> float:
    """`add_to_rows` on one case against `low_rank_update`; rows without an adapter must be untouched."""
    from vlmrun.lora.triton_ops import SlotGroups, add_to_rows

    slots, max_rank, blocks, n_in, n_out, spans, padding = case
    g = torch.Generator().manual_seed(seed)
    a, b = (t.to(device) for t in random_slots(slots, max_rank, blocks, n_in, n_out, dtype, g))
    span_slots, lengths = [s for s, _ in spans], [n for _, n in spans]
    n = sum(lengths) + padding
    x = torch.randn(n, n_in, generator=g).to(device, dtype)
    y = torch.randn(n, n_out, generator=g).to(device, dtype)
    torch_batch = LoRABatch.of_spans(span_slots, lengths, slots, torch.device(device), dtype).padded_to(n)
    want = low_rank_update(x, y, a, b, torch_batch)
    groups = SlotGroups.of_spans(span_slots, lengths, slots, torch.device(device))
    got = add_to_rows(x, y.clone(), a, b, groups)
    untouched = groups.padded_to(n).row_slots == NO_ADAPTER  # [n]: base-model and padding rows
    if not torch.equal(got[untouched], y[untouched]):
        return float("inf")
    return gap(got, want)


def check_layers(dtype: torch.dtype, device: str, seed: int) -> float:
    """`LinearLoRA.add` (x [3, 5, in]) and `ExpertsLoRA.add` (one expert's routed tokens) on the rows of a
    padded decode, with a batch made for the Triton kernel against the same with the torch one."""
    slots, rank, n_in, n_out, experts = 3, 4, 24, 40, 2
    g = torch.Generator().manual_seed(seed)
    dev = torch.device(device)
    context = LoRAContext()
    linear = LinearLoRA(context, slots, 2, rank, n_in, n_out, dev, dtype)
    moe = ExpertsLoRA(context, slots, rank, experts, {"down_proj": (n_out, n_in)}, dev, dtype)
    for s in (0, 2):  # slot 1 holds an adapter that leaves these layers alone
        a, b = random_slots(1, rank, 2, n_in, n_out, dtype, g)
        linear.write(s, a[0].to(dev), b[:, 0].to(dev))
        ea, eb = random_slots(experts, rank, 1, n_in, n_out, dtype, g)
        moe.write(s, "down_proj", ea.to(dev), eb.permute(1, 0, 2).to(dev))
    linear.write(1, None, None)
    spans_slots, lengths = [2, NO_ADAPTER, 0, 1, 2], [3, 2, 4, 1, 2]  # 12 rows bound
    num_rows = 15  # a padded decode: rows 12..14 have no adapter; the forward's rows as [3, 5]
    x = torch.randn(3, 5, n_in, generator=g).to(dev, dtype)
    y = torch.randn(3, 5, n_out, generator=g).to(dev, dtype)
    tokens = torch.tensor([0, 3, 5, 6, 8, 9, 11, 12, 14], device=dev)
    xs = torch.randn(len(tokens), n_in, generator=g).to(dev, dtype)
    ys = torch.randn(len(tokens), n_out, generator=g).to(dev, dtype)
    outs = {}
    for kernel in ("torch", "triton"):
        context.batch = LoRABatch.of_spans(spans_slots, lengths, slots, dev, dtype, kernel).padded_to(num_rows)
        assert (context.batch.groups is not None) == (kernel == "triton")
        outs[kernel] = (linear.add(x, y.clone()), moe.add("down_proj", 1, xs, ys.clone(), moe.select(tokens)))
    context.batch = None
    return max(gap(got, want) for got, want in zip(outs["triton"], outs["torch"], strict=True))


def check(device: str) -> tuple[list[str], bool]:
    """Every case in float32 and bfloat16 on `device`: report lines, and whether all are within tolerance."""
    lines, ok = [], True
    for dtype in (torch.float32, torch.bfloat16):
        errors: list[Optional[float]] = [check_op(case, dtype, device, seed) for seed, case in enumerate(CASES)]
        errors.append(check_layers(dtype, device, seed=99))
        worst = max(errors)
        ok &= worst <= TOLERANCE[dtype]
        lines.append(f"{dtype}: max |triton - torch| / (1 + |torch|) = {worst:.2e} (tolerance {TOLERANCE[dtype]:.0e}) "
                     f"over {len(errors)} checks")
    return lines, ok


def patch_interpreter_bfloat16_dot() -> None:
    """Triton 3.8's interpreter keeps bfloat16 as its uint16 bits and `tl.dot` multiplies those bits as
    integers; here it multiplies the values: bfloat16 -> float32 is exact, and the products summed in
    float32 are what a GPU's bfloat16 MMA with a float32 accumulator computes."""
    import triton.language as tl
    from triton.runtime.interpreter import InterpreterBuilder, TensorHandle, _convert_float

    dot = InterpreterBuilder.create_dot

    def to_float32(handle: TensorHandle) -> TensorHandle:
        if handle.dtype.scalar != tl.bfloat16:
            return handle
        data = _convert_float(handle.data, tl.bfloat16, tl.float32, None).view("float32").reshape(handle.data.shape)
        return TensorHandle(data, tl.float32)

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return dot(self, to_float32(a), to_float32(b), d, input_precision, max_num_imprecise_acc)

    InterpreterBuilder.create_dot = create_dot


def main() -> int:
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("run with TRITON_INTERPRET=1 in the environment (tests/test_lora_triton.py does)")
    patch_interpreter_bfloat16_dot()
    lines, ok = check("cpu")
    print("\n".join(lines))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
