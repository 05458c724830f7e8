"""What a newcomer meets first: `vlmrun --help` answers at once (no torch imported to parse a command line)
and shows the defaults, `vlmrun --version`, `serve` refuses a busy port before loading the model, says what
it loads and serves, and running the bundled model because none was named is said once."""

from __future__ import annotations

import json
import logging
import os
import queue
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "transformers", "gradio", "fastapi", "uvicorn", "numpy")


def _env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")


def _vlmrun(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "vlmrun.cli", *args], env=_env(), cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)


def test_parsing_a_command_line_imports_no_heavy_library() -> None:
    code = ("import sys; from vlmrun.cli import build_parser; p = build_parser(); p.format_help(); "
            "sub = next(a for a in p._actions if a.dest == 'command'); [s.format_help() for s in sub.choices.values()]; "
            "p.parse_args(['serve', '--port', '9']); p.parse_args(['caption', 'x']); "
            f"print([m for m in {HEAVY!r} if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], env=_env(), cwd=ROOT, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_help_lists_the_commands_and_version_is_printed() -> None:
    out = _vlmrun("--help")  # fast: ~0.3 s on an idle 2-core machine (the import test above is the check)
    assert out.returncode == 0 and "serve" in out.stdout and "web" in out.stdout and "caption" in out.stdout
    version = _vlmrun("--version")
    assert version.returncode == 0
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert version.stdout.strip() == "vlmrun " + re.search(r'^version = "([^"]+)"', pyproject, re.M).group(1)


@pytest.mark.parametrize("command, option, default", [
    ("serve", "--port", "8000"), ("serve", "--host", "127.0.0.1"), ("serve", "--dtype", "auto"),
    ("serve", "--device", "auto"), ("serve", "--max-num-seqs", "256"), ("web", "--port", "7860"),
    ("caption", "--max-tokens", "64"), ("caption", "--dtype", "auto"), ("caption", "--temperature", "0.0"),
])
def test_help_shows_the_defaults(command: str, option: str, default: str) -> None:
    from vlmrun.cli import build_parser

    sub = next(a for a in build_parser()._actions if a.dest == "command").choices[command]
    text = " ".join(sub.format_help().split("options:", 1)[1].split())  # the options, not the usage
    entry = re.search(re.escape(option) + r" \S+ (.*?)(?= --[a-z]|$)", text)
    assert entry and f"(default: {default})" in entry.group(1), entry and entry.group(0)


def test_the_cli_lora_kernel_names_are_the_engine_s() -> None:
    from vlmrun.cli_options import LORA_KERNELS
    from vlmrun.config import LORA_KERNELS as ENGINE_LORA_KERNELS

    assert LORA_KERNELS == ENGINE_LORA_KERNELS


def test_the_bundled_model_is_announced_by_the_run_not_by_checks(caplog: pytest.LogCaptureFixture) -> None:
    from vlmrun.default_model import MODEL_DIR_NAME, is_bundled, resolve_model

    with caplog.at_level(logging.WARNING, logger="vlmrun.default_model"):
        resolve_model(None, announce=False)
        resolve_model("Qwen/Qwen3-VL-2B-Instruct")
        assert not caplog.records
        resolve_model(None)
    (record,) = caplog.records
    assert "bundled" in record.getMessage() and "--model Qwen/" in record.getMessage()
    assert is_bundled(None) and is_bundled(MODEL_DIR_NAME) and not is_bundled("Qwen/Qwen3-VL-2B-Instruct")


def test_serve_refuses_a_busy_port_before_loading_the_model() -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        start = time.monotonic()
        out = _vlmrun("serve", "--port", str(port), timeout=120)
    assert out.returncode == 2, out.stderr[-2000:]
    assert f"port {port}" in out.stderr and "already in use" in out.stderr
    assert "loading" not in out.stderr  # failed before the model load
    assert time.monotonic() - start < 60


def test_serve_says_what_it_loads_and_serves_and_that_the_model_is_the_bundled_one() -> None:
    proc = subprocess.Popen([sys.executable, "-m", "vlmrun.cli", "serve", "--port", "0", "--log-level", "warning"],
                            env=_env(), cwd=ROOT, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stderr], daemon=True).start()
    seen: list[str] = []
    try:
        deadline = time.monotonic() + 240
        url = None
        while url is None and time.monotonic() < deadline:
            try:
                line = lines.get(timeout=1)
            except queue.Empty:
                if proc.poll() is not None:
                    break
                continue
            seen.append(line)
            found = re.search(r"serving .* on (http://127\.0\.0\.1:\d+)", line)
            url = found.group(1) if found else None
        assert url, "".join(seen)[-3000:]
        with urllib.request.urlopen(url + "/v1/models", timeout=30) as r:
            assert json.load(r)["data"][0]["id"] == "vlmrun-shapes-qwen3_5"
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    text = "".join(seen)
    assert text.count("bundled 3M-parameter shapes model") == 1
    assert "vlmrun: loading" in text and re.search(r"vlmrun: loaded .* in [\d.]+ s", text)
    assert "vlmrun-shapes-qwen3_5" in [line for line in seen if "serving" in line][0]


def test_caption_says_what_it_loads(tmp_path: Path) -> None:
    image = sorted((ROOT / "assets" / "images").glob("scene_*.png"))[0]
    out = _vlmrun("caption", str(image), "--out", str(tmp_path / "out.jsonl"), "--no-progress", timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert re.search(r"vlmrun: loading \S*vlmrun-shapes-qwen3_5 \.\.\.", out.stderr), out.stderr[-2000:]
    assert re.search(r"vlmrun: loaded \S*vlmrun-shapes-qwen3_5 in [\d.]+ s", out.stderr), out.stderr[-2000:]
