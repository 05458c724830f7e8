"""A PEFT LoRA adapter folder read and checked: `adapter_config.json` + `adapter_model.safetensors`.

What is read: `r` (each module's rank comes from its A tensor, so `rank_pattern` needs no reading),
`lora_alpha` and `alpha_pattern` (PEFT's rule: a pattern matches a module name's tail), `use_rslora`
(scaling alpha / sqrt(r) instead of alpha / r), and one A / B pair per adapted module, keyed by the
module's name in the HF model (`base_model.model.` and PEFT's `.base_layer` wrappers stripped).
`target_modules` (a list or a regex) only told PEFT which modules to adapt: the saved tensors say
which were. Parameters adapted with `target_parameters` (the MoE experts' fused `gate_up_proj` /
`down_proj`; PEFT also turns `gate_proj` / `up_proj` / `down_proj` targets into them on
transformers-5 MoE models) come as the experts module's pairs, A [r * E, in] and B [out, r * E],
one per wrapped parameter (`mapping.py` tells them apart by shape).

Refused with an error naming the adapter and the setting: another PEFT type, `modules_to_save`,
DoRA, LoRA biases, `fan_in_fan_out`, trainable tokens, layer replication, embedding adapters, and
tensors that are not A / B pairs.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_PREFIX = "base_model.model."
_KEY = re.compile(r"^(?P<module>.+)\.lora_(?P<which>A|B)(?:\.[^.]+)?\.weight$")


class LoRAError(ValueError):
    """A LoRA adapter that cannot be served; the message names it."""


@dataclass
class ModuleLoRA:
    """One adapted module or parameter: delta W = scaling * B @ A."""

    a: torch.Tensor  # [rank, in] ([rank * E, in] for experts)
    b: torch.Tensor  # [out, rank] ([out, rank * E] for experts)


@dataclass
class PeftAdapter:
    name: str
    path: Path
    use_rslora: bool
    lora_alpha: float
    alpha_pattern: dict[str, float]
    # HF module name -> its pairs: one for a linear module; for a module whose parameters PEFT wrapped
    # (`target_parameters`, the MoE experts), one per wrapped parameter
    modules: dict[str, list[ModuleLoRA]] = field(default_factory=dict)

    def scaling(self, key: str, rank: int) -> float:
        """PEFT's: alpha / r, or alpha / sqrt(r) with rsLoRA; alpha from `alpha_pattern` by the module's
        name (a wrapped parameter's: module name + "." + parameter name)."""
        alpha = pattern_value(self.alpha_pattern, key, self.lora_alpha)
        return alpha / math.sqrt(rank) if self.use_rslora else alpha / rank


def _refuse(name: str, what: str) -> LoRAError:
    return LoRAError(f"LoRA adapter {name!r}: {what}")


def check_config(name: str, config: dict[str, Any]) -> None:
    """Raise, naming the setting, for what the engine does not serve."""
    if config.get("peft_type", "LORA") != "LORA":
        raise _refuse(name, f"peft_type {config.get('peft_type')!r} is not supported (only LORA)")
    unsupported = {
        "modules_to_save": "modules_to_save (fully trained copies of modules) is not supported",
        "use_dora": "DoRA (use_dora) is not supported",
        "lora_bias": "LoRA biases (lora_bias) are not supported",
        "fan_in_fan_out": "fan_in_fan_out (Conv1D layers) is not supported",
        "trainable_token_indices": "trainable_token_indices is not supported",
        "layer_replication": "layer_replication is not supported",
        "use_qalora": "QA-LoRA is not supported",
    }
    for key, what in unsupported.items():
        if config.get(key):
            raise _refuse(name, what)
    for key in ("r", "lora_alpha"):
        if not isinstance(config.get(key), (int, float)) or config[key] <= 0:
            raise _refuse(name, f"adapter_config.json has no positive {key!r}")


def pattern_value(patterns: dict[str, Any], module: str, default: Any) -> Any:
    """PEFT's rule for rank_pattern / alpha_pattern: the first key that matches the end of the module name."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def configured_rank(path: str | Path) -> int:
    """The largest rank an adapter folder's config names (`r` and `rank_pattern`); LoRAError if unreadable."""
    try:
        config = json.loads((Path(path) / CONFIG_FILE).read_text(encoding="utf-8"))
        return int(max([config["r"], *(config.get("rank_pattern") or {}).values()]))
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise _refuse(str(path), f"cannot read the rank from {Path(path) / CONFIG_FILE}: {e}") from None


def read_adapter(name: str, path: str | Path) -> PeftAdapter:
    """The adapter at `path`; LoRAError (naming `name`) when it is missing, malformed or unsupported."""
    from safetensors.torch import load_file

    folder = Path(path)
    for file in (CONFIG_FILE, WEIGHTS_FILE):
        if not (folder / file).is_file():
            raise _refuse(name, f"{folder / file} does not exist")
    try:
        config = json.loads((folder / CONFIG_FILE).read_text(encoding="utf-8"))
        tensors = load_file(str(folder / WEIGHTS_FILE))
    except (OSError, ValueError) as e:
        raise _refuse(name, f"cannot read {folder}: {e}") from None
    check_config(name, config)
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        if "lora_embedding_" in key:
            raise _refuse(name, f"{key}: adapters on embeddings are not supported")
        m = _KEY.match(key)
        if m is None:
            raise _refuse(name, f"{key} is not a LoRA A or B weight (modules_to_save or another tuner?)")
        module = m["module"].removeprefix(_PREFIX)
        pairs.setdefault(module, {})[m["which"]] = tensor.float()
    adapter = PeftAdapter(name, folder, use_rslora=bool(config.get("use_rslora")),
                          lora_alpha=float(config["lora_alpha"]), alpha_pattern=dict(config.get("alpha_pattern") or {}))
    for module, pair in pairs.items():
        if set(pair) != {"A", "B"} or pair["A"].dim() != 2 or pair["B"].dim() != 2 \
                or pair["A"].shape[0] != pair["B"].shape[1]:
            shapes = {k: tuple(v.shape) for k, v in pair.items()}
            raise _refuse(name, f"{module}: needs lora_A [r, in] and lora_B [out, r], got {shapes}")
        owner = re.sub(r"(\.base_layer)+$", "", module)  # PEFT nests one wrapper per wrapped parameter
        adapter.modules.setdefault(owner, []).append(ModuleLoRA(pair["A"], pair["B"]))
    if not adapter.modules:
        raise _refuse(name, f"{folder / WEIGHTS_FILE} holds no LoRA weights")
    return adapter
