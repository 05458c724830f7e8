"""`LoRARequest`: which adapter a request runs with (vLLM's class: name, integer id, folder)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


@dataclass(frozen=True)
class LoRARequest:
    """An adapter by name, a positive integer id (unique per adapter) and the PEFT folder it is read from.

    Two requests with the same id name the same adapter: it is read once and shares its slot."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: Optional[str] = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"LoRA adapter {self.lora_name!r}: lora_int_id must be a positive integer, "
                             f"got {self.lora_int_id!r}")
        if not self.lora_path:
            raise ValueError(f"LoRA adapter {self.lora_name!r}: lora_path is empty")

    # vLLM's LoRARequest reads its fields under these names too; a vLLM script may use them (vlmrun does not)
    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path


def cache_salt(request: Optional[LoRARequest]) -> bytes:
    """What keys an adapter's prefix-cache entries apart from the base model's (b"" for the base model)."""
    return b"" if request is None else f"lora:{request.lora_int_id}:{request.lora_name}".encode()
