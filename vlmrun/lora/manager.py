"""`LoRAManager`: a model's adapters in a fixed number of slots, LRU eviction, and each step's rows bound.

`add(request)` reads an adapter (PEFT folder), checks it against the model and keeps its laid-out
tensors on the host (up to `max_cpu_loras`, least recently used dropped first): the engine calls it
when a request arrives, so disk reads and checks stay off the step loop, and a bad adapter fails
that request alone. `activate(requests)` gives each adapter of a step a slot: the one it holds, a
free one, or the least recently used one no row of this step needs; it writes the adapter's tensors
there (a host-to-device copy per adapted layer). `bind(slots, lengths)` sets the rows' slots on the
`LoRAContext` the adapted layers read during the forward; as the model's forward starts, the bound
batch is padded once to its rows (a padded decode picks its bucket after `bind`, inside the runner's
forward; the rows past the bound ones run no adapter).

The engine's options are checked by `EngineConfig`; the manager checks only what needs the device.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from typing import Optional, Sequence

import torch
from torch import nn

from vlmrun.lora.layers import NO_ADAPTER, PROJECTIONS, ExpertsLoRA, LoRABatch, LoRAContext, attach_lora
from vlmrun.lora.mapping import MappedAdapter, map_adapter
from vlmrun.lora.peft_files import MAX_LORA_RANK, LoRAError, read_adapter
from vlmrun.lora.request import LoRARequest

logger = logging.getLogger(__name__)


class LoRAManager:
    def __init__(self, model: nn.Module, max_loras: int, max_lora_rank: int, device: torch.device,
                 dtype: torch.dtype, max_cpu_loras: Optional[int] = None, kernel: str = "torch"):
        if kernel == "triton" and torch.device(device).type != "cuda":
            raise ValueError(f"lora_kernel='triton' runs a Triton kernel on a CUDA device; this engine runs on "
                             f"{device} (use lora_kernel='torch')")
        if not 1 <= max_lora_rank <= MAX_LORA_RANK:  # slots are sized by it: refused before any is made
            raise ValueError(f"max_lora_rank must be from 1 to {MAX_LORA_RANK}, got {max_lora_rank}")
        self.kernel = kernel  # mixed-adapter batches: "torch" (masked matmuls) or "triton" (lora/triton_ops.py)
        self.model = model
        self.max_loras = max_loras
        self.max_lora_rank = max_lora_rank
        self.max_cpu_loras = max(max_cpu_loras or max_loras, max_loras)
        self.device = device
        self.dtype = dtype
        self.context = LoRAContext()
        self.targets = attach_lora(model, self.context, max_loras, max_lora_rank, device, dtype)
        self.loaded: OrderedDict[int, tuple[LoRARequest, MappedAdapter]] = OrderedDict()  # host copies, LRU order
        # ids added for a request and not yet put in a slot by a step: their host copies are kept, so a
        # step never reads an adapter from disk
        self.pending: set[int] = set()
        self.slot_of: OrderedDict[int, int] = OrderedDict()  # adapter id -> slot, LRU order
        self.vision_of: dict[int, int] = {}  # slot -> id of its adapter when that adapts the vision tower
        self._lock = threading.Lock()
        model.register_forward_pre_hook(self._pad_to_forward)

    # ------------------------------------------------------------------ loading

    def add(self, request: LoRARequest) -> MappedAdapter:
        """The adapter read, checked and laid out for this model (cached by id); LoRAError naming it if bad."""
        with self._lock:  # the engine's thread adds while a step's thread activates (async scheduling)
            return self._add(request)

    def _add(self, request: LoRARequest) -> MappedAdapter:
        held = self.loaded.get(request.lora_int_id)
        if held is not None:
            if (held[0].lora_name, held[0].lora_path) != (request.lora_name, request.lora_path):
                raise LoRAError(f"LoRA adapter {request.lora_name!r}: lora_int_id {request.lora_int_id} is already "
                                f"adapter {held[0].lora_name!r} ({held[0].lora_path})")
            self.loaded.move_to_end(request.lora_int_id)
            self.pending.add(request.lora_int_id)
            return held[1]
        mapped = map_adapter(self.model, read_adapter(request.lora_name, request.lora_path), self.max_lora_rank,
                             self.dtype)
        self.loaded[request.lora_int_id] = (request, mapped)
        self.pending.add(request.lora_int_id)
        if len(self.loaded) > self.max_cpu_loras:  # drop the least recently used host copy no step waits for
            victim = next((i for i in self.loaded if i not in self.pending), None)  # (a slot keeps its own)
            if victim is not None:
                del self.loaded[victim]
        logger.info("LoRA adapter %r (id %d, rank %d) loaded from %s", request.lora_name, request.lora_int_id,
                    mapped.rank, request.lora_path)
        return mapped

    def cache_tag(self, slot: int) -> str:
        """The encoder-cache tag of the adapter in `slot`: its own when it changes the vision tower, else ""."""
        adapter_id = self.vision_of.get(slot)
        return "" if adapter_id is None else f"@lora{adapter_id}"

    # ------------------------------------------------------------------ slots

    def activate(self, requests: Sequence[Optional[LoRARequest]]) -> list[int]:
        """A slot for each distinct adapter of a step (NO_ADAPTER for None), written where needed."""
        wanted = {r.lora_int_id: r for r in requests if r is not None}
        if len(wanted) > self.max_loras:
            raise RuntimeError(f"a step needs {len(wanted)} adapters but there are max_loras={self.max_loras} slots")
        for adapter_id, request in wanted.items():
            if adapter_id in self.slot_of:
                self.slot_of.move_to_end(adapter_id)
                continue
            self._write(self._free_slot(set(wanted)), request)
        with self._lock:
            self.pending.difference_update(wanted)
        return [NO_ADAPTER if r is None else self.slot_of[r.lora_int_id] for r in requests]

    def _free_slot(self, needed: set[int]) -> int:
        used = set(self.slot_of.values())
        free = [s for s in range(self.max_loras) if s not in used]
        if free:
            return free[0]
        victim = next(i for i in self.slot_of if i not in needed)  # least recently used first
        return self.slot_of.pop(victim)

    def _write(self, slot: int, request: LoRARequest) -> None:
        mapped = self.add(request)
        for name, target in self.targets.items():
            if isinstance(target, ExpertsLoRA):
                pairs = mapped.experts.get(name, {})
                for projection in PROJECTIONS:
                    target.write(slot, projection, *pairs.get(projection, (None, None)))
            else:
                a, b = mapped.linear.get(name, (None, None))
                target.write(slot, a, b)
        self.slot_of[request.lora_int_id] = slot
        if mapped.vision:
            self.vision_of[slot] = request.lora_int_id
        else:
            self.vision_of.pop(slot, None)

    # ------------------------------------------------------------------ one forward

    def bind(self, slots: Sequence[int], lengths: Sequence[int]) -> None:
        """The next forward's rows: spans of `lengths[i]` rows running slot `slots[i]`."""
        self.context.batch = LoRABatch.of_spans(slots, lengths, self.max_loras, self.device, self.dtype, self.kernel)

    def _pad_to_forward(self, model: nn.Module, args: tuple) -> None:
        """The model's forward pre-hook: the bound batch covers the forward's rows (`args[0]`: its input ids
        [num_rows]), padded once here rather than by each layer."""
        if self.context.batch is not None:
            self.context.batch = self.context.batch.padded_to(args[0].shape[0])
