"""The embedding job's pipeline: the caption pipeline with a pooling request per image.

Everything but the request and the record is `CaptionPipeline`'s (the input pipeline, worker
threads, bad inputs as error records): each image's prompt (the same user turn: the image, then the
`--prompt` text, through the chat template) runs as a pooling request with the job's
`PoolingParams`, on an engine started with runner="pooling", and its record carries the vector.
"""

from __future__ import annotations

from typing import Any, Iterable, Iterator

from vlmrun.feed.pipeline import Finished, Work
from vlmrun.jobs.embed_records import EmbeddingRecord
from vlmrun.jobs.inputs import JobItem
from vlmrun.jobs.pipeline import CaptionPipeline, PipelineOptions
from vlmrun.pooling.params import PoolingParams


class EmbedPipeline(CaptionPipeline):
    """Embeds a stream of `JobItem`s on one pooling `Engine`; `run` as `CaptionPipeline.run`."""

    def __init__(self, engine: Any, options: PipelineOptions, pooling: PoolingParams):
        pooling.resolve(engine.pooling.config)  # a bad --dimensions ends the job before it starts (ValueError)
        super().__init__(engine, options)
        self.pooling = pooling

    def _works(self, items: Iterable[JobItem]) -> Iterator[Work]:
        for item in items:
            yield Work(f"embed-{next(self._ids)}", item, [self.pooling], self.options.lora)

    def _record(self, finished: Finished) -> EmbeddingRecord:
        opts = self.options
        item: JobItem = finished.work.source
        preprocess_s = 0.0 if item.error is not None else finished.preprocess_s
        result = finished.results[0]
        if finished.error is not None or result is None or result.pooled is None:
            error = finished.error if finished.error is not None else "the engine dropped the request"
            return EmbeddingRecord.failure(item.key, opts.model_name, opts.prompt, error, preprocess_s)
        return EmbeddingRecord(image=item.key, caption=None, num_tokens=result.num_prompt_tokens,
                               model=opts.model_name, prompt=opts.prompt, error=None, finish_reason="stop",
                               preprocess_s=round(preprocess_s, 6), generate_s=round(finished.generate_s, 6),
                               embedding=result.pooled.tolist())
