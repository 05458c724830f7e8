"""The server with `--tensor-parallel-size 2`: every engine-serving test of tests/test_server.py, run
as they are (imported below; only the CLI-registration test is left out: it starts no engine) against an engine built from the serve CLI's flags, each rank in its own
process (gloo on CPU)."""

from __future__ import annotations

import argparse
from typing import Iterator

import pytest

from tests.test_server import (  # noqa: F401  (collected here, with this module's engine under its fixtures)
    client,
    server,
    test_api_key,
    test_base64_image_and_two_images_in_one_message,
    test_logprobs,
    test_models_health_and_metrics,
    test_n_choices_and_seed,
    test_plain_and_streamed_chat_agree,
    test_stop_sequences,
    test_text_completions,
)
from vlmrun.engine.async_engine import AsyncEngine
from vlmrun.server.cli import add_engine_args, add_server_args, engine_config
from vlmrun.server.launch import build_engine


@pytest.fixture(scope="module")
def engine(qwen3_vl_dir) -> Iterator[AsyncEngine]:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    add_server_args(parser)
    args = parser.parse_args(["--model", str(qwen3_vl_dir), "--dtype", "float32", "--device", "cpu",
                              "--max-model-len", "1024", "--max-num-seqs", "64",
                              "--kv-cache-memory-bytes", str(16 << 20), "--tensor-parallel-size", "2"])
    config = engine_config(args)
    assert config.tensor_parallel_size == 2
    eng = build_engine(config)
    yield eng
    eng.shutdown()
    assert not any(p.is_alive() for p in eng.engine.executor.processes)

