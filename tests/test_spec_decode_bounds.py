"""`num_speculative_tokens` is bounded (issue 45, item 5).

k sizes each verify step (1 + k positions a request) and the per-position acceptance counters, one
`/metrics` series each: 10^6 made a million-series metric, 10^20 an OverflowError traceback at
start-up. Values past `MAX_SPECULATIVE_TOKENS` are a ValueError naming the bound, and the command
line exits 2 with that message, before any model is loaded.
"""

from __future__ import annotations

import json

import pytest

from testing.image_folders import write_images
from vlmrun.cli import main
from vlmrun.config import EngineConfig
from vlmrun.configs.speculative import MAX_SPECULATIVE_TOKENS, SpeculativeConfig


def test_the_largest_k_is_taken_and_larger_ones_are_refused_naming_the_bound():
    assert SpeculativeConfig.of({"method": "ngram", "num_speculative_tokens": MAX_SPECULATIVE_TOKENS}) \
        .num_speculative_tokens == MAX_SPECULATIVE_TOKENS
    for k in (MAX_SPECULATIVE_TOKENS + 1, 10 ** 6, 10 ** 20):
        for method in ("ngram", "mtp"):
            with pytest.raises(ValueError, match=f"num_speculative_tokens must be at most {MAX_SPECULATIVE_TOKENS}, "
                                                 f"got {k}"):
                EngineConfig(speculative_config={"method": method, "num_speculative_tokens": k})


@pytest.mark.parametrize("command", ["serve", "caption"])
def test_the_command_line_exits_2_with_the_message(command, qwen3_dir, tmp_path, capsys):
    spec = json.dumps({"method": "ngram", "num_speculative_tokens": 10 ** 20})
    write_images(tmp_path / "imgs", 1)
    argv = ["serve", str(qwen3_dir)] if command == "serve" else \
        ["caption", str(tmp_path / "imgs"), "--out", str(tmp_path / "out.jsonl"), "--model", str(qwen3_dir),
         "--no-progress"]
    assert main([*argv, "--device", "cpu", "--speculative-config", spec]) == 2
    err = capsys.readouterr().err
    assert f"num_speculative_tokens must be at most {MAX_SPECULATIVE_TOKENS}" in err and "Traceback" not in err
