"""Pooling configuration, params and the runner kinds: what is read from a checkpoint, what is refused.

The checkpoint's pooling is read as sentence-transformers writes it (`modules.json`, the Pooling
module's `config.json`, a Normalize module); `dimensions` is Matryoshka truncation then normalization,
refused where the checkpoint does not allow it; a request of the other kind is a clear ValueError.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from vlmrun import LLM, SamplingParams
from vlmrun.pooling import PoolerConfig, PoolingParams, read_pooler_config
from vlmrun.pooling.pooler import ChunkPooling, PoolingState, pool_chunks

HIDDEN = 8


class Cfg:
    """A stand-in HF config with only the Matryoshka fields."""

    def __init__(self, **fields):
        self.__dict__.update(fields)


def write_sentence_transformers(folder, mode: str, normalize: bool) -> None:
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    (folder / "modules.json").write_text(json.dumps(modules))
    (folder / "1_Pooling").mkdir(exist_ok=True)
    flags = {f"pooling_mode_{m}": m == mode for m in ("cls_token", "mean_tokens", "max_tokens", "lasttoken")}
    (folder / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": HIDDEN, **flags}))
    st_config = {"prompts": {}, "similarity_fn_name": "cosine"}
    (folder / "config_sentence_transformers.json").write_text(json.dumps(st_config))


@pytest.mark.parametrize("mode,want", [("lasttoken", "LAST"), ("mean_tokens", "MEAN"), ("cls_token", "CLS")])
@pytest.mark.parametrize("normalize", [True, False])
def test_sentence_transformers_pooling_is_read(tmp_path, mode, want, normalize):
    write_sentence_transformers(tmp_path, mode, normalize)
    config = read_pooler_config(tmp_path, Cfg(), HIDDEN)
    assert (config.pooling_type, config.normalize, config.source) == (want, normalize, "modules.json")
    over = read_pooler_config(tmp_path, Cfg(), HIDDEN, {"pooling_type": "mean", "normalize": not normalize})
    assert (over.pooling_type, over.normalize) == ("MEAN", not normalize)


def test_defaults_and_refusals(tmp_path):
    assert read_pooler_config(tmp_path, Cfg(), HIDDEN) == PoolerConfig(hidden_size=HIDDEN)  # vLLM's: LAST, normalized
    write_sentence_transformers(tmp_path, "max_tokens", False)
    with pytest.raises(ValueError, match="pooling_mode_max_tokens"):
        read_pooler_config(tmp_path, Cfg(), HIDDEN)
    with pytest.raises(ValueError, match="unknown keys"):
        PoolerConfig().overridden({"pooling": "MEAN"})
    with pytest.raises(ValueError, match="pooling_type"):
        PoolerConfig(pooling_type="MAX")


def test_matryoshka_dimensions():
    plain = PoolerConfig(hidden_size=HIDDEN)
    with pytest.raises(ValueError, match="Matryoshka"):
        PoolingParams(dimensions=4).resolve(plain)
    any_size = read_pooler_config(".", Cfg(is_matryoshka=True), HIDDEN)
    assert PoolingParams(dimensions=4).resolve(any_size).dimensions == 4
    for bad, match in ((0, ">= 1"), (HIDDEN + 1, "hidden size")):
        with pytest.raises(ValueError, match=match):
            PoolingParams(dimensions=bad).resolve(any_size)
    listed = read_pooler_config(".", Cfg(matryoshka_dimensions=[2, 4]), HIDDEN)
    with pytest.raises(ValueError, match=r"\[2, 4\]"):
        PoolingParams(dimensions=3).resolve(listed)
    state = PoolingState(PoolingParams(dimensions=2).resolve(listed))  # truncate, then normalize
    out = state.add(0, 1, 1, torch.tensor([3.0, 4.0, 5.0, 6.0, 0.0, 0.0, 0.0, 0.0]))
    assert torch.allclose(out, torch.tensor([0.6, 0.8]))


def test_chunk_contributions():
    hidden = torch.arange(12, dtype=torch.float32).reshape(6, 2)  # two chunks: rows 0-2 and 3-5
    tasks = [ChunkPooling("MEAN", first=True, last=False), ChunkPooling("CLS", first=False, last=True)]
    assert [None if t is None else t.tolist() for t in pool_chunks(hidden, tasks, [3, 3])] == [[6.0, 9.0], None]
    last = pool_chunks(hidden, [None, ChunkPooling("LAST", first=False, last=True)], [3, 3])
    assert last[0] is None and last[1].tolist() == [10.0, 11.0]


def test_wrong_runner_is_a_clear_error(qwen3_vl_dir):
    gen = LLM(str(qwen3_vl_dir))
    with pytest.raises(ValueError, match="runner='pooling'"):
        gen.embed("hello")
    pool = LLM(str(qwen3_vl_dir), task="embed")  # vLLM's older alias
    with pytest.raises(ValueError, match="runner='generate'"):
        pool.generate("hello")
    with pytest.raises(ValueError, match="runner='generate'"):
        pool.chat([{"role": "user", "content": "hi"}])
    with pytest.raises(ValueError, match="PoolingParams"):
        pool.embed("hello", SamplingParams(max_tokens=3))
    with pytest.raises(ValueError, match="Matryoshka"):
        pool.embed("hello", PoolingParams(dimensions=4))
    with pytest.raises(ValueError, match="runner must be"):
        LLM(str(qwen3_vl_dir), runner="reward")


def test_embed_and_encode_shapes_and_bad_input(qwen3_vl_dir, tmp_path):
    folder = tmp_path / "model"
    shutil.copytree(qwen3_vl_dir, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "is_matryoshka": True}))
    llm = LLM(str(folder), runner="pooling")
    hidden = llm.engine.model_config.text_config.hidden_size
    prompts = ["a cat on a mat", {"prompt": "look", "images": [b"not an image"]}, {"prompt_token_ids": [5, 6, 7]}]
    full, bad, ids = llm.embed(prompts, use_tqdm=False)
    assert len(full.outputs.embedding) == hidden and abs(torch.tensor(full.outputs.embedding).norm() - 1) < 1e-5
    assert bad.error and bad.outputs.embedding == []  # fails alone
    assert ids.prompt_token_ids == [5, 6, 7] and ids.finished
    short = llm.embed("a cat on a mat", PoolingParams(dimensions=4), use_tqdm=False)[0].outputs.embedding
    raw = llm.embed("a cat on a mat", PoolingParams(normalize=False), use_tqdm=False)[0].outputs.embedding
    want = torch.nn.functional.normalize(torch.tensor(raw[:4]), dim=-1)
    assert torch.allclose(torch.tensor(short), want, atol=1e-6)
    cut = llm.embed({"prompt_token_ids": [5, 6, 7, 8, 9]}, PoolingParams(truncate_prompt_tokens=3), use_tqdm=False)[0]
    last3 = llm.embed({"prompt_token_ids": [7, 8, 9]}, use_tqdm=False)[0]
    assert cut.prompt_token_ids == [7, 8, 9] and cut.outputs.embedding == last3.outputs.embedding
    encoded = llm.encode(["a cat on a mat"], use_tqdm=False)[0]
    assert torch.allclose(encoded.outputs.data, torch.tensor(full.outputs.embedding))
    assert llm.engine.stats().kv_pages_used == 0
