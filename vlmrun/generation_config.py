"""The checkpoint's sampling defaults, as vLLM reads them (`--generation-config`).

"auto" (the default): the model folder's `generation_config.json`; "vllm": none (SamplingParams'
own defaults); any other value: a folder holding a `generation_config.json`. Only what the file sets
to other than transformers' `GenerationConfig` defaults counts (`to_diff_dict`, as vLLM), and only
the sampling fields below; `max_new_tokens` becomes `max_tokens`. A request's own value always wins.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

# generation_config.json name -> SamplingParams field
SAMPLING_FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                   "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def read_sampling_defaults(generation_config: str, model_path: Path) -> dict[str, Any]:
    """SamplingParams field -> default, from the generation config `generation_config` names."""
    if generation_config == "vllm":
        return {}
    folder = Path(model_path) if generation_config == "auto" else Path(generation_config)
    if not (folder / "generation_config.json").is_file():
        if generation_config == "auto":
            return {}
        raise ValueError(f"generation_config={generation_config!r}: no generation_config.json in that folder "
                         "(expected 'auto', 'vllm' or a folder holding one)")
    from transformers import GenerationConfig

    settings = GenerationConfig.from_pretrained(folder).to_diff_dict()
    return {field: settings[name] for name, field in SAMPLING_FIELDS.items() if settings.get(name) is not None}
