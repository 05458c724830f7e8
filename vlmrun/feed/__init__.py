"""The input pipeline: inputs read lazily, preprocessed by worker threads, fed to the engine as it steps.

`LLM.generate` / `LLM.chat` (`vlmrun/api.py`) and the caption job (`vlmrun/jobs/pipeline.py`) run their
inputs through one `InputPipeline` (`pipeline.py`); run-batch writes its lines through the same bounded
reorder window (`reorder.py`). Pieces, bottom up:

- `workers.py`: how many preprocessing workers the CPUs this process may use allow.
- `prefetch.py`: the feeder and worker threads, at most `prefetch` processed prompts ahead of the engine.
- `pipeline.py`: the engine loop: top up the engine from the prefetch, step, hand out finished inputs.
- `reorder.py`: results back in input order through a bounded window.
- `progress.py`: the tqdm bar of a call (finished inputs, preprocessing and generation rates).
"""
