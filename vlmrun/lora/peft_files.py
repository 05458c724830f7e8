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
tensors that are not A / B pairs. A broken adapter is a `LoRAError` too, naming what is wrong, never
another exception: a config that is not a JSON object, an `r` / `lora_alpha` / `alpha_pattern` /
`rank_pattern` value that is not a finite positive number (JSON's `Infinity` and `NaN` included) or
a pattern that is not a regex, a rank over `MAX_LORA_RANK` or over what the tensors hold, a weights
file that is empty, truncated or whose header lies, rank-0 pairs, and tensors holding NaN or inf (one
such adapter would turn its rows' outputs to NaN).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch

MAX_LORA_RANK = 512  # the largest rank an adapter may have (vLLM's largest max_lora_rank)
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
    configured_rank: int = 0  # the largest of the config's `r` and `rank_pattern` values, at most A's most rows
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


def check_config(name: str, config: Any) -> None:
    """Raise, naming the setting, for what the engine does not serve or a value that is not valid."""
    if not isinstance(config, dict):
        raise _refuse(name, f"{CONFIG_FILE} holds a JSON {type(config).__name__}, not an object")
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
    _check_rank(name, "'r'", config.get("r"))
    _check_alpha(name, "'lora_alpha'", config.get("lora_alpha"))
    for key, check in (("alpha_pattern", _check_alpha), ("rank_pattern", _check_rank)):
        patterns = config.get(key) or {}
        if not isinstance(patterns, dict):
            raise _refuse(name, f"{key} must be an object of module pattern -> value, got {patterns!r}")
        for pattern, value in patterns.items():
            try:
                re.compile(pattern)
            except re.error as e:
                raise _refuse(name, f"{key} key {pattern!r} is not a regular expression: {e}") from None
            check(name, f"{key}[{pattern!r}]", value)


def _check_rank(name: str, what: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_LORA_RANK:
        raise _refuse(name, f"{what} must be an integer rank from 1 to {MAX_LORA_RANK}, got {value!r}")


def _check_alpha(name: str, what: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise _refuse(name, f"{what} must be a finite positive number, got {value!r}")


def pattern_value(patterns: dict[str, Any], module: str, default: Any) -> Any:
    """PEFT's rule for rank_pattern / alpha_pattern: the first key that matches the end of the module name."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def configured_rank(path: str | Path) -> int:
    """The largest rank an adapter folder's config names (`r` and `rank_pattern`; at most its lora_A tensors' rows),
    the whole adapter read and checked first (`read_adapter`): LoRAError naming what is wrong, before any slot
    is sized by it."""
    adapter = read_adapter(str(path), path)
    return adapter.configured_rank


def read_adapter(name: str, path: str | Path) -> PeftAdapter:
    """The adapter at `path`; LoRAError (naming `name`) when it is missing, malformed or unsupported."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    folder = Path(path)
    for file in (CONFIG_FILE, WEIGHTS_FILE):
        if not (folder / file).is_file():
            raise _refuse(name, f"{folder / file} does not exist")
    try:
        config = json.loads((folder / CONFIG_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise _refuse(name, f"cannot read {folder / CONFIG_FILE}: {e}") from None
    check_config(name, config)
    try:
        tensors = load_file(str(folder / WEIGHTS_FILE))  # the header is checked against the file's size first
    except (OSError, ValueError, SafetensorError) as e:
        raise _refuse(name, f"cannot read {folder / WEIGHTS_FILE} (empty, truncated or not safetensors?): {e}") from None
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        if "lora_embedding_" in key:
            raise _refuse(name, f"{key}: adapters on embeddings are not supported")
        m = _KEY.match(key)
        if m is None:
            raise _refuse(name, f"{key} is not a LoRA A or B weight (modules_to_save or another tuner?)")
        if not tensor.is_floating_point():
            raise _refuse(name, f"{key} holds {tensor.dtype} values, not floating point")
        tensor = tensor.float()
        bad = int((~torch.isfinite(tensor)).sum())
        if bad:
            raise _refuse(name, f"{key} holds {bad} NaN or inf value{'s' if bad > 1 else ''}")
        module = m["module"].removeprefix(_PREFIX)
        pairs.setdefault(module, {})[m["which"]] = tensor
    ranks = [config["r"], *(config.get("rank_pattern") or {}).values()]
    adapter = PeftAdapter(name, folder, use_rslora=bool(config.get("use_rslora")),
                          lora_alpha=float(config["lora_alpha"]), alpha_pattern=dict(config.get("alpha_pattern") or {}),
                          configured_rank=max(ranks))
    for module, pair in pairs.items():
        if set(pair) != {"A", "B"} or pair["A"].dim() != 2 or pair["B"].dim() != 2 \
                or pair["A"].shape[0] != pair["B"].shape[1] or pair["A"].shape[0] == 0:
            shapes = {k: tuple(v.shape) for k, v in pair.items()}
            raise _refuse(name, f"{module}: needs lora_A [r, in] and lora_B [out, r] with r >= 1, got {shapes}")
        owner = re.sub(r"(\.base_layer)+$", "", module)  # PEFT nests one wrapper per wrapped parameter
        adapter.modules.setdefault(owner, []).append(ModuleLoRA(pair["A"], pair["B"]))
    if not adapter.modules:
        raise _refuse(name, f"{folder / WEIGHTS_FILE} holds no LoRA weights")
    # a rank is at most A's rows (r * experts for the MoE experts): what the config claims past them sizes nothing
    most_rows = max(lora.a.shape[0] for loras in adapter.modules.values() for lora in loras)
    adapter.configured_rank = min(adapter.configured_rank, most_rows)
    return adapter


def check_served_adapters(adapters: dict[str, str], max_lora_rank: Optional[int] = None) -> None:
    """The server's `--lora-modules` (name -> folder), each read and checked at start-up, as vLLM loads its
    adapters then: LoRAError naming the first missing or broken one, or one over `max_lora_rank`. What needs
    the model (an adapter of another model's shapes) is checked when a request runs it (a 400)."""
    for name, path in adapters.items():
        rank = read_adapter(name, path).configured_rank
        if max_lora_rank is not None and rank > max_lora_rank:
            raise _refuse(name, f"rank {rank} is over --max-lora-rank {max_lora_rank}")
