"""The engine's draft proposer for its `speculative_config` (None: the engine does not speculate).

"ngram": `NgramProposer`, drafts made on the host. "mtp": `MTPDraftSlots`, which only reserves the
drafts' places: the model runner drafts on the device with the checkpoint's MTP layer right before the
verify pass (`vlmrun/executor/mtp_drafter.py`), and a placeholder stands for each draft until then. What
cannot verify drafts is refused where it is known: a GDN backend that keeps no per-position states
and a checkpoint without an MTP layer by `build_local_executor` / `build_model_runner`. Under async
scheduling n-gram drafts are looked up once the request's last token is on the host; MTP drafts
follow a placeholder for it (`Scheduler.must_wait`). `disable_by_batch_size` is the scheduler's: it
applies it when a request is added (`Request.speculates`).
"""

from __future__ import annotations

from typing import Hashable, Optional, Sequence, Union

from vlmrun.config import EngineConfig
from vlmrun.forward_batch import PLACEHOLDER_TOKEN
from vlmrun.spec_decode.ngram import NgramProposer


class MTPDraftSlots:
    """Placeholders for up to k drafts the MTP layer makes on the device. `drafts_grammar_rows`: whether a
    request with a grammar gets them: the masks after the drafts are made where the matcher is, in the
    engine's process, so not under tensor parallelism (the drafts are made in the ranks)."""

    drafts_on_device = True

    def __init__(self, num_speculative_tokens: int, drafts_grammar_rows: bool = True):
        self.k = num_speculative_tokens
        self.drafts_grammar_rows = drafts_grammar_rows

    def propose(self, token_ids: Sequence[int], max_drafts: int, key: Optional[Hashable] = None) -> list[int]:
        return [PLACEHOLDER_TOKEN] * max(0, min(self.k, max_drafts))

    def forget(self, key: Hashable) -> None:
        """Nothing is kept per request."""


Proposer = Union[NgramProposer, MTPDraftSlots]


def build_proposer(config: EngineConfig) -> Optional[Proposer]:
    spec = config.speculative_config
    if spec is None:
        return None
    if spec.method == "mtp":
        return MTPDraftSlots(spec.num_speculative_tokens, drafts_grammar_rows=config.tensor_parallel_size == 1)
    return NgramProposer(spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max)
