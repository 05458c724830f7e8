"""Ray Data: caption a dataset on a cluster, one vlmrun engine per actor.

The public face is `vlmrun.ray` (`VlmrunCaptioner`, `caption_dataset`; its docstring shows the
use); this module is the implementation, and also `run_ray_job`, which `vlmrun caption --ray`
runs: the driver expands and filters the inputs (resume), makes a dataset of their names, maps it
with `VlmrunCaptioner` and appends the results to the same crash-safe JSONL / Parquet output as
a local job, as they stream back.

Each actor builds one `Engine` and runs the streaming `CaptionPipeline` over every batch it is
given (decode on threads, continuous batching in the engine), returning one row per input row, in
order, with the caption record's columns (`vlmrun.jobs.records.RECORD_FIELDS`). Give it batches
of at least `max_num_seqs` images (`batch_size`) to keep its engine full.

The image column may hold paths or URLs (strings), encoded bytes (`read_binary_files`) or
decoded arrays (`read_images`); `key_column` (default "path" when the batch has one) names the
image in the record.

Ray is an optional extra (`pip install 'vlmrun[ray]'`): importing this module does not import it.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping, Optional

from vlmrun.default_model import resolve_model
from vlmrun.jobs.config import DEFAULT_MAX_TOKENS, DEFAULT_PREFETCH, DEFAULT_PROMPT, default_workers
from vlmrun.jobs.inputs import JobItem
from vlmrun.jobs.embed_records import EMBEDDING_SCHEMA, EmbeddingRecord
from vlmrun.jobs.records import CAPTION_SCHEMA, CaptionRecord, RecordSchema

if TYPE_CHECKING:
    from vlmrun.sampling_params import SamplingParams

_SOURCE_COLUMN = "source"


def import_ray() -> Any:
    """The `ray` module with Ray Data, or an ImportError saying how to install it."""
    try:
        import ray
        import ray.data  # noqa: F401
    except ImportError as exc:
        raise ImportError("Ray Data is not installed: pip install 'vlmrun[ray]' (or ray[data] and pyarrow)") from exc
    return ray


class VlmrunCaptioner:
    """A callable class for `Dataset.map_batches`: one engine per actor, one caption per row.

    model: checkpoint dir or hub id (default: the bundled shapes model).
    sampling: SamplingParams keywords (greedy unless given); engine_options: EngineConfig keywords.
    image_column: the column to caption; key_column: the column that names each image in the
    record (default: "path" if present, else the image column when it holds strings).
    model_name: what the records call the model (default: `model`).
    """

    schema: RecordSchema = CAPTION_SCHEMA  # the rows' columns (`VlmrunEmbedder`'s add the vector)

    def __init__(self, model: Optional[str] = None, *, prompt: str = DEFAULT_PROMPT,
                 max_tokens: int = DEFAULT_MAX_TOKENS, sampling: Optional[Mapping[str, Any]] = None,
                 engine_options: Optional[Mapping[str, Any]] = None, image_column: str = "image",
                 key_column: Optional[str] = None, workers: Optional[int] = None, prefetch: int = DEFAULT_PREFETCH,
                 model_name: Optional[str] = None):
        from vlmrun.config import EngineConfig
        from vlmrun.engine.engine import Engine
        from vlmrun.jobs.pipeline import PipelineOptions
        from vlmrun.sampling_params import SamplingParams

        model = resolve_model(model)
        params = SamplingParams(**{"temperature": 0.0, "max_tokens": max_tokens, **dict(sampling or {})})
        self.engine = Engine(EngineConfig(model=model, **{**dict(engine_options or {}), **self.engine_kind()}))
        self.pipeline = self.make_pipeline(self.engine, PipelineOptions(
            prompt=prompt, sampling=params, model_name=model_name or model, workers=workers or default_workers(),
            prefetch=prefetch))
        self.image_column = image_column
        self.key_column = key_column

    def engine_kind(self) -> dict[str, Any]:
        """EngineConfig keywords this mapper's engine must have (none: a generation engine)."""
        return {}

    def make_pipeline(self, engine: Any, options: Any) -> Any:
        from vlmrun.jobs.pipeline import CaptionPipeline

        return CaptionPipeline(engine, options)

    def __call__(self, batch: Mapping[str, Any]) -> dict[str, list]:
        sources = [_plain(v) for v in batch[self.image_column]]
        key_column = self.key_column or ("path" if "path" in batch else None)
        keys = [str(_plain(k)) for k in batch[key_column]] if key_column else \
            [s if isinstance(s, str) else f"{self.image_column}[{i}]" for i, s in enumerate(sources)]
        items = [JobItem(k, s) for k, s in zip(keys, sources)]
        position = {id(item): i for i, item in enumerate(items)}
        records: list[Optional[CaptionRecord]] = [None] * len(items)

        def on_record(item: JobItem, record: CaptionRecord) -> None:
            records[position[id(item)]] = record

        self.pipeline.run(items, on_record)
        assert all(r is not None for r in records), "the pipeline returned fewer records than rows"
        rows = [self.schema.row_of(r.to_dict()) for r in records]  # any JSON value as JSON text (one arrow type)
        return {name: [row[name] for row in rows] for name in self.schema.fields}


def _plain(value: Any) -> Any:
    """numpy scalars from a batch as Python str / bytes (arrays stay arrays: decoded images)."""
    import numpy as np

    if isinstance(value, np.str_):
        return str(value)
    if isinstance(value, np.bytes_):
        return bytes(value)
    return value


class VlmrunEmbedder(VlmrunCaptioner):
    """`VlmrunCaptioner` for embeddings: one pooling engine per actor, one vector per row (the `embedding`
    column; the others as the caption rows', `caption` null). pooling: `PoolingParams` keywords
    (dimensions, normalize); the other arguments as `VlmrunCaptioner`'s (sampling and max_tokens unused)."""

    schema = EMBEDDING_SCHEMA

    def __init__(self, model: Optional[str] = None, *, pooling: Optional[Mapping[str, Any]] = None, **kwargs: Any):
        from vlmrun.pooling.params import PoolingParams

        self.pooling = PoolingParams(**dict(pooling or {}))
        super().__init__(model, **{"prompt": "", **kwargs})

    def engine_kind(self) -> dict[str, Any]:
        return {"runner": "pooling"}

    def make_pipeline(self, engine: Any, options: Any) -> Any:
        from vlmrun.jobs.embed_pipeline import EmbedPipeline

        return EmbedPipeline(engine, options, self.pooling)


def caption_dataset(ds: Any, model: Optional[str] = None, *, concurrency: int = 1, num_gpus: float = 0,
                    num_cpus: float = 1, batch_size: int = 64, mapper: type = VlmrunCaptioner,
                    **captioner_kwargs: Any) -> Any:
    """`ds.map_batches(VlmrunCaptioner, ...)` (or `mapper`, e.g. `VlmrunEmbedder`): a pool of `concurrency`
    actors of `num_gpus` GPUs and `num_cpus` CPUs each, `batch_size` rows per call; other keywords go to
    the mapper."""
    ray = import_ray()
    return ds.map_batches(mapper, fn_constructor_kwargs={"model": model, **captioner_kwargs},
                          compute=ray.data.ActorPoolStrategy(size=concurrency), num_gpus=num_gpus, num_cpus=num_cpus,
                          batch_size=batch_size, batch_format="default")


def _ensure_ray(address: Optional[str]) -> Any:
    ray = import_ray()
    if not ray.is_initialized():
        kwargs: dict[str, Any] = {"address": address, "include_dashboard": False, "log_to_driver": True}
        if address is None:  # a local Ray: its workers import vlmrun from where this process does
            root = str(Path(os.path.abspath(__file__)).parents[2])  # the folder that holds the vlmrun package
            path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
            kwargs["runtime_env"] = {"env_vars": {"PYTHONPATH": path}}
        ray.init(**kwargs)
    context = ray.data.DataContext.get_current()
    context.enable_progress_bars = False  # vlmrun draws its own
    return ray


def _actor_layout(ray: Any, options: Any) -> tuple[int, float]:
    """(actors, GPUs per actor) from the options and the cluster's resources."""
    cluster_gpus = float(ray.cluster_resources().get("GPU", 0))
    gpus = options.gpus_per_actor if options.gpus_per_actor is not None else (1.0 if cluster_gpus else 0.0)
    actors = options.actors
    if actors is None:
        actors = max(1, int(cluster_gpus // gpus)) if gpus else 1
    return actors, gpus


def run_ray_job(config: Any, items: Iterator[JobItem], on_record: Callable[[JobItem, CaptionRecord], None],
                on_tick: Optional[Callable[[], None]] = None, on_start: Optional[Callable[[], None]] = None) -> None:
    """Caption `items` (already filtered for resume) on Ray; `on_record` gets each result on the
    driver as it streams back. Items known to be bad are recorded here without going to Ray.
    `on_start` is called once Ray is up, as the dataset starts (actors then load their engines).

    The driver holds the names of the images to caption (not the images) to build the dataset."""
    ray = _ensure_ray(config.ray.address)
    record_type = CaptionRecord if config.pooling is None else EmbeddingRecord  # `vlmrun embed --ray`
    rows = []
    columns_of: dict[str, dict[str, Any]] = {}  # manifest columns stay on the driver, joined back by key
    for item in items:
        if item.error is not None:
            on_record(item, record_type.failure(item.key, config.model, config.prompt, item.error))
        else:
            rows.append({"image": item.key, _SOURCE_COLUMN: str(item.source)})
            if item.columns:
                columns_of[item.key] = item.columns
    if not rows:
        return
    actors, gpus = _actor_layout(ray, config.ray)
    kind: dict[str, Any] = ({"sampling": _sampling_keywords(config.sampling)} if config.pooling is None else
                            {"mapper": VlmrunEmbedder, "pooling": dataclasses.asdict(config.pooling)})
    mapper = kind.get("mapper", VlmrunCaptioner)
    ds = caption_dataset(
        ray.data.from_items(rows), config.model, concurrency=actors, num_gpus=gpus,
        num_cpus=config.ray.cpus_per_actor, batch_size=config.ray.batch_size, prompt=config.prompt,
        engine_options=config.engine_options, image_column=_SOURCE_COLUMN, key_column="image",
        workers=config.workers, prefetch=config.prefetch, model_name=config.model, **kind)
    del rows
    if on_start is not None:
        on_start()
    for batch in ds.iter_batches(batch_format="pyarrow", batch_size=None):
        for row in batch.to_pylist():
            record = record_type(**mapper.schema.record_of(row))
            on_record(JobItem(record.image, None, columns=columns_of.get(record.image)), record)
        if on_tick is not None:
            on_tick()


def _sampling_keywords(params: SamplingParams) -> dict[str, Any]:
    """`params` as the keywords that rebuild it in a Ray actor: its constructor's fields only (fields
    the engine derives per request, such as the tokenized bad words, are made again there)."""
    return {f.name: getattr(params, f.name) for f in dataclasses.fields(params) if f.init}
