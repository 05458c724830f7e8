"""`SamplingParams.truncate_prompt_tokens` (vLLM's): a prompt cut to its last k tokens.

-1 keeps the last `max_model_len` tokens. The cut may not fall before an image or video: its pad
tokens and their positions go together, so such a cut is refused with a ValueError naming the field.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from vlmrun.processors import ProcessedPrompt
from vlmrun.sampling_params import SamplingParamError


def truncate_prompt(prompt: ProcessedPrompt, keep: Optional[int], max_model_len: int) -> ProcessedPrompt:
    """`prompt` without all but its last `keep` tokens (-1: `max_model_len`); itself when it is no longer."""
    if keep is None:
        return prompt
    keep = max_model_len if keep == -1 else keep
    cut = len(prompt.token_ids) - keep
    if cut <= 0:
        return prompt
    if any(item.offset < cut for item in prompt.mm_items):
        raise SamplingParamError("truncate_prompt_tokens", f"truncate_prompt_tokens={keep} would cut the prompt "
                                                           f"before an image or video (it keeps only whole media)")
    items = [dataclasses.replace(item, offset=item.offset - cut) for item in prompt.mm_items]
    return dataclasses.replace(prompt, token_ids=prompt.token_ids[cut:], mm_items=items)
