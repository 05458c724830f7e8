"""AWQ and GPTQ 4-bit checkpoints written from a float one, and their dequantized float twins, for tests.

`write_int4_checkpoint(float_dir, quantized_dir, reference_dir, method)` quantizes the text
decoder's linear weights of a float checkpoint (attention, dense MLP, MoE experts and shared
expert, GDN `in_proj_qkv` / `in_proj_z` / `in_proj_qkvz` / `out_proj`) to 4 bits, per group of
`group_size` input features with a float16 scale and a zero point (asymmetric min/max, or GPTQ's
symmetric variant with the zero at 8), and writes
- `quantized_dir`: the checkpoint in the method's format (AutoAWQ's GEMM layout, or GPTQ's v1
  "gptq" layout: see `vlmrun/quantization/int4.py`), MoE experts as per-expert modules
  (`experts.{e}.gate_proj.qweight`, ...), with the `quantization_config` AutoAWQ / GPTQ write;
- `reference_dir`: the float checkpoint with each quantized weight replaced by (q - z) * s in
  float32, in its original names and layout, which HF transformers loads on the CPU (it cannot load
  AWQ / GPTQ without their GPU packages): the reference a quantized engine must equal.
Left float: embeddings, the LM head, norms, MoE routers and shared-expert gates, GDN `in_proj_a` /
`in_proj_b` / `in_proj_ba` and `conv1d`, the vision tower, and a layer whose input is not whole
groups (AWQ's config then lists it in `modules_to_not_convert`), unless `partial_groups` writes
it quantized with a partial last group (a layout the engine refuses: for its error test).

The packing here is written from the formats' description, independently of the engine's
unpacking, so a test that runs one on the other's output checks both.
"""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
from safetensors import safe_open
from safetensors.torch import save_file

AWQ_NIBBLE_FEATURES = (0, 2, 4, 6, 1, 3, 5, 7)  # AWQ: nibble k of an int32 holds feature [k] of its 8

# Text-decoder linears that are quantized (as their checkpoint modules are named).
_QUANTIZED = re.compile(
    r"layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(shared_expert\.|experts\.\d+\.)?(gate|up|down)_proj"
    r"|linear_attn\.(in_proj_qkvz|in_proj_qkv|in_proj_z|out_proj))$")
_FUSED_EXPERTS = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<kind>gate_up_proj|down_proj)$")


@dataclass(frozen=True)
class GroupQuantized:
    """W [out, in] ~ (q - zeros) * scales per group of input features."""

    q: torch.Tensor  # [out, in] int64 in [0, 15]
    zeros: torch.Tensor  # [groups, out] int64
    scales: torch.Tensor  # [groups, out] float16
    group: int  # input features per group

    def dequantized(self) -> torch.Tensor:
        """[out, in] float32."""
        width = self.q.shape[1]
        q = _in_groups(self.q, self.group)  # [out, groups, group]
        return ((q - self.zeros.T[:, :, None]).float() * self.scales.T.float()[:, :, None]).flatten(1)[:, :width]


def _in_groups(weight: torch.Tensor, group: int) -> torch.Tensor:
    """[out, in] -> [out, groups, group], the last group padded with zeros (which never widen a range)."""
    groups = -(-weight.shape[1] // group)
    return torch.nn.functional.pad(weight, (0, groups * group - weight.shape[1])).view(weight.shape[0], groups, group)


def quantize_groups(weight: torch.Tensor, group: int, sym: bool, min_zero: int = 0) -> GroupQuantized:
    """Per-group min/max 4-bit quantization of weight [out, in] (the last group may be partial).
    `sym`: the zero at 8 and the scale from the largest magnitude; `min_zero`: the smallest zero point
    allowed (1 for GPTQ's v1 format, which stores zero - 1)."""
    blocks = _in_groups(weight.float(), group)  # [out, groups, group]
    low = blocks.amin(-1).clamp(max=0.0)  # [out, groups]: the range holds 0
    high = blocks.amax(-1).clamp(min=0.0)
    if sym:
        scales = (torch.maximum(-low, high) * 2 / 15).clamp(min=1e-6).half()
        zeros = torch.full_like(scales, 8, dtype=torch.int64)
    else:
        scales = ((high - low) / 15).clamp(min=1e-6).half()
        zeros = torch.round(-low / scales.float()).to(torch.int64).clamp(min_zero, 15)
    q = (torch.round(blocks / scales.float()[:, :, None]) + zeros[:, :, None]).clamp(0, 15)
    q = q.flatten(1)[:, :weight.shape[1]].to(torch.int64)
    return GroupQuantized(q, zeros.T.contiguous(), scales.T.contiguous(), group)


def pack_nibbles(values: torch.Tensor, dim: int, nibble_features: tuple[int, ...] = tuple(range(8))) -> torch.Tensor:
    """int values in [0, 15] -> int32, 8 per element along `dim`: nibble k (bits 4k..4k+3) of element j
    holds feature 8j + nibble_features[k]."""
    values = values.movedim(dim, -1).to(torch.int64)
    words = torch.zeros(*values.shape[:-1], values.shape[-1] // 8, dtype=torch.int64)
    for k, feature in enumerate(nibble_features):
        words |= values[..., feature::8] << (4 * k)
    words = torch.where(words >= 2**31, words - 2**32, words)  # the same 32 bits as a signed int32
    return words.to(torch.int32).movedim(-1, dim).contiguous()


def format_tensors(module: str, quantized: GroupQuantized, method: str, group: int) -> dict[str, torch.Tensor]:
    """The checkpoint tensors of one quantized [out, in] weight, named `module.qweight` etc."""
    q_in_out = quantized.q.T  # [in, out]
    if method == "awq":
        return {f"{module}.qweight": pack_nibbles(q_in_out, 1, AWQ_NIBBLE_FEATURES),
                f"{module}.qzeros": pack_nibbles(quantized.zeros, 1, AWQ_NIBBLE_FEATURES),
                f"{module}.scales": quantized.scales}
    width = q_in_out.shape[0]
    return {f"{module}.qweight": pack_nibbles(q_in_out, 0),
            f"{module}.qzeros": pack_nibbles(quantized.zeros - 1, 1),  # v1 stores zero - 1
            f"{module}.scales": quantized.scales,
            f"{module}.g_idx": (torch.arange(width) // group).to(torch.int32)}


def quantization_config(method: str, group: int, sym: bool, unquantized: list[str]) -> dict:
    """config.json's `quantization_config` as AutoAWQ (GEMM) or GPTQ (v1, no activation order) write it."""
    if method == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True, "version": "gemm",
                "modules_to_not_convert": unquantized or None}
    return {"quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": False, "sym": sym,
            "checkpoint_format": "gptq", "static_groups": False, "true_sequential": True}


def write_int4_checkpoint(float_dir: Path, quantized_dir: Path, reference_dir: Optional[Path], method: str, *,
                          group_size: int = 128, sym: bool = False, partial_groups: bool = False) -> Path:
    """Writes the `method` ("awq" | "gptq") checkpoint of `float_dir` to `quantized_dir` and its dequantized
    float twin to `reference_dir` (when given); returns `quantized_dir`."""
    if method not in ("awq", "gptq") or (sym and method == "awq"):
        raise ValueError(f"method {method!r} (sym={sym}) is not written here: awq, gptq or gptq sym")
    float_dir, quantized_dir = Path(float_dir), Path(quantized_dir)
    tensors = _read_all(float_dir)
    packed: dict[str, torch.Tensor] = {}
    reference: dict[str, torch.Tensor] = {}
    left_float: list[str] = []

    def quantize(module: str, weight: torch.Tensor) -> Optional[torch.Tensor]:
        """Packs `module`'s weight [out, in]; returns its dequantized copy (None: left float)."""
        out, width = weight.shape
        if out % 8 or width % 8 or (width % group_size and not partial_groups):
            left_float.append(module)
            return None
        quantized = quantize_groups(weight, group_size, sym, min_zero=1 if method == "gptq" else 0)
        packed.update(format_tensors(module, quantized, method, group_size))
        return quantized.dequantized()

    for name, tensor in tensors.items():
        module, _, leaf = name.rpartition(".")
        fused = _FUSED_EXPERTS.match(name)
        if leaf == "weight" and tensor.dim() == 2 and _QUANTIZED.search(module) and "visual" not in module:
            dequantized = quantize(module, tensor)
            if dequantized is None:
                packed[name] = reference[name] = tensor
            else:
                reference[name] = dequantized
        elif fused is not None:
            reference[name] = _quantize_fused_experts(fused["prefix"], fused["kind"], tensor, tensors, quantize, packed)
        else:
            packed[name] = reference[name] = tensor
    unquantized = (["visual"] if _has_vision(float_dir) else []) + left_float
    _write(float_dir, quantized_dir, packed, quantization_config(method, group_size, sym, unquantized))
    if reference_dir is not None:
        _write(float_dir, Path(reference_dir), reference, None)
    return quantized_dir


def _quantize_fused_experts(prefix: str, kind: str, tensor: torch.Tensor, tensors: dict[str, torch.Tensor],
                            quantize, packed: dict[str, torch.Tensor]) -> torch.Tensor:
    """transformers' fused experts (`gate_up_proj` [E, 2I, H] / `down_proj` [E, H, I], or both transposed)
    -> per-expert quantized modules; returns the dequantized fused tensor in the same layout."""
    (g1, g2), (d1, d2) = tensors[f"{prefix}.gate_up_proj"].shape[1:], tensors[f"{prefix}.down_proj"].shape[1:]
    stored = g1 == 2 * d2 and g2 == d1  # [E, 2I, H] and [E, H, I]
    transposed = g2 == 2 * d1 and g1 == d2  # [E, H, 2I] and [E, I, H]
    if stored == transposed:
        raise ValueError(f"{prefix}: expert shapes {(g1, g2)} / {(d1, d2)} do not tell their layout")
    units = d2 if stored else d1
    rows = []
    for e, weight in enumerate(tensor):
        weight = weight.T if transposed else weight  # [out, in]
        if kind == "gate_up_proj":
            parts = [(f"{prefix}.{e}.gate_proj", weight[:units]), (f"{prefix}.{e}.up_proj", weight[units:])]
        else:
            parts = [(f"{prefix}.{e}.down_proj", weight)]
        dequantized = []
        for module, part in parts:
            copy = quantize(module, part)
            if copy is None:
                raise ValueError(f"{module}: expert widths {tuple(part.shape)} cannot be quantized in groups")
            dequantized.append(copy)
        fused = torch.cat(dequantized)
        rows.append(fused.T if transposed else fused)
    return torch.stack(rows)


def _read_all(model_dir: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for file in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            tensors.update({name: f.get_tensor(name) for name in f.keys()})
    return tensors


def _has_vision(model_dir: Path) -> bool:
    return "vision_config" in json.loads((model_dir / "config.json").read_text())


def _write(float_dir: Path, out_dir: Path, tensors: dict[str, torch.Tensor], quant: Optional[dict]) -> None:
    """`tensors` as one safetensors file, with every other file of `float_dir` (config.json with `quant`)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    for file in float_dir.iterdir():
        if file.is_file() and not file.name.startswith("model.safetensors") and file.suffix != ".safetensors":
            shutil.copy(file, out_dir / file.name)
    config = json.loads((float_dir / "config.json").read_text())
    if quant is not None:
        config["quantization_config"] = quant
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out_dir / "model.safetensors"),
              metadata={"format": "pt"})
