"""The engine's draft proposer for its `speculative_config` (None: the engine does not speculate).

What cannot verify drafts is refused where it is known: async scheduling and tensor parallelism by
`EngineConfig`, a GDN backend that keeps no per-position states by `build_model_runner`.
"""

from __future__ import annotations

from typing import Optional

from vlmrun.config import EngineConfig
from vlmrun.spec_decode.ngram import NgramProposer


def build_proposer(config: EngineConfig) -> Optional[NgramProposer]:
    spec = config.speculative_config
    if spec is None:
        return None
    return NgramProposer(spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max)
