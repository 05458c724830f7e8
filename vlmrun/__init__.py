"""vlmrun: a vision-language inference engine. Images and text in, tokens out.

The public names load lazily, so importing a submodule (`import vlmrun.config`, ...) stays light.
"""

from typing import Any

__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "RequestOutput", "CompletionOutput", "generate",
           "LoRARequest", "BeamSearchParams"]


def __getattr__(name: str) -> Any:
    if name == "SamplingParams":
        from vlmrun.sampling_params import SamplingParams

        return SamplingParams
    if name == "StructuredOutputsParams":
        from vlmrun.structured import StructuredOutputsParams

        return StructuredOutputsParams
    if name == "LoRARequest":
        from vlmrun.lora.request import LoRARequest

        return LoRARequest
    if name in ("LLM", "RequestOutput", "CompletionOutput", "generate", "BeamSearchParams"):
        from vlmrun import api

        return getattr(api, name)
    raise AttributeError(f"module 'vlmrun' has no attribute {name!r}")
