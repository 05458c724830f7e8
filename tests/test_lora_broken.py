"""Broken LoRA adapters are clear errors, never a traceback or a 500 (issue 45, item 6).

A config that is a JSON list, an `alpha_pattern` whose key is not a regex or whose value is not a
number, rank-0 tensors (scaling alpha / r divided by zero), an empty, truncated or lying-header
safetensors file, an absurd rank (r = 10^12 must never size a slot): each fails its own request with
a `LoRAError` naming the adapter and what is wrong, the good requests beside it unchanged. The server
refuses a missing or broken `--lora-modules` adapter at start-up (exit 2, as vLLM refuses), and
`vlmrun caption --lora` a broken one at once; an engine's `max_lora_rank` is bounded before any slot is made.
"""

from __future__ import annotations

import argparse
import json
import re
import struct
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from tests.test_lora_errors import assert_bad_fail_alone, first_key, good, variant  # noqa: F401 (good: a fixture)
from vlmrun import LLM
from vlmrun.cli import main
from vlmrun.lora.peft_files import MAX_LORA_RANK, LoRAError, configured_rank
from vlmrun.server.cli import lora_modules

WEIGHTS = "adapter_model.safetensors"


def with_weights_bytes(good_dir: Path, tmp: Path, name: str, edit) -> Path:
    """A copy of the good adapter whose weights file's bytes `edit(data)` rewrote."""
    out = variant(good_dir, tmp, name)
    (out / WEIGHTS).write_bytes(edit((out / WEIGHTS).read_bytes()))
    return out


def lying_header(data: bytes) -> bytes:
    """A header that names a 10^6 x 10^6 tensor over the few bytes the file holds."""
    header = json.dumps({"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight":
                         {"dtype": "F32", "shape": [10 ** 6, 10 ** 6], "data_offsets": [0, 4 * 10 ** 12]}}).encode()
    return struct.pack("<Q", len(header)) + header + b"\0" * 64


def broken(good_dir: Path, tmp: Path) -> dict[str, tuple[Path, str]]:
    """name -> (folder, what its error says)."""
    def config_text(name: str, text: str) -> Path:
        out = variant(good_dir, tmp, name)
        (out / "adapter_config.json").write_text(text)
        return out

    def rank_zero(sd: dict) -> None:
        a, b = first_key(sd, "lora_A"), first_key(sd, "lora_B")
        sd[a], sd[b] = sd[a][:0].contiguous(), sd[b][:, :0].contiguous()

    return {
        "list_config": (config_text("list_config", "[1, 2]"), "adapter_config.json holds a JSON list, not an object"),
        "not_json": (config_text("not_json", "{r: 8"), "cannot read"),
        "pattern_regex": (variant(good_dir, tmp, "pattern_regex", config=lambda c: c.update(alpha_pattern={"(": 4})),
                          "alpha_pattern key '(' is not a regular expression"),
        "pattern_value": (variant(good_dir, tmp, "pattern_value", config=lambda c: c.update(alpha_pattern={"q_proj": "x"})),
                          "alpha_pattern['q_proj'] must be a finite positive number, got 'x'"),
        "pattern_list": (variant(good_dir, tmp, "pattern_list", config=lambda c: c.update(alpha_pattern=[1])),
                         "alpha_pattern must be an object"),
        "rank_zero": (variant(good_dir, tmp, "rank_zero", tensors=rank_zero), "with r >= 1"),
        "huge_r": (variant(good_dir, tmp, "huge_r", config=lambda c: c.update(r=10 ** 12)),
                   f"'r' must be an integer rank from 1 to {MAX_LORA_RANK}, got {10 ** 12}"),
        "empty": (with_weights_bytes(good_dir, tmp, "empty", lambda d: b""), "empty, truncated or not safetensors"),
        "truncated": (with_weights_bytes(good_dir, tmp, "truncated", lambda d: d[:len(d) // 2]),
                      "empty, truncated or not safetensors"),
        "lying_header": (with_weights_bytes(good_dir, tmp, "lying_header", lying_header),
                         "empty, truncated or not safetensors"),
        "int_tensor": (variant(good_dir, tmp, "int_tensor", tensors=lambda sd: sd.update(
            {first_key(sd, "lora_A"): sd[first_key(sd, "lora_A")].to(torch.int32)})), "not floating point"),
    }


def test_broken_adapters_fail_alone_with_a_clear_error(qwen3_dir, good, tmp_path):
    assert_bad_fail_alone(qwen3_dir, good, broken(good[0], tmp_path))


def test_an_absurd_rank_is_refused_before_anything_is_sized(qwen3_dir, good, tmp_path):
    good_dir, _ = good
    huge = variant(good_dir, tmp_path, "huge", config=lambda c: c.update(r=10 ** 12))
    with pytest.raises(LoRAError, match=re.escape(f"got {10 ** 12}")):
        configured_rank(huge)
    lying = variant(good_dir, tmp_path, "lying", config=lambda c: c.update(r=64))  # the tensors hold rank 8
    assert configured_rank(lying) == 8 and configured_rank(good_dir) == 8
    for rank in (MAX_LORA_RANK + 1, 10 ** 12):
        with pytest.raises(ValueError, match=f"max_lora_rank must be from 1 to {MAX_LORA_RANK}, got {rank}"):
            LLM(str(qwen3_dir), dtype="float32", device="cpu", enable_lora=True, max_lora_rank=rank)


def test_the_server_refuses_missing_or_broken_lora_modules_at_start(qwen3_dir, good, tmp_path, capsys):
    good_dir, _ = good
    bad = broken(good_dir, tmp_path)

    def args(*items: str, max_lora_rank: int = 16) -> argparse.Namespace:
        return argparse.Namespace(lora_modules=list(items), enable_lora=True, max_lora_rank=max_lora_rank)

    assert lora_modules(args(f"a={good_dir}")) == {"a": str(good_dir)}
    with pytest.raises(LoRAError, match=r"'b': .*nowhere.* does not exist"):
        lora_modules(args(f"a={good_dir}", f"b={tmp_path / 'nowhere'}"))
    for name, (folder, message) in bad.items():
        with pytest.raises(LoRAError, match=re.escape(message)):
            lora_modules(args(f"{name}={folder}"))
    with pytest.raises(LoRAError, match=r"'a': rank 8 is over --max-lora-rank 4"):
        lora_modules(args(f"a={good_dir}", max_lora_rank=4))
    start = time.monotonic()
    assert main(["serve", str(qwen3_dir), "--enable-lora", "--lora-modules", f"x={bad['list_config'][0]}"]) == 2
    assert "vlmrun serve: LoRA adapter 'x'" in capsys.readouterr().err and time.monotonic() - start < 30


def test_caption_with_a_broken_adapter_fails_at_once(qwen3_dir, good, tmp_path, capsys):
    good_dir, _ = good
    (tmp_path / "imgs").mkdir()
    for name in ("huge_r", "rank_zero", "lying_header"):
        (tmp_path / name).mkdir()
        folder = broken(good_dir, tmp_path / name)[name][0]
        start = time.monotonic()
        code = main(["caption", str(tmp_path / "imgs"), "--out", str(tmp_path / f"{name}.jsonl"), "--model",
                     str(qwen3_dir), "--device", "cpu", "--lora", str(folder), "--no-progress"])
        err = capsys.readouterr().err
        assert code == 2 and "vlmrun caption: LoRA adapter" in err and time.monotonic() - start < 30, (name, err)
        assert not (tmp_path / f"{name}.jsonl").exists()
