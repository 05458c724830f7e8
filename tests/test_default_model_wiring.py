"""Every entry point falls back to the bundled default model when no model is named; without the
model's files that fallback is a clear error, never a crash deep in loading. (The shipped model
itself, its accuracy and its HF parity are tested by tests/test_default_model.py.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vlmrun.cli import build_parser, main
from vlmrun.config import EngineConfig
from vlmrun.default_model import MODEL_DIR_NAME, resolve_model, served_name
from vlmrun.shape_scenes import scene_from_file


@pytest.fixture
def no_default(monkeypatch, tmp_path) -> Path:
    absent = tmp_path / "absent"
    monkeypatch.setattr("vlmrun.default_model.default_model_path", lambda: absent)
    return absent


@pytest.fixture
def tiny_as_default(monkeypatch, qwen3_vl_dir) -> Path:
    monkeypatch.setattr("vlmrun.default_model.default_model_path", lambda: Path(qwen3_vl_dir))
    return Path(qwen3_vl_dir)


def test_resolve_model(tiny_as_default):
    assert resolve_model("some/model") == "some/model"
    assert resolve_model(None) == str(tiny_as_default)
    assert resolve_model("") == str(tiny_as_default)
    assert served_name(None) == MODEL_DIR_NAME and served_name("m") == "m"


def test_missing_default_is_a_clear_error(no_default, tmp_path, capsys):
    from vlmrun.engine.engine import Engine

    with pytest.raises(FileNotFoundError, match="bundled default model is missing"):
        Engine(EngineConfig(device="cpu"))
    image = tmp_path / "x.png"
    from PIL import Image

    Image.new("RGB", (64, 64)).save(image)
    assert main(["caption", str(image), "--no-progress"]) == 2
    assert "bundled default model is missing" in capsys.readouterr().err


def test_engine_and_caption_use_the_default(tiny_as_default, tmp_path, capsys):
    from vlmrun.engine.engine import Engine

    engine = Engine(EngineConfig(device="cpu", dtype="float32"))
    assert engine.model_config.path == tiny_as_default
    from PIL import Image

    image = tmp_path / "x.png"
    Image.new("RGB", (64, 64), "red").save(image)
    assert main(["caption", str(image), "--no-progress", "--device", "cpu", "--max-tokens", "3"]) == 0
    record = json.loads(capsys.readouterr().out)  # stdout is no terminal here: one JSONL record
    assert record["image"] == str(image) and record["model"] == str(tiny_as_default) and record["error"] is None


def test_serve_and_web_default_to_it():
    from vlmrun.server.cli import engine_config, server_settings
    from vlmrun.web.app import examples

    args = build_parser().parse_args(["serve"])
    assert engine_config(args).model is None  # the engine resolves None to the bundled model
    assert server_settings(args).served_model_name == MODEL_DIR_NAME
    web_args = build_parser().parse_args(["web"])
    assert web_args.model is None and web_args.server is None

    shown = examples(MODEL_DIR_NAME)  # the shapes model gets the generator scenes and its own questions
    assert shown and all(scene_from_file(e["files"][0]) is not None for e in shown)
    others = examples("Qwen/Qwen3-VL-2B-Instruct")
    assert others and all(scene_from_file(e["files"][0]) is None for e in others)
