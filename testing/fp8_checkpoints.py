"""FP8 checkpoints in Qwen's block-wise format, written from a float checkpoint (for tests and benchmarks).

`write_fp8_checkpoint(src, dst)` copies a float checkpoint (tokenizer, processors, generation config)
and stores every linear weight `X.weight` [out, in] the unquantized list does not match as
`float8_e4m3fn` plus `X.weight_scale_inv` [ceil(out / 128), ceil(in / 128)]: per 128 x 128 block,
scale = max |w| / 448 over the block (the last row and column of blocks partial when the width is not
a multiple of 128), rounded to the scale dtype (bf16, as Qwen3.5's checkpoints store it, or float32),
the FP8 values the weight divided by that rounded scale. The MoE experts are written per expert
(`mlp.experts.{e}.gate_proj.weight` + `.weight_scale_inv`, Qwen's official layout) or fused as
transformers stores them (`experts.gate_up_proj` [E, 2I, H] + `experts.gate_up_proj_scale_inv`, only
when I is a multiple of 128 so no block straddles gate and up rows).

Which modules stay unquantized: those matched by `unquantized` (transformers' matching rule,
`should_convert_module`) and, with `quantize_vision=False`, the vision tower; embeddings are never
linear layers. config.json gets `quantization_config`, either in Qwen's form (`style="qwen"`: fmt,
activation scheme, block size and the full name of every module left unquantized, as the published
`-FP8` checkpoints list them) or in transformers' own (`style="hf"`: `FineGrainedFP8Config(...).to_dict()`
with the patterns themselves).

`write_dequantized_copy(fp8_dir, dst)` writes the float32 checkpoint an FP8 one stands for (q * scale
per block, in float32, in plain torch), the reference for HF where transformers cannot read the FP8
files (its dequantization needs weight widths divisible by the scale grid). `hf_can_read(fp8_dir)`
says whether it can.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Iterable, Sequence

import torch
from safetensors import safe_open
from safetensors.torch import save_file

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
BLOCK = 128

# What Qwen's published -FP8 checkpoints leave unquantized (as patterns): the LM head and embeddings,
# MoE routers and shared-expert gates, the small GDN projections (norms, conv, A_log, dt_bias are no
# linear weights).
QWEN_UNQUANTIZED: tuple[str, ...] = ("lm_head", "embed_tokens", "mlp.gate", "shared_expert_gate",
                                     "linear_attn.in_proj_a", "linear_attn.in_proj_b", "linear_attn.in_proj_ba")
VISION_PATTERN = r"(?:model\.)?visual"
_NOT_LINEAR = ("embed_tokens", "pos_embed")  # 2-D weights of embeddings
_FUSED_EXPERTS = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<proj>gate_up_proj|down_proj)$")


def quantize_blocks(weight: torch.Tensor, scale_dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """w [out, in] -> (q float8_e4m3fn [out, in], scale [ceil(out/128), ceil(in/128)] in `scale_dtype`)."""
    out, cols = weight.shape
    rb, cb = -(-out // BLOCK), -(-cols // BLOCK)
    padded = torch.zeros(rb * BLOCK, cb * BLOCK)
    padded[:out, :cols] = weight.float()
    blocks = padded.view(rb, BLOCK, cb, BLOCK)
    amax = blocks.abs().amax(dim=(1, 3))
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax)).to(scale_dtype)
    q = (blocks / scale.float()[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q.view(rb * BLOCK, cb * BLOCK)[:out, :cols].contiguous(), scale


def dequantize_blocks(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """q [.., out, in] float8 with block scales [.., ceil(out/128), ceil(in/128)] -> float32 [.., out, in]."""
    out, cols = q.shape[-2:]
    s = scale.float().repeat_interleave(BLOCK, dim=-2)[..., :out, :].repeat_interleave(BLOCK, dim=-1)[..., :cols]
    return q.float() * s


def _read_all(model_dir: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                tensors[name] = f.get_tensor(name)
    return tensors


def _copy_side_files(src: Path, dst: Path) -> None:
    dst.mkdir(parents=True, exist_ok=True)
    for file in Path(src).iterdir():
        if file.is_file() and not file.name.startswith("model") and file.suffix != ".safetensors":
            shutil.copy(file, dst / file.name)


def _keeps(module: str, unquantized: Sequence[str]) -> bool:
    from transformers.quantizers.quantizers_utils import should_convert_module

    return not should_convert_module(module, list(unquantized))


def _per_expert(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Fused expert tensors ([E, 2I, H] gate_up, [E, H, I] down) split into Qwen's per-expert weights."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        m = _FUSED_EXPERTS.match(name)
        if m is None:
            out[name] = tensor
            continue
        for e, w in enumerate(tensor):
            if m["proj"] == "down_proj":
                out[f"{m['prefix']}.{e}.down_proj.weight"] = w
            else:
                gate, up = w.chunk(2, dim=0)
                out[f"{m['prefix']}.{e}.gate_proj.weight"] = gate
                out[f"{m['prefix']}.{e}.up_proj.weight"] = up
    return out


def write_fp8_checkpoint(src: Path, dst: Path, *, unquantized: Sequence[str] = QWEN_UNQUANTIZED,
                         quantize_vision: bool = True, style: str = "qwen", experts: str = "per_expert",
                         scale_dtype: torch.dtype = torch.bfloat16) -> Path:
    """The FP8 checkpoint of the float checkpoint `src`, in `dst` (see the module docstring); returns dst."""
    if style not in ("qwen", "hf") or experts not in ("per_expert", "fused"):
        raise ValueError(f"style {style!r} / experts {experts!r}: expected qwen|hf and per_expert|fused")
    dst = Path(dst)
    _copy_side_files(src, dst)
    patterns = list(unquantized) + ([] if quantize_vision else [VISION_PATTERN])
    tensors = _per_expert(_read_all(src))
    written: dict[str, torch.Tensor] = {}
    kept_modules: list[str] = []
    quantized = {name.rpartition(".")[0] for name, t in tensors.items()
                 if name.endswith(".weight") and t.dim() == 2 and not name[: -len(".weight")].endswith(_NOT_LINEAR)
                 and not _keeps(name[: -len(".weight")], patterns)}
    for name, tensor in tensors.items():
        module, _, leaf = name.rpartition(".")
        if module in quantized and leaf == "weight":
            written[name], written[f"{module}.weight_scale_inv"] = quantize_blocks(tensor, scale_dtype)
            continue
        written[name] = tensor
        if module not in quantized:  # Qwen lists parameters of their own (A_log, dt_bias) as modules too
            kept_modules.append(module if leaf in ("weight", "bias") else name)
    if experts == "fused":
        written = _fuse_experts(written)
    save_file({k: v.contiguous() for k, v in written.items()}, str(dst / "model.safetensors"))
    config = json.loads((Path(src) / "config.json").read_text())
    config["quantization_config"] = _quantization_config(style, patterns, sorted(set(kept_modules)))
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return dst


def _quantization_config(style: str, patterns: list[str], kept_modules: list[str]) -> dict:
    if style == "hf":
        from transformers import FineGrainedFP8Config

        return json.loads(json.dumps(FineGrainedFP8Config(modules_to_not_convert=patterns).to_dict()))
    return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128],
            "modules_to_not_convert": kept_modules}


def _fuse_experts(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-expert weights (and FP8 scales) stacked into transformers' fused [E, ...] tensors."""
    per_expert = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<e>\d+)\.(?P<kind>gate_proj|up_proj|down_proj)\.(?P<leaf>\w+)$")
    groups: dict[tuple[str, str, str], dict[int, torch.Tensor]] = {}
    out: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        m = per_expert.match(name)
        if m is None:
            out[name] = tensor
        else:
            groups.setdefault((m["prefix"], m["kind"], m["leaf"]), {})[int(m["e"])] = tensor
    for (prefix, kind, leaf), by_expert in groups.items():
        if kind == "up_proj":
            continue
        suffix = "" if leaf == "weight" else "_" + leaf.removeprefix("weight_")
        stacked = torch.stack([by_expert[e] for e in sorted(by_expert)])
        if kind == "gate_proj":
            up = groups[(prefix, "up_proj", leaf)]
            if (prefix, kind, "weight_scale_inv") in groups and leaf == "weight" and stacked.shape[1] % BLOCK:
                raise ValueError(f"{prefix}: expert width {stacked.shape[1]} is no multiple of {BLOCK}; "
                                 f"a fused gate_up scale block would straddle gate and up rows")
            stacked = torch.cat([stacked, torch.stack([up[e] for e in sorted(up)])], dim=1)
            out[f"{prefix}.gate_up_proj{suffix}"] = stacked
        else:
            out[f"{prefix}.down_proj{suffix}"] = stacked
    return out


def write_dequantized_copy(fp8_dir: Path, dst: Path, fuse_experts: bool = False) -> Path:
    """The float32 checkpoint the FP8 one in `fp8_dir` stands for (no quantization_config), per-expert weights
    stacked into transformers' fused [E, 2I, H] / [E, H, I] with `fuse_experts` (Qwen3-VL-MoE: transformers
    reads no per-expert layout of it); returns dst."""
    dst = Path(dst)
    _copy_side_files(fp8_dir, dst)
    tensors = _read_all(fp8_dir)
    out = {name: t for name, t in tensors.items() if not name.endswith("scale_inv")}
    for name, scale in tensors.items():
        if name.endswith("scale_inv"):
            weight = name[: -len("_scale_inv")]  # X.weight_scale_inv -> X.weight, experts.gate_up_proj_scale_inv too
            out[weight] = dequantize_blocks(tensors[weight], scale)
    if fuse_experts:
        out = _fuse_experts(out)
    save_file({k: v.contiguous() for k, v in out.items()}, str(dst / "model.safetensors"))
    config = json.loads((Path(fp8_dir) / "config.json").read_text())
    config.pop("quantization_config", None)
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return dst


def hf_can_read(fp8_dir: Path) -> bool:
    """Whether transformers (5.24, dequantizing on the CPU) reads every FP8 weight of `fp8_dir` right: it takes
    the block size from the scale grid, so each width must be a multiple of 128, and it loads fused FP8
    experts (`experts.gate_up_proj` [E, 2I, H]) as raw FP8 values, unscaled, so there must be none."""
    shapes = list(_fp8_shapes(fp8_dir))
    return all(len(shape) == 2 and shape[0] % BLOCK == 0 and shape[1] % BLOCK == 0 for _, shape in shapes)


def _fp8_shapes(model_dir: Path) -> Iterable[tuple[str, tuple[int, ...]]]:
    for file in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            names = set(f.keys())
            for name in names:
                if name + "_scale_inv" in names:
                    yield name, tuple(f.get_slice(name).get_shape())
