"""Linear layers and embeddings split across tensor-parallel ranks, each loading its own slice.

- `LinearBase`: a linear layer of `out_shards` output rows and `in_shard` input columns whose
  weight is stored and multiplied by its `LinearMethod` (`vlmrun.layers.linear_method`: plain,
  oneDNN-packed, FP8 block-wise, int4): the layer registers the method's tensors and cuts this
  rank's slice of each from the full checkpoint tensor, by the dims and packing the method declares.
- `ColumnParallelLinear`: the output rows are split; this rank computes its share of the outputs.
  Its rows may be several *parts* (fused q | k | v, gate | up, GDN q | k | v | z), each sharded on
  its own (`Shard`), so this rank's output is its q heads, then its k heads, then its v heads.
  `ReplicatedLinear`: one part, whole (the vision tower, MoE routers).
- `RowParallelLinear`: the input columns are split; each rank computes a partial sum, summed over
  the ranks (all-reduce), then the bias is added once.
- A layer's `lora` (None unless LoRA is enabled: `vlmrun.lora`) adds each row's adapter update to
  its output (a row-parallel layer's before the all-reduce).
- `ShardedRows`: a plain parameter with sharded rows (the GDN conv weight).
- `VocabParallelEmbedding` / `ParallelLMHead`: the vocabulary split in equal blocks (the last one
  padded); embedding rows outside this rank's block are zero before the all-reduce, logits are
  gathered and cut back to the vocabulary.

Every sharded layer has `load_weight(name, tensor, part, hf_name)`, which the one checkpoint loader
(`vlmrun.models.weights.load_checkpoint`) calls with the *full* checkpoint tensor; the layer takes
its rows with `tensor.narrow`, so a lazily read safetensors tensor (`vlmrun.loader.LazyTensor`)
reads only this rank's slice. A fused layer names its checkpoint parts (`part_names`, e.g.
`("q_proj", "k_proj", "v_proj")`): the loader sends `self_attn.q_proj.weight` to
`self_attn.qkv_proj.weight` as part 0 (and `q_proj.weight_scale_inv` to `qkv_proj.weight_scale_inv`).
With one rank every layer is the plain torch layer.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from vlmrun.loader import materialize
from vlmrun.layers.linear_method import UNQUANTIZED, LinearMethod, ParamSpec
from vlmrun.parallel import SINGLE, Shard, TensorParallel

def copy_rows(dst: torch.Tensor, src: Any, src_start: int, hf_name: str) -> None:
    """dst <- src rows [src_start, src_start + len(dst)) (src: a tensor or a LazyTensor; only those rows are read)."""
    rows = src.narrow(0, src_start, dst.shape[0])
    if tuple(rows.shape) != tuple(dst.shape):
        raise ValueError(f"shape mismatch for {hf_name}: rows {tuple(rows.shape)} of the checkpoint, "
                         f"model shard {tuple(dst.shape)}")
    copy_checked(dst, rows, hf_name)


def check_shape(tensor: Any, expected: Sequence[int], hf_name: str, name: str) -> None:
    if tuple(tensor.shape) != tuple(expected):
        raise ValueError(f"shape mismatch for {hf_name} -> {name}: checkpoint {tuple(tensor.shape)}, "
                         f"model (unsharded) {tuple(expected)}")


def is_quantized_dtype(dtype: torch.dtype) -> bool:
    """Bytes that are not values as they stand: float8 (scaled) and integers (packed int4, indices)."""
    return dtype in (torch.float8_e4m3fn, torch.float8_e5m2) or not (dtype.is_floating_point or dtype.is_complex)


def copy_checked(dst: torch.Tensor, src: torch.Tensor, hf_name: str) -> None:
    """dst <- src, converting float to float; quantized bytes go only where the same format is expected
    (never read as values by an unquantized layer, which is how an FP8 checkpoint used to load as garbage)."""
    if src.dtype != dst.dtype and (is_quantized_dtype(src.dtype) or is_quantized_dtype(dst.dtype)):
        raise ValueError(f"{hf_name}: the checkpoint stores {src.dtype}, the model expects {dst.dtype} there; "
                         f"a quantized tensor needs its quantization_config (and a layer quantized by it), "
                         f"an unquantized one a layer left unquantized")
    with torch.no_grad():
        dst.copy_(src.to(dst.dtype))


def _take(tensor: Any, dim: Optional[int], start: int, length: int) -> Any:
    """`tensor` narrowed along `dim` (the whole of it when the slice is all of it)."""
    if dim is None or (start == 0 and length == tensor.shape[dim]):
        return tensor
    return tensor.narrow(dim, start, length)


def _shard_offset(start: int, pack: int, what: str) -> int:
    if start % pack:
        raise ValueError(f"{what} starts at {start}, not a multiple of the {pack} features one stored element covers")
    return start // pack


def named_specs(method: LinearMethod, out_features: int, in_features: int, layer_name: str) -> dict[str, ParamSpec]:
    """`method.param_specs`; its ValueError (a width the format cannot store) names the layer."""
    try:
        return method.param_specs(out_features, in_features)
    except ValueError as e:
        raise ValueError(f"{layer_name}: {e}") from None


def fused_part_aliases(module: nn.Module) -> dict[str, tuple[str, int]]:
    """Checkpoint-style name of a fused part (`...self_attn.q_proj.weight`) -> (our parameter, part index)."""
    aliases = {}
    for prefix, sub in module.named_modules():
        parent = prefix.rpartition(".")[0]
        for i, part in enumerate(getattr(sub, "part_names", ())):
            for local, param in sub._parameters.items():
                if param is not None:
                    ours = f"{prefix}.{local}" if prefix else local
                    aliases[f"{parent}.{part}.{local}" if parent else f"{part}.{local}"] = (ours, i)
    return aliases


class LinearBase(nn.Module):
    """x [.., in_shard] -> [.., sum of out shard lengths]; the weight's format is `self.method`'s.

    `out_shards`: this rank's rows of each part (stacked), `in_shard`: its input columns. The layer's
    tensors are the method's `param_specs` (plus `bias`, sharded with the output rows); `stored_dtypes`
    names those that keep their own dtype when the model is built in another."""

    def __init__(self, out_shards: Sequence[Shard], in_shard: Shard, bias: bool = False,
                 part_names: Sequence[str] = ()):
        super().__init__()
        self.out_shards = list(out_shards)
        self.in_shard = in_shard
        self.part_names = tuple(part_names)  # checkpoint names of the parts when each part is its own tensor
        self.out_features = sum(s.length for s in self.out_shards)  # this rank's
        self.in_features = in_shard.length
        self.param_names: tuple[str, ...] = ()
        self.stored_dtypes: dict[str, torch.dtype] = {}
        self.method: LinearMethod = UNQUANTIZED
        self.use_method(UNQUANTIZED)
        self.bias = nn.Parameter(torch.empty(self.out_features)) if bias else None
        # LoRA adapters (`vlmrun.lora.layers.LinearLoRA`, given by `attach_lora`): `lora.add(x, y)` adds each
        # row's low-rank update to the output, before a row-parallel layer's all-reduce
        self.lora: Optional[Any] = None

    # ------------------------------------------------------------------ building

    def use_method(self, method: LinearMethod, layer_name: str = "", tp_size: int = 1) -> None:
        """Registers `method`'s (empty) tensors in place of the current method's; raises, naming the layer
        and the TP size, when this rank's shard cannot be cut from the method's packed tensors."""
        for name in self.param_names:
            delattr(self, name)
        self._check_shard_alignment(method, layer_name, tp_size)
        specs = named_specs(method, self.out_features, self.in_features, layer_name or type(self).__name__)
        for name, spec in specs.items():
            self.register_parameter(name, nn.Parameter(torch.empty(spec.shape, dtype=spec.dtype or torch.float32),
                                                       requires_grad=False))
        self.param_names = tuple(specs)
        self.stored_dtypes = {n: s.dtype for n, s in specs.items() if s.dtype is not None}
        self.method = method

    def swap_method(self, method: LinearMethod, tensors: dict[str, torch.Tensor]) -> None:
        """Moves a loaded layer to `method` with its tensors given filled, by spec name (a layer quantized
        after loading: online FP8)."""
        for name in self.param_names:
            delattr(self, name)
        for name, tensor in tensors.items():
            self.register_parameter(name, nn.Parameter(tensor, requires_grad=False))
        self.param_names = tuple(tensors)
        self.stored_dtypes = {n: t.dtype for n, t in tensors.items()}
        self.method = method

    def _check_shard_alignment(self, method: LinearMethod, layer_name: str, tp_size: int) -> None:
        name = layer_name or type(self).__name__
        for shard in self.out_shards:
            self._check_one(named_specs(method, shard.total, self.in_shard.total, name), "out_dim", "out_pack", shard,
                            method, layer_name, tp_size, "output rows")
        self._check_one(named_specs(method, self.out_shards[0].total, self.in_shard.total, name), "in_dim", "in_pack",
                        self.in_shard, method, layer_name, tp_size, "input columns")

    def _check_one(self, specs: dict[str, ParamSpec], dim: str, pack: str, shard: Shard, method: LinearMethod,
                   layer_name: str, tp_size: int, what: str) -> None:
        if shard.length == shard.total:
            return
        for name, spec in specs.items():
            p = getattr(spec, pack)
            if getattr(spec, dim) is None or p == 1:
                continue
            ends_at_total = shard.start + shard.length == shard.total
            if shard.start % p or (shard.length % p and not ends_at_total):
                raise ValueError(
                    f"{layer_name or type(self).__name__}: tensor_parallel_size={tp_size} gives this rank "
                    f"{what} [{shard.start}, {shard.start + shard.length}) of {shard.total}, but {method.name}'s "
                    f"{name} stores them {p} to an element: each rank's share must be whole {p}-wide blocks")

    # ------------------------------------------------------------------ loading

    def part_rows(self, part: Optional[int]) -> int:
        """The checkpoint's output rows of part `part` (of all parts stacked when None)."""
        parts = range(len(self.out_shards)) if part is None else [part]
        return sum(self.out_shards[p].total for p in parts)

    def checkpoint_tensor(self, name: str, tensor: Any, part: Optional[int]) -> Any:
        """A checkpoint tensor in the layout this layer's parameter keeps (before any model transform)."""
        if name == "bias":
            return tensor
        return self.method.checkpoint_tensor(name, tensor, self.part_rows(part))

    def load_weight(self, name: str, tensor: Any, part: Optional[int], hf_name: str) -> None:
        """`tensor` is the full checkpoint tensor of part `part`, or of all parts stacked (part None)."""
        param = getattr(self, name)
        parts = range(len(self.out_shards)) if part is None else [part]
        if name == "bias":
            full = ParamSpec((self.part_rows(part),), in_dim=None)
            local = [ParamSpec((self.out_shards[p].length,), in_dim=None) for p in range(len(self.out_shards))]
            whole = [ParamSpec((self.out_shards[p].total,), in_dim=None) for p in range(len(self.out_shards))]
        else:
            specs = self.method.param_specs
            full = specs(self.part_rows(part), self.in_shard.total)[name]
            local = [specs(s.length, self.in_features)[name] for s in self.out_shards]
            whole = [specs(s.total, self.in_shard.total)[name] for s in self.out_shards]
        check_shape(tensor, full.shape, hf_name, name)
        out_dim, in_dim = full.out_dim, full.in_dim
        in_start = 0 if in_dim is None else _shard_offset(self.in_shard.start, full.in_pack, f"{hf_name}'s input slice")
        src_offset = 0
        for p in parts:
            shard = self.out_shards[p]
            dst_offset = sum(local[q].size_along(out_dim) for q in range(p))
            rows = local[p].size_along(out_dim)
            start = src_offset + _shard_offset(shard.start, full.out_pack, f"{hf_name}'s output slice")
            src = _take(tensor, out_dim, start, rows)
            src = _take(src, in_dim, in_start, local[p].size_along(in_dim))
            dst = param if out_dim is None else param.narrow(out_dim, dst_offset, rows)
            src = materialize(src)
            if tuple(src.shape) != tuple(dst.shape):
                raise ValueError(f"shape mismatch for {hf_name}: slice {tuple(src.shape)} of the checkpoint, "
                                 f"model shard {tuple(dst.shape)}")
            copy_checked(dst, src, hf_name)
            src_offset += whole[p].size_along(out_dim)

    def method_params(self) -> dict[str, torch.Tensor]:
        """The method's tensors by spec name."""
        return {name: getattr(self, name) for name in self.param_names}


class ShardedRows(nn.Module):
    """`weight [sum of this rank's part rows, *tail]`: parts stacked, each one this rank's shard (the GDN conv)."""

    def __init__(self, shards: Sequence[Shard], tail: Sequence[int]):
        super().__init__()
        self.shards = list(shards)
        self.weight = nn.Parameter(torch.empty(sum(s.length for s in self.shards), *tail))

    def load_weight(self, name: str, tensor: Any, part: Optional[int], hf_name: str) -> None:
        """`tensor` is the full checkpoint tensor of all parts stacked."""
        tail = tuple(self.weight.shape[1:])
        check_shape(tensor, (sum(s.total for s in self.shards), *tail), hf_name, name)
        src_offset = dst_offset = 0
        for shard in self.shards:
            copy_rows(self.weight[dst_offset:dst_offset + shard.length], tensor, src_offset + shard.start, hf_name)
            src_offset += shard.total
            dst_offset += shard.length


class ColumnParallelLinear(LinearBase):
    """x [.., in] -> this rank's output rows [.., sum of part shards]; no communication."""

    def __init__(self, in_features: int, shards: Sequence[Shard], bias: bool = False,
                 part_names: Sequence[str] = ()):
        super().__init__(shards, Shard(in_features, 0, in_features), bias, part_names)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.method.apply(self, x, self.bias)
        return y if self.lora is None else self.lora.add(x, y)


class ReplicatedLinear(ColumnParallelLinear):
    """nn.Linear's layer, every rank holding all of it (the vision tower, MoE routers)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True):
        super().__init__(in_features, [Shard(out_features, 0, out_features)], bias)


class RowParallelLinear(LinearBase):
    """x [.., in / size] (this rank's input columns) -> [.., out], summed over the ranks unless `reduce=False`.

    `reduce=False` leaves the partial sum for the caller to reduce once (the MoE block sums its
    experts and shared expert together); such a layer has no bias."""

    def __init__(self, in_features: int, out_features: int, tp: TensorParallel = SINGLE, bias: bool = False,
                 reduce: bool = True):
        if bias and not reduce:
            raise ValueError("a row-parallel linear that leaves its sum unreduced cannot add a bias")
        super().__init__([Shard(out_features, 0, out_features)], tp.split(in_features, "input features"), bias)
        self.tp = tp
        self.reduce = reduce

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            y = self.method.apply(self, x, self.bias)
            return y if self.lora is None else self.lora.add(x, y)
        y = self.method.apply(self, x, None)  # [.., out] partial sum over this rank's inputs
        if self.lora is not None:  # this rank's share of the update: A's columns of its inputs
            y = self.lora.add(x, y)
        if self.reduce:
            y = self.tp.all_reduce(y)
        return y if self.bias is None else y + self.bias


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

    method: LinearMethod = UNQUANTIZED  # oneDNN packs it on the CPU; never quantized

    def method_params(self) -> dict[str, torch.Tensor]:
        return {"weight": self.weight}

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.method.apply(self, hidden, None)  # [n, rows_per_rank]
        if self.tp.size == 1:
            return logits
        return self.tp.all_gather(logits)[..., : self.num_embeddings]
