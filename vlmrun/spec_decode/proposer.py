"""The engine's draft proposer for its `speculative_config`, after checking the engine can verify drafts.

Refused with a ValueError naming the reason: hybrid (Gated DeltaNet) models, whose recurrent state a
verify pass would advance past the rejected drafts; tensor parallelism (not checked yet).
"""

from __future__ import annotations

from typing import Optional

from vlmrun.config import CacheShape, EngineConfig, ModelConfig
from vlmrun.spec_decode.ngram import NgramProposer


def build_proposer(config: EngineConfig, model_config: ModelConfig) -> Optional[NgramProposer]:
    spec = config.speculative_config
    if spec is None:
        return None
    if CacheShape.from_hf_config(model_config.hf_config).is_hybrid:
        raise ValueError(f"speculative decoding does not serve hybrid (Gated DeltaNet) models yet "
                         f"({model_config.architecture}): a verify pass would leave their recurrent state past "
                         f"the rejected drafts")
    if config.tensor_parallel_size > 1:
        raise ValueError("speculative decoding under tensor parallelism is not supported yet")
    return NgramProposer(spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max)
