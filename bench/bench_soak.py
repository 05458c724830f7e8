"""Soak: normal clients beside hostile ones on one server; the normal clients' latency and the server's RSS.

The bundled default model (or `--model`) behind the server's app in a child process (this script
with `--serve`), on 127.0.0.1 only, so that its RSS is the server's alone.
Three phases of `--phase-s` seconds each: normal clients alone (baseline), normal clients beside
hostile ones, normal clients alone again (after). Normal clients (`--normal-clients` threads) send, back
to back, a 3-token text completion and a chat with a small image (greedy: each answer is checked
against its baseline answer). Hostile clients (`--hostile-clients` threads) cycle through:

- a 100k-choice enum (`structured_outputs.choice`) and a JSON-schema enum just under the size limit,
  each with a client that leaves after 1 s;
- a `--huge-mb` MB /tokenize body and the same through /v1/completions;
- 100k `bad_words`, and the most allowed (1,024) on a streamed completion;
- a lone surrogate to /tokenize; a video asked at a size past the context (when torchcodec is there);
- a 100k-entry `logit_bias`, 100k chat messages, a `--huge-mb` MB image data: URL, a JSON schema nested
  5,000 deep, a 20k x 20k PNG (a decompression bomb of a few hundred kB), `n` / `max_tokens` /
  `top_logprobs` / `seed` far out of range, and an image URL that never answers (a local socket that
  accepts and stays silent: the server child allows private URLs for it).

Every hostile answer must be a 4xx (or a 200); the report counts them by kind and status (`--only` sends
some kinds alone, by name or index). Reported: per phase,
the normal requests' count, p50 / p99 / max latency and answers that changed or failed; the server
process's RSS before the hostile phase, at its peak and after. Bounded: three phases, each request with
a timeout; it stops by itself, and the server with it (the child exits when its stdin closes).
Figures on a loaded machine say little: the clients share its cores with the server.

    python -m bench.bench_soak [--phase-s 20] [--normal-clients 4] [--hostile-clients 2] [--huge-mb 50]
                               [--only logit_bias_100k,png_bomb]
"""

from __future__ import annotations

import argparse
import base64
import io
import itertools
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import httpx
import numpy as np
from PIL import Image

from bench.common import hide_flash_linear_attention
from vlmrun.config import EngineConfig
from vlmrun.engine.async_engine import AsyncEngine
from vlmrun.engine.engine import Engine
from vlmrun.server.launch import serve_in_thread
from vlmrun.server.memory import share_one_arena
from vlmrun.server.settings import ServerSettings

MODEL = "m"


@dataclass(frozen=True)
class Hostile:
    """One hostile request: its name, path, body (a dict, or raw JSON bytes) and client timeout."""

    name: str
    path: str
    body: Any
    timeout_s: float


def rss_bytes(pid: int) -> int:
    """The resident set size of process `pid` (Linux /proc; 0 once it is gone)."""
    try:
        fh = open(f"/proc/{pid}/status")
    except OSError:
        return 0
    with fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def png_uri(side: int = 64, seed: int = 0) -> str:
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, size=(side, side, 3), dtype=np.uint8)).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def normal_requests() -> list[tuple[str, dict[str, Any]]]:
    image = {"type": "image_url", "image_url": {"url": png_uri()}}
    return [("/v1/completions", {"model": MODEL, "prompt": "A red circle", "max_tokens": 3, "temperature": 0}),
            ("/v1/chat/completions", {"model": MODEL, "max_tokens": 3, "temperature": 0, "messages": [
                {"role": "user", "content": [image, {"type": "text", "text": "What is in the picture?"}]}]})]


def answer_of(body: dict[str, Any]) -> str:
    choice = body["choices"][0]
    return choice["text"] if "text" in choice else choice["message"]["content"]


def hostile_requests(huge_mb: int, video: Optional[str], silent_url: Optional[str] = None) -> list[Hostile]:
    """The hostile cycle, by name."""
    huge = json.dumps({"prompt": "x" * (huge_mb << 20)}).encode()
    huge_completion = json.dumps({"model": MODEL, "prompt": "y" * (huge_mb << 20), "max_tokens": 3}).encode()
    many_words = [f"w{i}" for i in range(100_000)]
    enum_schema = {"type": "object", "properties": {"a": {"enum": [f"v{i:05d}" for i in range(6_000)]}}}
    depth = 5_000
    nested_schema = (b'{"model": "m", "max_tokens": 3, "messages": [{"role": "user", "content": "Hi"}], '
                     b'"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": '
                     + b'{"type": "object", "properties": {"a": ' * depth + b'{}' + b'}}' * depth + b'}}}')

    def chat(content: Any, **extra: Any) -> dict[str, Any]:
        return {"model": MODEL, "max_tokens": 3, "messages": [{"role": "user", "content": content}], **extra}

    def image(url: str) -> list[dict[str, Any]]:
        return [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "What is it?"}]

    out = [
        Hostile("choice_100k", "/v1/completions", {"model": MODEL, "prompt": "Pick", "max_tokens": 3, "structured_outputs":
                                                   {"choice": [f"choice {i}" for i in range(100_000)]}}, 1.0),
        Hostile("schema_enum_left", "/v1/chat/completions", chat("Pick", response_format={
            "type": "json_schema", "json_schema": {"name": "e", "schema": enum_schema}}), 1.0),
        Hostile("tokenize_huge", "/tokenize", huge, 60.0),
        Hostile("completion_huge", "/v1/completions", huge_completion, 60.0),
        Hostile("bad_words_100k", "/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 3,
                                                      "bad_words": many_words}, 60.0),
        Hostile("bad_words_1024_stream", "/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 8,
                                                             "stream": True,
                                                             "bad_words": [f"word{i}" for i in range(1024)]}, 60.0),
        Hostile("lone_surrogate", "/tokenize", b'{"prompt": "abc \\ud800 def"}', 10.0),
        Hostile("logit_bias_100k", "/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 3,
                                                       "logit_bias": {str(i): 1 for i in range(100_000)}}, 60.0),
        Hostile("messages_100k", "/v1/chat/completions", {"model": MODEL, "max_tokens": 3, "messages": [
            {"role": "user", "content": "x"}] * 100_000}, 60.0),
        Hostile("data_url_huge", "/v1/chat/completions", chat(image("data:image/png;base64," + "A" * (huge_mb << 20))),
                60.0),
        Hostile("schema_nested", "/v1/chat/completions", nested_schema, 60.0),
        Hostile("png_bomb", "/v1/chat/completions", chat(image(png_bomb_uri())), 60.0),
        Hostile("huge_numbers", "/v1/chat/completions", chat("Hi", n=10**6, max_tokens=10**12, top_logprobs=10**6,
                                                             logprobs=True, seed=2**70), 10.0),
    ]
    if silent_url is not None:
        out.append(Hostile("url_never_answers", "/v1/chat/completions", chat(image(silent_url)), 60.0))
    if video is not None:
        part = {"type": "video_url", "video_url": {"url": video}}
        out.append(Hostile("video_past_context", "/v1/chat/completions", chat(
            [part, {"type": "text", "text": "What happens?"}], mm_processor_kwargs={"fps": 30.0, "max_pixels": 10**8}),
            60.0))
    return out


def png_bomb_uri(side: int = 20_000) -> str:
    """A data URI of a `side` x `side` one-bit PNG: a few hundred kB that would decode to `side`² pixels."""
    buf = io.BytesIO()
    Image.new("1", (side, side)).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


class SilentServer:
    """A local socket that accepts connections and never answers (an image URL that never answers)."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(256)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}/picture.png"

    def close(self) -> None:
        self.sock.close()


def make_video() -> Optional[str]:
    """A data URI of a short clip, or None without a video decoder."""
    try:
        from testing.videos import write_video
        from vlmrun.processors.video_io import video_decoder

        if video_decoder() != "torchcodec":
            return None
        with tempfile.TemporaryDirectory() as tmp:
            path = write_video(Path(tmp) / "clip.mp4", 60, 320, 320, 30.0, seed=3)
            return "data:video/mp4;base64," + base64.b64encode(path.read_bytes()).decode()
    except Exception:  # no encoder here: the soak runs without the video ask
        return None


class Phase:
    """The normal clients' results in one phase."""

    def __init__(self, name: str):
        self.name = name
        self.latencies: list[float] = []
        self.changed = 0
        self.failed = 0

    def report(self) -> dict[str, Any]:
        lat = sorted(self.latencies)
        pct = (lambda q: lat[min(len(lat) - 1, int(q * len(lat)))] * 1e3) if lat else (lambda q: float("nan"))
        return {"phase": self.name, "requests": len(lat), "p50_ms": round(pct(0.5), 1), "p99_ms": round(pct(0.99), 1),
                "max_ms": round(lat[-1] * 1e3, 1) if lat else None, "changed": self.changed, "failed": self.failed}


def run_normal(base_url: str, stop: threading.Event, phase: Callable[[], Phase], expected: dict[int, str],
               seed: int) -> None:
    requests = normal_requests()
    with httpx.Client(base_url=base_url, timeout=120) as client:
        for k in itertools.count(seed):
            if stop.is_set():
                return
            path, body = requests[k % len(requests)]
            current = phase()
            start = time.perf_counter()
            try:
                r = client.post(path, json=body)
            except httpx.HTTPError:
                current.failed += 1
                continue
            current.latencies.append(time.perf_counter() - start)
            if r.status_code != 200:
                current.failed += 1
            elif expected.setdefault(k % len(requests), answer_of(r.json())) != answer_of(r.json()):
                current.changed += 1


def run_hostile(base_url: str, stop: threading.Event, cycle: list[Hostile], statuses: Counter, seed: int) -> None:
    for k in itertools.count(seed):
        if stop.is_set():
            return
        h = cycle[k % len(cycle)]
        try:
            with httpx.Client(base_url=base_url, timeout=h.timeout_s) as client:
                if isinstance(h.body, bytes):
                    r = client.post(h.path, content=h.body, headers={"content-type": "application/json"})
                else:
                    r = client.post(h.path, json=h.body)
            statuses[(h.name, r.status_code)] += 1
        except httpx.TimeoutException:
            statuses[(h.name, "client left")] += 1
        except httpx.HTTPError as exc:
            statuses[(h.name, type(exc).__name__)] += 1


def serve(model: Optional[str]) -> None:
    """The child: the server on 127.0.0.1 (a free port, printed as `PORT n`) until stdin closes."""
    share_one_arena()  # as `vlmrun serve` does, before any thread starts
    hide_flash_linear_attention()
    engine = AsyncEngine(Engine(EngineConfig(model=model, dtype="float32", device="cpu"))).start()
    # private URLs allowed: the URL that never answers is a local socket (nothing here reaches the network)
    server = serve_in_thread(engine, ServerSettings(served_model_name=MODEL, allow_private_urls=True))
    print(f"PORT {server.port}", flush=True)
    try:
        sys.stdin.read()
    finally:
        server.stop()
        engine.shutdown()


def start_server(model: Optional[str]) -> tuple[subprocess.Popen, str]:
    args = [sys.executable, "-m", "bench.bench_soak", "--serve"] + (["--model", model] if model else [])
    child = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=os.environ.copy())
    assert child.stdout is not None
    for line in child.stdout:
        if line.startswith("PORT "):
            return child, f"http://127.0.0.1:{int(line.split()[1])}"
    raise RuntimeError(f"the server did not start (exit code {child.wait()})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="checkpoint dir (default: the bundled model)")
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)  # the child's mode
    parser.add_argument("--phase-s", type=float, default=20.0, help="seconds of each of the three phases")
    parser.add_argument("--normal-clients", type=int, default=4)
    parser.add_argument("--hostile-clients", type=int, default=2)
    parser.add_argument("--huge-mb", type=int, default=50, help="size of the huge /tokenize and completion bodies")
    parser.add_argument("--only", default=None, help="comma-separated names (or indices) of the hostile kinds to send")
    parser.add_argument("--json", action="store_true", help="print the report as one JSON object")
    args = parser.parse_args()
    if args.serve:
        serve(args.model)
        return

    child, base_url = start_server(args.model)
    silent = SilentServer()
    cycle = hostile_requests(args.huge_mb, make_video(), silent.url)
    if args.only:
        names = args.only.split(",")
        cycle = [h for i, h in enumerate(cycle) if h.name in names or str(i) in names]
    phases = [Phase("baseline"), Phase("hostile"), Phase("after")]
    current = [phases[0]]
    expected: dict[int, str] = {}
    statuses: Counter = Counter()
    rss: dict[str, int] = {}
    peak = [0]
    stop_normal, stop_hostile, stop_sampler = threading.Event(), threading.Event(), threading.Event()

    def sample_rss() -> None:
        while not stop_sampler.wait(0.1):
            peak[0] = max(peak[0], rss_bytes(child.pid))

    try:
        normal = [threading.Thread(target=run_normal, args=(base_url, stop_normal, lambda: current[0], expected,
                                                            i), daemon=True) for i in range(args.normal_clients)]
        for t in normal:
            t.start()
        time.sleep(args.phase_s)
        rss["before"] = rss_bytes(child.pid)
        sampler = threading.Thread(target=sample_rss, daemon=True)
        sampler.start()
        current[0] = phases[1]
        hostile = [threading.Thread(target=run_hostile, args=(base_url, stop_hostile, cycle, statuses, i * 3),
                                    daemon=True) for i in range(args.hostile_clients)]
        for t in hostile:
            t.start()
        time.sleep(args.phase_s)
        stop_hostile.set()
        for t in hostile:
            t.join(timeout=120)
        current[0] = phases[2]
        time.sleep(args.phase_s)
        rss["after"] = rss_bytes(child.pid)
        stop_normal.set()
        for t in normal:
            t.join(timeout=120)
        stop_sampler.set()
    finally:
        stop_normal.set()
        stop_hostile.set()
        stop_sampler.set()
        assert child.stdin is not None
        silent.close()
        child.stdin.close()  # the server stops
        try:
            child.wait(timeout=60)
        except subprocess.TimeoutExpired:
            child.kill()
    report = {"phases": [p.report() for p in phases],
              "rss_mb": {"before": rss["before"] >> 20, "peak": peak[0] >> 20, "after": rss["after"] >> 20},
              "hostile": {f"{kind} -> {status}": n for (kind, status), n in sorted(statuses.items(), key=str)},
              "hostile_5xx": sum(n for (_, status), n in statuses.items() if isinstance(status, int) and status >= 500)}
    if args.json:
        print(json.dumps(report))
        return
    for p in report["phases"]:
        print(f"{p['phase']:>8}: {p['requests']:5d} normal requests, p50 {p['p50_ms']:8.1f} ms, "
              f"p99 {p['p99_ms']:8.1f} ms, max {p['max_ms']} ms, changed {p['changed']}, failed {p['failed']}")
    r = report["rss_mb"]
    print(f"server RSS: before {r['before']} MB, peak {r['peak']} MB, after {r['after']} MB "
          f"({(r['after'] - r['before']) / max(r['before'], 1):+.1%})")
    for line, n in report["hostile"].items():
        print(f"  hostile {line}: {n}")
    print(f"hostile 5xx answers: {report['hostile_5xx']}")


if __name__ == "__main__":
    main()
