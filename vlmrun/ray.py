"""Ray Data: caption a dataset on a cluster, one vlmrun engine per actor.

    import ray
    from vlmrun.ray import VlmrunCaptioner

    ds = ray.data.read_parquet("s3://bucket/manifest.parquet")          # a column "image": paths / URLs
    out = ds.map_batches(VlmrunCaptioner, fn_constructor_kwargs={"model": "Qwen/Qwen3-VL-2B-Instruct",
                                                                  "max_tokens": 64},
                         compute=ray.data.ActorPoolStrategy(size=8), num_gpus=1, batch_size=128)
    # (Ray < 2.51: concurrency=8 instead of compute=...); or: caption_dataset(ds, model, concurrency=8, ...)
    out.write_parquet("s3://bucket/captions/")

Embeddings: `VlmrunEmbedder` (one pooling engine per actor; fn_constructor_kwargs {"model": ...,
"pooling": {"dimensions": 256}}) adds an `embedding` column; `caption_dataset(ds, model, mapper=VlmrunEmbedder)`.

This module is the public name of the Ray integration; the code lives with the batch jobs, in
`vlmrun.jobs.ray_data` (which `vlmrun caption --ray` uses too), so the jobs package never imports
upward into this one. Ray is an optional extra (`pip install 'vlmrun[ray]'`): importing this
module does not import it.
"""

from vlmrun.jobs.ray_data import VlmrunCaptioner, VlmrunEmbedder, caption_dataset

__all__ = ["VlmrunCaptioner", "VlmrunEmbedder", "caption_dataset"]
