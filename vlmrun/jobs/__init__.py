"""Batch jobs: captioning many images, resumably, on one engine or on Ray Data; OpenAI batch files.

- `cli`: the `vlmrun caption` command (flags -> `CaptionJobConfig`, exit status).
- `config`: `CaptionJobConfig`, `RayOptions` and the job defaults.
- `inputs`: INPUT arguments (files, directories, globs, URLs, manifests) -> a lazy stream of `JobItem`s.
- `pipeline`: `CaptionPipeline`, the caption job's use of the one input pipeline (`vlmrun.feed`): worker
  threads preprocess, one thread drives the engine, one record per input.
- `journal`: the crash-safe JSONL journal (append, repair, scan) and `ResumeState`, what an output holds.
- `sink`: the JSONL / Parquet / print outputs built on the journal, and their lock.
- `records`: `CaptionRecord`, the record schema and key hashing.
- `progress`: counters, the live bar, the final `JobSummary`.
- `runner`: `run_caption_job`, which ties them together (and hands off to `ray_data` with --ray).
- `run_batch_cli`, `run_batch`, `run_batch_lines`, `run_batch_reader`, `run_batch_server`: `vlmrun
  run-batch`, vLLM's OpenAI batch format (request lines in, read up to a size cap; answer lines out, in
  input order) on the same journal, answered by the server's app in process.
- `ray_data`: `VlmrunCaptioner` for `Dataset.map_batches` and `run_ray_job` (public as `vlmrun.ray`).
"""
