"""The driver's check of a LoRA adapter under tensor parallelism, where the model lives in the ranks.

`LoRAChecker.check(request)` reads the adapter and lays it out for the whole model built on the meta
device (every layer's shape, no weights), so an adapter the ranks could not load fails its request in
the driver with the error a single device gives (`vlmrun.lora.mapping.map_adapter`); the ranks then
read it themselves and keep their slices.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from vlmrun.config import EngineConfig, ModelConfig
from vlmrun.loader import checkpoint_tensor_names
from vlmrun.lora.mapping import map_adapter
from vlmrun.lora.peft_files import read_adapter
from vlmrun.lora.request import LoRARequest
from vlmrun.models.registry import build_for_checkpoint


class LoRAChecker:
    def __init__(self, config: EngineConfig, model_config: ModelConfig):
        self.max_rank = config.max_lora_rank
        self.model_config = model_config
        self.checked: set[LoRARequest] = set()
        self._model: Optional[nn.Module] = None

    def check(self, request: LoRARequest) -> None:
        """LoRAError naming the adapter when it cannot run on this model; each adapter is checked once."""
        if request in self.checked:
            return
        if self._model is None:  # the whole model's shapes, no storage
            mc = self.model_config
            names = checkpoint_tensor_names(mc.path) if mc.quantization is not None else ()
            self._model = build_for_checkpoint(mc, torch.device("meta"), names)
        map_adapter(self._model, read_adapter(request.lora_name, request.lora_path), self.max_rank, torch.float32)
        self.checked.add(request)
