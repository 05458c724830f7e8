"""The input pipeline: inputs read lazily, preprocessed by workers, fed to the engine as it steps.

`LLM.generate` / `LLM.chat` (`vlmrun/api.py`) and the caption job (`vlmrun/jobs/pipeline.py`) run their
inputs through one `InputPipeline` (`pipeline.py`); run-batch writes its lines through the same bounded
reorder window (`reorder.py`). Pieces, bottom up:

- `workers.py`: how many preprocessing workers the CPUs this process may use allow, threads or processes.
- `prepare.py`: generate's and chat's processing as picklable objects (what a worker process runs).
- `process_workers.py`: one spawned worker process per worker thread (`preprocess_pool="process"`).
- `pixel_memory.py`: a processed prompt's pixels moved to a mapping of their own (no holes in the heaps).
- `prefetch.py`: the feeder and worker threads, at most `prefetch` processed prompts ahead of the engine.
- `pipeline.py`: the engine loop: top up the engine from the prefetch, step, hand out finished inputs.
- `reorder.py`: results back in input order through a bounded window.
- `progress.py`: the tqdm bar of a call (finished inputs, preprocessing and generation rates).
"""
