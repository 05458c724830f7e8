"""How a checkpoint pools: `PoolerConfig`, read as vLLM and sentence-transformers read it.

sentence-transformers describes a model as a list of modules (`modules.json`); a
`sentence_transformers.models.Pooling` module's folder holds `config.json` with one
`pooling_mode_*` flag set (lasttoken / mean_tokens / cls_token), and a
`sentence_transformers.models.Normalize` module means the embedding is L2-normalized.
`config_sentence_transformers.json` marks a sentence-transformers checkpoint. Without those files the
defaults are vLLM's for a decoder used as an embedding model: LAST pooling, normalized. Matryoshka:
the HF config's `is_matryoshka` / `matryoshka_dimensions` (as vLLM reads them); the engine's
`pooler_config` (vLLM's `--pooler-config`) overrides any of it.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Optional

POOLING_TYPES = ("LAST", "MEAN", "CLS")
_ST_POOLING = "sentence_transformers.models.Pooling"
_ST_NORMALIZE = "sentence_transformers.models.Normalize"
# sentence-transformers' Pooling flags -> vLLM's pooling types (the first set flag wins, in this order)
_ST_MODES = {"pooling_mode_lasttoken": "LAST", "pooling_mode_mean_tokens": "MEAN", "pooling_mode_cls_token": "CLS"}


@dataclass(frozen=True)
class PoolerConfig:
    """What a pooling request gets when its `PoolingParams` leave it open."""

    pooling_type: str = "LAST"  # LAST | MEAN | CLS
    normalize: bool = True  # L2-normalize the embedding (after any Matryoshka truncation)
    hidden_size: int = 0  # the model's hidden size: the full embedding's length
    is_matryoshka: bool = False  # the checkpoint says its embeddings may be truncated (Matryoshka)
    matryoshka_dimensions: Optional[tuple[int, ...]] = None  # the only sizes it allows; None: any up to hidden_size
    source: str = "defaults"  # where it was read from (for the log line and errors)

    def __post_init__(self) -> None:
        if self.pooling_type not in POOLING_TYPES:
            raise ValueError(f"pooling_type must be one of {', '.join(POOLING_TYPES)}, got {self.pooling_type!r}")

    def overridden(self, overrides: Optional[Mapping[str, Any]]) -> "PoolerConfig":
        """This config with the engine's `pooler_config` keys (vLLM's names: pooling_type, normalize)."""
        if not overrides:
            return self
        unknown = set(overrides) - {"pooling_type", "normalize"}
        if unknown:
            raise ValueError(f"pooler_config: unknown keys {sorted(unknown)} (known: pooling_type, normalize)")
        fields = dict(overrides)
        if "pooling_type" in fields:
            fields["pooling_type"] = str(fields["pooling_type"]).upper()
        return dataclasses.replace(self, **fields, source=f"{self.source} + pooler_config")


def read_pooler_config(path: Path, hf_config: Any, hidden_size: int,
                       overrides: Optional[Mapping[str, Any]] = None) -> PoolerConfig:
    """The checkpoint's pooling (sentence-transformers files, else vLLM's defaults), then `overrides`."""
    path = Path(path)
    dims = getattr(hf_config, "matryoshka_dimensions", None)
    matryoshka = bool(getattr(hf_config, "is_matryoshka", False)) or bool(dims)
    base = PoolerConfig(hidden_size=hidden_size, is_matryoshka=matryoshka,
                        matryoshka_dimensions=tuple(int(d) for d in dims) if dims else None)
    modules = _read_json(path / "modules.json")
    if isinstance(modules, list):
        base = _from_modules(path, modules, base)
    elif (path / "config_sentence_transformers.json").is_file():
        base = dataclasses.replace(base, source="config_sentence_transformers.json (no modules.json: defaults)")
    return base.overridden(overrides)


def _from_modules(path: Path, modules: list, base: PoolerConfig) -> PoolerConfig:
    types = {m.get("type"): m for m in modules if isinstance(m, dict)}
    fields: dict[str, Any] = {"normalize": _ST_NORMALIZE in types, "source": "modules.json"}
    pooling = types.get(_ST_POOLING)
    if pooling is not None:
        config = _read_json(path / str(pooling.get("path", "")) / "config.json") or {}
        mode = next((kind for flag, kind in _ST_MODES.items() if config.get(flag)), None)
        if mode is None:
            set_flags = sorted(k for k, v in config.items() if k.startswith("pooling_mode") and v)
            raise ValueError(f"{path}: the sentence-transformers pooling {set_flags or 'config'} is not supported "
                             f"(supported: {', '.join(_ST_MODES)})")
        fields["pooling_type"] = mode
    return dataclasses.replace(base, **fields)


def _read_json(path: Path) -> Any:
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read {path}: {e}") from e
