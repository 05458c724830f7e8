"""Linear layers and embeddings split across tensor-parallel ranks, each loading its own slice.

- `ColumnParallelLinear`: the output rows are split; this rank computes its share of the outputs.
  Its rows may be several *parts* (fused q | k | v, gate | up, GDN q | k | v | z), each sharded on
  its own (`Shard`), so this rank's output is its q heads, then its k heads, then its v heads.
- `RowParallelLinear`: the input columns are split; each rank computes a partial sum, summed over
  the ranks (all-reduce), then the bias is added once.
- `ShardedRows`: the parameter holder both column layouts rest on (also the GDN conv weight).
- `VocabParallelEmbedding` / `ParallelLMHead`: the vocabulary split in equal blocks (the last one
  padded); embedding rows outside this rank's block are zero before the all-reduce, logits are
  gathered and cut back to the vocabulary.

Every sharded layer has `load_weight(name, tensor, part)`, which the one checkpoint loader
(`vlmrun.models.weights.load_checkpoint`) calls with the *full* checkpoint tensor; the layer takes
its rows with `tensor.narrow`, so a lazily read safetensors tensor (`vlmrun.loader.LazyTensor`)
reads only this rank's slice. A fused layer names its checkpoint parts (`part_names`, e.g.
`("q_proj", "k_proj", "v_proj")`): the loader sends `self_attn.q_proj.weight` to
`self_attn.qkv_proj.weight` as part 0. With one rank every layer is the plain torch layer.
The layers multiply through `linear()`: `F.linear`, or oneDNN's GEMM once the weights have been
packed for it (`vlmrun.layers.packed_linear`, the CPU fast path).
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from vlmrun.parallel import SINGLE, Shard, TensorParallel


def linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x [.., in] -> [.., out]: oneDNN's GEMM for a weight packed for it (`vlmrun.layers.packed_linear`),
    `F.linear` for a plain one."""
    if weight.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


def copy_rows(dst: torch.Tensor, src: Any, src_start: int, hf_name: str) -> None:
    """dst <- src rows [src_start, src_start + len(dst)) (src: a tensor or a LazyTensor; only those rows are read)."""
    rows = src.narrow(0, src_start, dst.shape[0])
    if tuple(rows.shape) != tuple(dst.shape):
        raise ValueError(f"shape mismatch for {hf_name}: rows {tuple(rows.shape)} of the checkpoint, "
                         f"model shard {tuple(dst.shape)}")
    with torch.no_grad():
        dst.copy_(rows.to(dst.dtype))


def check_shape(tensor: Any, expected: Sequence[int], hf_name: str, name: str) -> None:
    if tuple(tensor.shape) != tuple(expected):
        raise ValueError(f"shape mismatch for {hf_name} -> {name}: checkpoint {tuple(tensor.shape)}, "
                         f"model (unsharded) {tuple(expected)}")


class ShardedRows(nn.Module):
    """`weight [sum of this rank's part rows, *tail]` (and `bias`): parts stacked, each one this rank's shard."""

    def __init__(self, shards: Sequence[Shard], tail: Sequence[int], bias: bool = False,
                 part_names: Sequence[str] = ()):
        super().__init__()
        self.shards = list(shards)
        self.part_names = tuple(part_names)  # checkpoint names of the parts when each part is its own tensor
        rows = sum(s.length for s in self.shards)
        self.weight = nn.Parameter(torch.empty(rows, *tail))
        self.bias = nn.Parameter(torch.empty(rows)) if bias else None

    def load_weight(self, name: str, tensor: Any, part: Optional[int], hf_name: str) -> None:
        """`tensor` is the full checkpoint tensor of part `part`, or of all parts stacked (part None)."""
        param = getattr(self, name)
        parts = range(len(self.shards)) if part is None else [part]
        tail = tuple(param.shape[1:])
        check_shape(tensor, (sum(self.shards[p].total for p in parts), *tail), hf_name, name)
        src_offset = 0
        for p in parts:
            shard = self.shards[p]
            dst_offset = sum(s.length for s in self.shards[:p])
            copy_rows(param[dst_offset:dst_offset + shard.length], tensor, src_offset + shard.start, hf_name)
            src_offset += shard.total


class ColumnParallelLinear(ShardedRows):
    """x [.., in] -> this rank's output rows [.., sum of part shards]; no communication."""

    def __init__(self, in_features: int, shards: Sequence[Shard], bias: bool = False,
                 part_names: Sequence[str] = ()):
        super().__init__(shards, (in_features,), bias, part_names)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """x [.., in / size] (this rank's input columns) -> [.., out], summed over the ranks unless `reduce=False`.

    `reduce=False` leaves the partial sum for the caller to reduce once (the MoE block sums its
    experts and shared expert together); such a layer has no bias."""

    def __init__(self, in_features: int, out_features: int, tp: TensorParallel = SINGLE, bias: bool = False,
                 reduce: bool = True):
        super().__init__()
        if bias and not reduce:
            raise ValueError("a row-parallel linear that leaves its sum unreduced cannot add a bias")
        self.tp = tp
        self.reduce = reduce
        self.shard = tp.split(in_features, "input features")
        self.weight = nn.Parameter(torch.empty(out_features, self.shard.length))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return linear(x, self.weight, self.bias)
        y = linear(x, self.weight)  # [.., out] partial sum over this rank's inputs
        if self.reduce:
            y = self.tp.all_reduce(y)
        return y if self.bias is None else y + self.bias

    def load_weight(self, name: str, tensor: Any, part: Optional[int], hf_name: str) -> None:
        param = getattr(self, name)
        if name == "bias":
            check_shape(tensor, param.shape, hf_name, name)
            copy_rows(param, tensor, 0, hf_name)
            return
        check_shape(tensor, (param.shape[0], self.shard.total), hf_name, name)
        with torch.no_grad():
            param.copy_(tensor.narrow(1, self.shard.start, self.shard.length).to(param.dtype))


class VocabParallelEmbedding(nn.Module):
    """token ids [T] -> [T, hidden]; this rank holds vocabulary rows [start, start + rows_per_rank)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, tp: TensorParallel = SINGLE):
        super().__init__()
        self.tp = tp
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        per_rank = -(-num_embeddings // tp.size)
        self.start = tp.rank * per_rank
        self.weight = nn.Parameter(torch.empty(per_rank, embedding_dim))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        mine = (local >= 0) & (local < self.weight.shape[0])  # [T]
        out = F.embedding(local.clamp(0, self.weight.shape[0] - 1), self.weight) * mine[:, None]
        return self.tp.all_reduce(out)  # [T, hidden]

    def load_weight(self, name: str, tensor: Any, part: Optional[int], hf_name: str) -> None:
        check_shape(tensor, (self.num_embeddings, self.embedding_dim), hf_name, name)
        rows = max(min(self.weight.shape[0], self.num_embeddings - self.start), 0)
        with torch.no_grad():
            self.weight[rows:].zero_()  # padding rows of the last block
        copy_rows(self.weight[:rows], tensor, self.start, hf_name)


class ParallelLMHead(VocabParallelEmbedding):
    """hidden [n, hidden] -> logits [n, vocab]: each rank its vocabulary block, gathered."""

    @property
    def in_features(self) -> int:  # nn.Linear's names
        return self.embedding_dim

    @property
    def out_features(self) -> int:
        return self.num_embeddings

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = linear(hidden, self.weight)  # [n, rows_per_rank]
        if self.tp.size == 1:
            return logits
        return self.tp.all_gather(logits)[..., : self.num_embeddings]
