"""vLLM's `LLM(...)` keywords that are not `EngineConfig` fields: honoured, accepted with a log line, or refused.

A script written for vLLM passes keywords such as `trust_remote_code=True`, `tokenizer=MODEL`,
`swap_space=0` or `disable_log_stats=False`. `engine_kwargs` sorts them before `EngineConfig` sees the
rest (an unknown name stays a TypeError there):

- renamed: `block_size` is `page_size`; `override_pooler_config` (vLLM's older name) is `pooler_config`;
- accepted, meaningless here, said once in the log (`NO_EFFECT`): e.g. `trust_remote_code` (vlmrun runs
  only its own model code), `swap_space`, `disable_custom_all_reduce`, `compilation_config`;
- accepted only at the value that means what vlmrun does (`ONLY_DEFAULT`): e.g. `tokenizer_mode="auto"`,
  `cpu_offload_gb=0`; another value is a ValueError saying why and what to use;
- `tokenizer` / `tokenizer_revision`: the checkpoint's own (vlmrun reads its tokenizer with the
  processor): None or the model's path / revision, else a ValueError;
- `seed` None (vLLM's "no seed") is vlmrun's default seed 0; `max_logprobs` at most 20 (vLLM's default,
  `MAX_LOGPROBS`); `disable_log_stats` is kept for `LLM.get_metrics` (vlmrun's `LLM` logs no periodic stats).
"""

from __future__ import annotations

import logging
import os
from typing import Any, Optional

from vlmrun.sampling_params import MAX_LOGPROBS

logger = logging.getLogger(__name__)

# vLLM keyword -> why it changes nothing here (the log line)
NO_EFFECT: dict[str, str] = {
    "trust_remote_code": "vlmrun runs only its own model code (no checkpoint code is imported)",
    "swap_space": "preempted requests are recomputed, never swapped to CPU memory",
    "disable_custom_all_reduce": "tensor parallelism uses torch.distributed's all-reduce",
    "compilation_config": "vlmrun does not use torch.compile (CUDA graphs follow enforce_eager)",
    "max_seq_len_to_capture": "CUDA graphs are captured for decode batches; prefill runs eager",
    "disable_async_output_proc": "outputs are handed out by the step that finishes them",
    "allowed_local_media_path": "LLM reads local media paths given in its own inputs",
    "hf_token": "checkpoints are read from a local folder or the Hugging Face cache (set HF_TOKEN to download)",
    "enable_chunked_prefill": "chunked prefill is always on (max_num_batched_tokens bounds a step)",
    "disable_log_stats": "LLM logs no periodic stats; LLM.get_metrics works either way",
    "max_num_partial_prefills": "the scheduler chunks every prefill within max_num_batched_tokens",
    "disable_mm_preprocessor_cache": "vlmrun keeps vision embeddings by content hash (encoder_cache_tokens)",
    "mm_processor_cache_gb": "vlmrun keeps vision embeddings by content hash (encoder_cache_tokens)",
}

# vLLM keyword -> (the values that mean what vlmrun does, what to do instead)
ONLY_DEFAULT: dict[str, tuple[tuple[Any, ...], str]] = {
    "tokenizer_mode": (("auto", "hf"), "vlmrun uses the checkpoint's fast tokenizer"),
    "skip_tokenizer_init": ((False,), "vlmrun needs the tokenizer for its processor and detokenizer"),
    "cpu_offload_gb": ((0, 0.0), "vlmrun keeps the weights on the device (use quantization='fp8' to halve them)"),
    "hf_overrides": ((None, {}), "vlmrun reads the checkpoint's config.json as it is"),
    "pipeline_parallel_size": ((1,), "use tensor_parallel_size"),
    "data_parallel_size": ((1,), "run one LLM per device"),
    "load_format": (("auto", "safetensors"), "vlmrun loads safetensors checkpoints"),
    "logprobs_mode": (("raw_logprobs",), "vlmrun returns raw logprobs (before temperature and penalties)"),
}


def engine_kwargs(model: Optional[str], revision: Optional[str], kwargs: dict[str, Any],
                  config_fields: set[str]) -> dict[str, Any]:
    """`kwargs` with vLLM's non-EngineConfig keywords sorted out (see the module docstring); what remains
    goes to EngineConfig. A keyword that is an EngineConfig field (in `config_fields`) always passes."""
    out = dict(kwargs)
    if "block_size" in out and "block_size" not in config_fields:
        out["page_size"] = out.pop("block_size")
    if "override_pooler_config" in out and "override_pooler_config" not in config_fields:
        out["pooler_config"] = out.pop("override_pooler_config")
    for name in [n for n in out if n not in config_fields]:
        if name in NO_EFFECT:
            value = out.pop(name)
            logger.warning("LLM(%s=%r) is accepted and changes nothing: %s", name, value, NO_EFFECT[name])
        elif name in ONLY_DEFAULT:
            value = out.pop(name)
            allowed, instead = ONLY_DEFAULT[name]
            if value not in allowed:
                raise ValueError(f"LLM({name}={value!r}) is not supported: {instead} "
                                 f"(accepted: {', '.join(map(repr, allowed))})")
    _own_tokenizer(out, model, "tokenizer", "the model's own folder")
    _own_tokenizer(out, revision, "tokenizer_revision", "the model's revision")
    if "seed" in out and out["seed"] is None and "seed" in config_fields:
        out["seed"] = 0  # vLLM's None: no seed; the engine starts from its default
    if "max_logprobs" in out and "max_logprobs" not in config_fields:
        value = out.pop("max_logprobs")
        if not isinstance(value, int) or value > MAX_LOGPROBS or value < -1:
            raise ValueError(f"LLM(max_logprobs={value!r}) is not supported: vlmrun returns at most {MAX_LOGPROBS} "
                             "logprobs per token (vLLM's default)")
    return out


def _own_tokenizer(kwargs: dict[str, Any], own: Optional[str], name: str, what: str) -> None:
    """Pop `name` when it is None or `own`; else a ValueError (vlmrun reads the checkpoint's tokenizer)."""
    if name not in kwargs:
        return
    value = kwargs.pop(name)
    if value is not None and os.path.normpath(str(value)) != os.path.normpath(str(own)):
        raise ValueError(f"LLM({name}={value!r}) is not supported: vlmrun loads the tokenizer with the "
                         f"checkpoint's processor; pass {name}=None or {what} ({own!r})")
