"""`QuantizationConfig`: the quantization a checkpoint declares (or the user asks for), checked once.

A checkpoint's `config.json` carries `quantization_config` (`quant_method` and its variant); the
user may name a method too (`LLM(quantization=...)`, `--quantization`, vLLM's names). The rules:
- neither: unquantized;
- the checkpoint's: read and checked here; a user's name must agree with it;
- `quantization="fp8"` on a checkpoint without one: online FP8 (every text linear quantized at load);
- anything else (another method, an activation scheme, block size, bit width, `desc_act` ...) is a
  ValueError naming it, so raw quantized bytes are never read as values.

Which modules stay unquantized: the checkpoint's list (`modules_to_not_convert`, or `ignored_layers`)
matched against the checkpoint's module names the way transformers matches them
(`quantizes(module_name)`); online FP8 leaves the vision tower, MoE routers and the small GDN gate
projections unquantized.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Optional

QUANTIZATION_METHODS = ("fp8", "awq", "gptq")

# Online FP8 (a float checkpoint quantized at load) leaves these as they are.
_ONLINE_FP8_UNQUANTIZED = (r".*visual", "mlp.gate", "shared_expert_gate", "in_proj_a", "in_proj_b", "in_proj_ba")


@dataclass(frozen=True)
class QuantizationConfig:
    method: str  # fp8 | awq | gptq
    online: bool = False  # fp8 only: the checkpoint is float, quantized at load
    block_size: tuple[int, int] = (128, 128)  # fp8: [output rows, input columns] per scale
    bits: int = 4  # awq / gptq
    group_size: int = 128  # awq / gptq: input columns per scale and zero point
    sym: bool = False  # gptq: symmetric (the zero point is implied)
    unquantized: tuple[str, ...] = ()  # module-name patterns left unquantized

    def quantizes(self, module_name: str) -> bool:
        """Whether the checkpoint module `module_name` is quantized: not matched by an unquantized pattern
        (from the start or as a regex up to a name boundary, or as a suffix: transformers' rule)."""
        boundary = r"(?:(?<=\.)|(?=\.|$))"
        for pattern in self.unquantized:
            if module_name.endswith(pattern):
                return False
            try:
                if re.match(rf"(?:{pattern}){boundary}", module_name):
                    return False
            except re.error:  # a plain name that is no valid regex
                if module_name.startswith(pattern):
                    return False
        return True

    def describe(self) -> str:
        if self.method == "fp8":
            return f"fp8 e4m3 block {list(self.block_size)}, dynamic activations" + (" (online)" if self.online else "")
        return f"{self.method} int{self.bits} group {self.group_size}"


def resolve_quantization(hf_config: Any, requested: Optional[str]) -> Optional[QuantizationConfig]:
    """The checkpoint's quantization (checked), online FP8, or None; ValueError for anything unsupported."""
    if requested is not None and requested not in QUANTIZATION_METHODS:
        raise ValueError(f"quantization={requested!r} is not supported; supported: {', '.join(QUANTIZATION_METHODS)} "
                         f"(or None: the checkpoint's own)")
    declared = getattr(hf_config, "quantization_config", None)
    if declared is not None and not isinstance(declared, dict):
        declared = declared.to_dict()
    if not declared:
        if requested is None:
            return None
        if requested == "fp8":
            return QuantizationConfig("fp8", online=True, unquantized=_ONLINE_FP8_UNQUANTIZED)
        raise ValueError(f"quantization={requested!r} needs a checkpoint quantized with {requested}; this one has "
                         f"no quantization_config (online quantization exists for 'fp8' only)")
    method = str(declared.get("quant_method", "")).lower()
    if requested is not None and requested != method:
        raise ValueError(f"the checkpoint is quantized with {method!r}; quantization={requested!r} cannot read it "
                         f"(leave quantization unset to use the checkpoint's)")
    unquantized = tuple(declared.get("modules_to_not_convert") or declared.get("ignored_layers") or ())
    if method == "fp8":
        return _fp8(declared, unquantized)
    if method in ("awq", "gptq"):
        return _int4(method, declared, unquantized)
    raise ValueError(f"quantization_config quant_method={method!r} is not supported "
                     f"(supported: {', '.join(QUANTIZATION_METHODS)})")


def _refuse(method: str, field: str, value: Any, supported: str) -> ValueError:
    return ValueError(f"{method} checkpoint with {field}={value!r} is not supported (supported: {supported})")


def _fp8(declared: dict, unquantized: tuple[str, ...]) -> QuantizationConfig:
    fmt = declared.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise _refuse("fp8", "fmt", fmt, "e4m3")
    scheme = declared.get("activation_scheme", "dynamic")
    if scheme != "dynamic":
        raise _refuse("fp8", "activation_scheme", scheme, "dynamic")
    block = declared.get("weight_block_size")
    if block is None or list(block) != [128, 128]:
        raise _refuse("fp8", "weight_block_size", block, "[128, 128], Qwen's block-wise format")
    if declared.get("scale_fmt") not in (None, "float"):
        raise _refuse("fp8", "scale_fmt", declared.get("scale_fmt"), "float")
    return QuantizationConfig("fp8", block_size=(128, 128), unquantized=unquantized)


def _int4(method: str, declared: dict, unquantized: tuple[str, ...]) -> QuantizationConfig:
    bits = declared.get("bits", declared.get("w_bit"))
    if bits != 4:
        raise _refuse(method, "bits", bits, "4")
    group = declared.get("group_size", declared.get("q_group_size"))
    if not isinstance(group, int) or group <= 0:
        raise _refuse(method, "group_size", group, "a positive group size (e.g. 128); per-channel -1 is not")
    if method == "awq":
        if not declared.get("zero_point", True):
            raise _refuse("awq", "zero_point", False, "True")
        version = str(declared.get("version", "gemm")).lower()
        if version != "gemm":
            raise _refuse("awq", "version", version, "gemm")
        return QuantizationConfig("awq", bits=4, group_size=group, unquantized=unquantized)
    if declared.get("desc_act", False):
        raise _refuse("gptq", "desc_act", True, "False (activation-order GPTQ needs its g_idx permutation)")
    fmt = declared.get("checkpoint_format", "gptq")
    if fmt != "gptq":
        raise _refuse("gptq", "checkpoint_format", fmt, "gptq")
    return QuantizationConfig("gptq", bits=4, group_size=group, sym=bool(declared.get("sym", True)),
                              unquantized=unquantized)
