"""The settings of a caption job, and the one place its defaults live.

Without `--model` a job runs the bundled default model (`vlmrun.default_model.resolve_model`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from vlmrun.pooling.params import PoolingParams
from vlmrun.sampling_params import SamplingParams

DEFAULT_PROMPT = "Describe the image."
DEFAULT_MAX_TOKENS = 64
DEFAULT_PREFETCH = 64
MAX_DEFAULT_WORKERS = 8


def default_workers() -> int:
    """Preprocessing threads: the CPUs this process may use (affinity, cgroup quota), at most 8."""
    from vlmrun.feed.workers import preprocess_workers

    return preprocess_workers(MAX_DEFAULT_WORKERS)


@dataclass
class RayOptions:
    """How `--ray` spreads the job: `actors` engines (None: one per `gpus_per_actor` GPUs of the
    cluster, or one without GPUs), each with `gpus_per_actor` GPUs (None: 1 if the cluster has
    GPUs, else 0) and `cpus_per_actor` CPUs, fed `batch_size` images per call."""

    address: Optional[str] = None  # None: start a local Ray; "auto" or ray://host:port: join a cluster
    actors: Optional[int] = None
    gpus_per_actor: Optional[float] = None
    cpus_per_actor: float = 1.0
    batch_size: int = 64


@dataclass
class CaptionJobConfig:
    """Everything `vlmrun caption` was asked to do.

    out: JSONL / Parquet path, or None to print one line per image.
    engine_options: EngineConfig keywords (dtype, device, max_num_seqs, ...).
    resume: skip images already in `out` (the default); overwrite: start `out` afresh;
    retry_errors: on resume, caption again the images whose record is an error.
    """

    inputs: list[str]
    model: str
    out: Optional[str] = None
    prompt: str = DEFAULT_PROMPT
    sampling: SamplingParams = field(default_factory=lambda: SamplingParams(temperature=0.0,
                                                                            max_tokens=DEFAULT_MAX_TOKENS))
    engine_options: dict[str, Any] = field(default_factory=dict)
    workers: int = field(default_factory=default_workers)
    prefetch: int = DEFAULT_PREFETCH
    overwrite: bool = False
    retry_errors: bool = False
    image_column: Optional[str] = None
    fsync_interval: float = 1.0
    progress: bool = True
    ray: Optional[RayOptions] = None
    lora: Optional[str] = None  # a LoRA adapter (PEFT folder) every caption runs with (not with Ray yet)
    # `vlmrun embed`: embed each image instead (an engine with runner="pooling"; records carry `embedding`)
    pooling: Optional[PoolingParams] = None
