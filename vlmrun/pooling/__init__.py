"""Pooling (embeddings): vLLM's `runner="pooling"` on the generation models.

A pooling request is prefill-only: its prompt runs through the model as a generation prompt does
(continuous batching, chunked prefill, encoder cache, prefix cache for last-token pooling), and
instead of sampling, the final hidden states (after the final norm) of its rows are pooled
(`pooler.py`: LAST / MEAN / CLS, accumulated chunk by chunk), optionally truncated (Matryoshka
`dimensions`) and normalized. The request then finishes and frees its KV pages.

- `params.py`: `PoolingParams` (vLLM's names) and their check against the checkpoint.
- `config.py`: `PoolerConfig`, read from the checkpoint as vLLM / sentence-transformers read it.
- `pooler.py`: what the runner computes per chunk (`ChunkPooling`, `pool_chunks`) and the
  per-request accumulator the engine keeps (`PoolingState`).
- `outputs.py`: vLLM's output shapes (`EmbeddingRequestOutput`, `PoolingRequestOutput`).

Importing the package (and `params`, `config`) loads no torch: the CLI's parsers and job configs use them.
"""

from vlmrun.pooling.config import POOLING_TYPES, PoolerConfig, read_pooler_config
from vlmrun.pooling.params import PoolingParams

__all__ = ["POOLING_TYPES", "PoolerConfig", "read_pooler_config", "PoolingParams"]
