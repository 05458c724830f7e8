"""The engine's runner kind (vLLM's `runner`: "generate" | "pooling") and what it lets a request ask.

`PoolingMode` is what the engine holds: the runner kind and, for pooling, the checkpoint's
`PoolerConfig`. `admit(params)` checks a request against it: generation params on a pooling engine,
or pooling params on a generation engine, are a ValueError saying how to start the right one; a
pooling request gets its `PoolingState` and the sampling params the engine's bookkeeping runs with
(prefill-only: nothing is ever sampled from them).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Optional, Union

from vlmrun.pooling.config import PoolerConfig, read_pooler_config
from vlmrun.pooling.params import PoolingParams
from vlmrun.pooling.pooler import PoolingState
from vlmrun.sampling_params import SamplingParams

RUNNERS = ("generate", "pooling")
# vLLM's older task= names -> the runner
TASK_RUNNERS = {"generate": "generate", "embed": "pooling", "encode": "pooling", "embedding": "pooling"}


def runner_for(runner: str, task: Optional[str] = None) -> str:
    """The runner kind from vLLM's `runner` or its older `task` alias ("embed" -> "pooling")."""
    if task is not None:
        if task not in TASK_RUNNERS:
            raise ValueError(f"task must be one of {', '.join(TASK_RUNNERS)}, got {task!r}")
        if runner not in ("generate", TASK_RUNNERS[task]):
            raise ValueError(f"task={task!r} contradicts runner={runner!r}")
        return TASK_RUNNERS[task]
    if runner not in RUNNERS:
        raise ValueError(f"runner must be one of {', '.join(RUNNERS)}, got {runner!r}")
    return runner


class WrongRunner(ValueError):
    """A request of the other kind: generation on a pooling engine, or pooling on a generation engine."""


GENERATE_ON_POOLING = ("this engine was started for embeddings (runner='pooling'): it computes no text; "
                       "start one with runner='generate' (vlmrun serve without --runner pooling) to generate")
POOLING_ON_GENERATE = ("this engine was started for generation (runner='generate'); embeddings need one started "
                       "with runner='pooling' (LLM(model, runner='pooling'); vlmrun serve --runner pooling)")


@dataclass(frozen=True)
class PoolingMode:
    runner: str  # "generate" | "pooling"
    config: Optional[PoolerConfig] = None  # the checkpoint's pooling (runner "pooling" only)

    @classmethod
    def of(cls, runner: str, path: Path, hf_config: Any, hidden_size: int,
           overrides: Optional[Mapping[str, Any]] = None) -> "PoolingMode":
        if runner != "pooling":
            if overrides:
                raise ValueError("pooler_config is for runner='pooling'")
            return cls(runner)
        return cls(runner, read_pooler_config(path, hf_config, hidden_size, overrides))

    @property
    def pools(self) -> bool:
        return self.runner == "pooling"

    def check_call(self, pools: bool) -> None:
        """A call that pools (`LLM.embed`) or generates on this engine: WrongRunner when it is the other kind."""
        if pools != self.pools:
            raise WrongRunner(GENERATE_ON_POOLING if self.pools else POOLING_ON_GENERATE)

    def admit(self, params: Union[SamplingParams, PoolingParams]) -> tuple[SamplingParams, Optional[PoolingState]]:
        """The sampling params to run with and, for a pooling request, its state; WrongRunner for the other kind."""
        if isinstance(params, PoolingParams):
            if not self.pools:
                raise WrongRunner(POOLING_ON_GENERATE)
            state = PoolingState(params.resolve(self.config))
            return SamplingParams(max_tokens=1, truncate_prompt_tokens=params.truncate_prompt_tokens), state
        if self.pools:
            raise WrongRunner(GENERATE_ON_POOLING)
        return params, None
