"""vlmrun: a vision-language inference engine. Images and text in, tokens out.

The public names load lazily, so importing a submodule (`import vlmrun.config`, ...) stays light.
"""

from typing import Any

__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "RequestOutput", "CompletionOutput", "generate",
           "LoRARequest", "PoolingParams", "EmbeddingRequestOutput", "PoolingRequestOutput", "BeamSearchParams"]


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
    if name == "PoolingParams":
        from vlmrun.pooling.params import PoolingParams

        return PoolingParams
    if name in ("EmbeddingRequestOutput", "PoolingRequestOutput"):
        from vlmrun.pooling import outputs

        return getattr(outputs, name)
    if name in ("LLM", "RequestOutput", "CompletionOutput", "generate", "BeamSearchParams"):
        from vlmrun import api

        return getattr(api, name)
    raise AttributeError(f"module 'vlmrun' has no attribute {name!r}")
