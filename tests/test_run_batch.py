"""`vlmrun run-batch` (vLLM's OpenAI batch format) end to end on the tiny Qwen3-VL.

Checked: chat and completions lines (an image as a data: URI among them) get the server's own answer
to the same body; bad lines (bad JSON, unknown url, a body the server refuses, a repeated custom_id,
stream mode) get error lines and the rest completes; a rerun skips what is written, so a SIGKILL mid-job
and a rerun leave every custom_id exactly once; -o - writes JSONL to stdout; a foreign -o is refused.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.test_caption_cli import _lines_in, subprocess_env
from tests.test_server import data_uri, image_part, picture, png_bytes
from vlmrun.cli import main

ENGINE_FLAGS = ["--dtype", "float32", "--device", "cpu", "--max-model-len", "1024", "--max-num-seqs", "4",
                "--kv-cache-memory-bytes", str(32 << 20)]


def _flags(model_dir: Path) -> list[str]:
    return ["--model", str(model_dir), *ENGINE_FLAGS]


def _chat_line(custom_id: str, content, model: str, **body) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": model, "messages": [{"role": "user", "content": content}], "temperature": 0,
                     "max_tokens": 6, **body}}


def _completion_line(custom_id: str, prompt, model: str, **body) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/completions",
            "body": {"model": model, "prompt": prompt, "temperature": 0, "max_tokens": 6, **body}}


def _write_lines(path: Path, lines: list) -> Path:
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines),
                    encoding="utf-8")
    return path


def _outputs(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def _by_custom_id(outputs: list[dict]) -> dict[str, dict]:
    out = {o["custom_id"]: o for o in outputs}
    assert len(out) == len(outputs), "a custom_id is answered twice"
    return out


def _served(model_dir: Path, bodies: list[tuple[str, dict]]) -> list[tuple[int, dict]]:
    """What `vlmrun serve` (same engine flags, over HTTP) answers to each (url, body)."""
    from vlmrun.config import EngineConfig
    from vlmrun.server.launch import build_engine, serve_in_thread
    from vlmrun.server.settings import ServerSettings

    engine = build_engine(EngineConfig(model=str(model_dir), dtype="float32", device="cpu", max_model_len=1024,
                                       max_num_seqs=4, kv_cache_memory_bytes=32 << 20))
    server = serve_in_thread(engine, ServerSettings(served_model_name=str(model_dir)))
    try:
        answers = [httpx.post(server.base_url + url, json=body, timeout=60) for url, body in bodies]
        return [(a.status_code, a.json()) for a in answers]
    finally:
        server.stop()
        engine.shutdown()


def _comparable(body: dict) -> dict:
    """A completion answer without what differs between two runs (ids, times)."""
    return {k: v for k, v in body.items() if k not in ("id", "created")}


def logprobs_apart(value: Any) -> tuple[Any, list[float]]:
    """An answer (or part of one) with every float in it — its logprobs: counts are integers — set to
    None, and those floats in order. Two runs that batch the same requests differently (run-batch runs
    lines side by side, the server one at a time) agree on the first exactly and on the second within
    float32 noise: a GEMM's summation order may follow its row count (F.linear on an AVX-512 Xeon)."""
    values: list[float] = []

    def walk(v: Any) -> Any:
        if isinstance(v, float):
            values.append(v)
            return None
        if isinstance(v, dict):
            return {k: walk(x) for k, x in v.items()}
        if isinstance(v, list):
            return [walk(x) for x in v]
        return v

    return walk(value), values


def assert_same_answer(got: dict, want: dict, tol: float, label: str = "") -> None:
    """`got` is `want` but for ids, times and logprob values within `tol`."""
    (got_rest, got_values), (want_rest, want_values) = logprobs_apart(_comparable(got)), logprobs_apart(_comparable(want))
    assert got_rest == want_rest, label
    assert got_values == pytest.approx(want_values, abs=tol), label


def test_lines_get_the_servers_answers_and_bad_lines_get_errors(qwen3_vl_dir: Path, tmp_path: Path,
                                                                capsys: pytest.CaptureFixture) -> None:
    model = str(qwen3_vl_dir)
    image = data_uri(png_bytes(picture(64, 48, 1)))
    good = [
        _chat_line("chat-text", "Tell me a story.", model),
        _chat_line("chat-image", [image_part(image), {"type": "text", "text": "Describe."}], model),
        _chat_line("chat-n2", "Say something.", model, n=2, logprobs=True, top_logprobs=2),
        _completion_line("cmpl", "Once upon a time", model),
        _completion_line("cmpl-two", ["One", "Two"], model),
    ]
    refused_by_server = _chat_line("bad-body", "Hi.", model, temperature=-1)
    wrong_model = _chat_line("wrong-model", "Hi.", "no-such-model")
    picture(20, 20, 3).save(tmp_path / "local.png")  # a local path: refused, as the server refuses it by default
    local_path = _chat_line("local-path", [image_part(str(tmp_path / "local.png"))], model)
    lines = [good[0], "{not json", good[1], {"custom_id": "bad-url", "method": "POST", "url": "/v1/embeddings",
                                             "body": {"input": "x"}},
             refused_by_server, good[2], "", dict(good[0], body={"messages": []}),  # a repeated custom_id
             {"method": "POST", "url": "/v1/completions", "body": {"prompt": "x"}},  # no custom_id
             _completion_line("streamed", "x", model, stream=True), good[3], wrong_model, good[4], local_path]
    src = _write_lines(tmp_path / "in.jsonl", lines)
    out = tmp_path / "out.jsonl"

    assert main(["run-batch", "-i", str(src), "-o", str(out), *_flags(qwen3_vl_dir)]) == 0  # some lines failed: in the file (vLLM's status)
    err = capsys.readouterr().err
    assert "answered 5/13 requests" in err and "8 failed" in err

    outputs = _outputs(out)
    assert len(outputs) == 13  # one per non-blank line
    named = {o["custom_id"]: o for o in outputs if not o["id"].startswith("vlmrun-line-")}
    served = _served(qwen3_vl_dir, [(g["url"], g["body"]) for g in good]
                     + [(line["url"], line["body"]) for line in (refused_by_server, wrong_model, local_path)])
    for g, (status, body) in zip(good, served):
        got = named[g["custom_id"]]
        assert status == 200 and got["error"] is None
        assert got["response"]["status_code"] == 200 and got["response"]["request_id"].startswith("vlmrun-batch-")
        assert_same_answer(got["response"]["body"], body, 1e-5, g["custom_id"])
    assert len(named["chat-n2"]["response"]["body"]["choices"]) == 2
    assert len(named["cmpl-two"]["response"]["body"]["choices"]) == 2
    for cid, (status, body) in zip(("bad-body", "wrong-model", "local-path"), served[len(good):]):
        got = named[cid]  # vLLM's failed line: no response, the server's error answer as `error`
        assert got["response"] is None and status in (400, 404) and got["error"] == body

    assert named["bad-url"]["response"] is None and "/v1/embeddings" in named["bad-url"]["error"]["error"]["message"]
    assert named["streamed"]["error"]["error"]["param"] == "stream"
    by_line = {o["id"]: o for o in outputs if o["id"].startswith("vlmrun-line-")}
    assert sorted(by_line) == ["vlmrun-line-2", "vlmrun-line-8", "vlmrun-line-9"]
    errors = {line_id: o["error"]["error"] for line_id, o in by_line.items()}
    assert "not valid JSON" in errors["vlmrun-line-2"]["message"]
    assert by_line["vlmrun-line-8"]["custom_id"] == "chat-text" and "earlier line" in errors["vlmrun-line-8"]["message"]
    assert by_line["vlmrun-line-9"]["custom_id"] is None and errors["vlmrun-line-9"]["param"] == "custom_id"

    # a rerun skips every line (answers and refusals): nothing is written twice, and no engine is built
    before = out.read_bytes()
    assert main(["run-batch", "-i", str(src), "-o", str(out), *_flags(qwen3_vl_dir)]) == 0
    assert "nothing left to run" in capsys.readouterr().err
    assert out.read_bytes() == before

    # --retry-errors sends the failed lines again (and they fail again, each once)
    assert main(["run-batch", "-i", str(src), "-o", str(out), "--retry-errors", *_flags(qwen3_vl_dir)]) == 0
    again = _outputs(out)
    assert len(again) == 13 and sum(o["error"] is not None for o in again) == 8


def test_sigkill_mid_job_then_resume_answers_every_custom_id_exactly_once(qwen3_vl_dir: Path, tmp_path: Path,
                                                                          capsys: pytest.CaptureFixture) -> None:
    n = 60
    model = str(qwen3_vl_dir)
    src = _write_lines(tmp_path / "in.jsonl", [_chat_line(f"req-{i}", f"Count to {i}.", model, max_tokens=8)
                                                for i in range(n)])
    out = tmp_path / "out.jsonl"
    cmd = [sys.executable, "-m", "vlmrun.cli", "run-batch", "-i", str(src), "-o", str(out), *_flags(qwen3_vl_dir)]
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=subprocess_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 90
    while _lines_in(out) < 6 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, proc.stderr.read().decode()[-2000:]
    proc.stderr.close()
    killed_at = _lines_in(out)
    assert 6 <= killed_at < n, f"the kill did not land mid-job ({killed_at} lines)"
    with open(out, "ab") as fh:  # and a torn write, as a power loss would leave
        fh.write(b'{"id":"vlmrun-0","custom_id":"req-0","response":{"status_')

    assert main(cmd[3:]) == 0  # the resumed run, in this process
    err = capsys.readouterr().err
    assert "removed the torn last line" in err and f"{killed_at:,} lines already in the output" in err
    outputs = _by_custom_id(_outputs(out))
    assert sorted(outputs) == sorted(f"req-{i}" for i in range(n))
    assert all(o["error"] is None and o["response"]["body"]["usage"]["completion_tokens"] >= 1
               for o in outputs.values())
    assert out.read_bytes().endswith(b"\n")


def test_dash_o_writes_jsonl_to_stdout(qwen3_vl_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    model = str(qwen3_vl_dir)
    src = _write_lines(tmp_path / "in.jsonl", [_completion_line("a", "Once", model), _chat_line("b", "Hi.", model)])
    assert main(["run-batch", "-i", str(src), "-o", "-", *_flags(qwen3_vl_dir)]) == 0
    captured = capsys.readouterr()
    outputs = _by_custom_id([json.loads(line) for line in captured.out.splitlines()])
    assert sorted(outputs) == ["a", "b"]
    assert outputs["a"]["response"]["body"]["object"] == "text_completion"
    assert outputs["b"]["response"]["body"]["object"] == "chat.completion"
    assert "answered 2/2 requests" in captured.err


def test_an_output_that_is_not_a_batch_output_or_is_the_input_is_refused_untouched(
        qwen3_vl_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    src = _write_lines(tmp_path / "in.jsonl", [_completion_line("a", "Once", str(qwen3_vl_dir))])
    foreign = _write_lines(tmp_path / "other.jsonl", [{"image": "x.png", "caption": "a cat"}])
    before = foreign.read_bytes()
    assert main(["run-batch", "-i", str(src), "-o", str(foreign), *_flags(qwen3_vl_dir)]) == 2
    assert "is not a run-batch job's output" in capsys.readouterr().err
    assert foreign.read_bytes() == before
    assert main(["run-batch", "-i", str(src), "-o", str(src), *_flags(qwen3_vl_dir)]) == 2
    assert "is the input" in capsys.readouterr().err
