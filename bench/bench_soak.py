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
- a lone surrogate to /tokenize; a video asked at a size past the context (when torchcodec is there).

Every hostile answer must be a 4xx (or a 200); the report counts them by status. Reported: per phase,
the normal requests' count, p50 / p99 / max latency and answers that changed or failed; the server
process's RSS before the hostile phase, at its peak and after. Bounded: three phases, each request with
a timeout; it stops by itself, and the server with it (the child exits when its stdin closes).
Figures on a loaded machine say little: the clients share its cores with the server.

    python -m bench.bench_soak [--phase-s 20] [--normal-clients 4] [--hostile-clients 2] [--huge-mb 50]
"""

from __future__ import annotations

import argparse
import base64
import io
import itertools
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
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


def hostile_requests(huge_mb: int, video: Optional[str]) -> list[tuple[str, Any, float]]:
    """(path, body (a dict, or raw JSON bytes), client timeout): the hostile cycle."""
    huge = json.dumps({"prompt": "x" * (huge_mb << 20)}).encode()
    huge_completion = json.dumps({"model": MODEL, "prompt": "y" * (huge_mb << 20), "max_tokens": 3}).encode()
    many_words = [f"w{i}" for i in range(100_000)]
    enum_schema = {"type": "object", "properties": {"a": {"enum": [f"v{i:05d}" for i in range(6_000)]}}}
    out: list[tuple[str, Any, float]] = [
        ("/v1/completions", {"model": MODEL, "prompt": "Pick", "max_tokens": 3,
                             "structured_outputs": {"choice": [f"choice {i}" for i in range(100_000)]}}, 1.0),
        ("/v1/chat/completions", {"model": MODEL, "max_tokens": 3, "messages": [{"role": "user", "content": "Pick"}],
                                  "response_format": {"type": "json_schema",
                                                      "json_schema": {"name": "e", "schema": enum_schema}}}, 1.0),
        ("/tokenize", huge, 60.0),
        ("/v1/completions", huge_completion, 60.0),
        ("/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 3, "bad_words": many_words}, 60.0),
        ("/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 8, "stream": True,
                             "bad_words": [f"word{i}" for i in range(1024)]}, 60.0),
        ("/tokenize", b'{"prompt": "abc \\ud800 def"}', 10.0),
    ]
    if video is not None:
        part = {"type": "video_url", "video_url": {"url": video}}
        out.append(("/v1/chat/completions", {"model": MODEL, "max_tokens": 3, "messages": [{"role": "user", "content": [
            part, {"type": "text", "text": "What happens?"}]}], "mm_processor_kwargs": {"fps": 30.0,
                                                                                          "max_pixels": 10**8}}, 60.0))
    return out


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


def run_hostile(base_url: str, stop: threading.Event, cycle: list[tuple[str, Any, float]], statuses: Counter,
                seed: int) -> None:
    for k in itertools.count(seed):
        if stop.is_set():
            return
        path, body, timeout = cycle[k % len(cycle)]
        kind = f"{path} #{k % len(cycle)}"
        try:
            with httpx.Client(base_url=base_url, timeout=timeout) as client:
                if isinstance(body, bytes):
                    r = client.post(path, content=body, headers={"content-type": "application/json"})
                else:
                    r = client.post(path, json=body)
            statuses[(kind, r.status_code)] += 1
        except httpx.TimeoutException:
            statuses[(kind, "client left")] += 1
        except httpx.HTTPError as exc:
            statuses[(kind, type(exc).__name__)] += 1


def serve(model: Optional[str]) -> None:
    """The child: the server on 127.0.0.1 (a free port, printed as `PORT n`) until stdin closes."""
    share_one_arena()  # as `vlmrun serve` does, before any thread starts
    hide_flash_linear_attention()
    engine = AsyncEngine(Engine(EngineConfig(model=model, dtype="float32", device="cpu"))).start()
    server = serve_in_thread(engine, ServerSettings(served_model_name=MODEL))
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
    parser.add_argument("--only", default=None, help="comma-separated indices of the hostile cycle to send")
    parser.add_argument("--json", action="store_true", help="print the report as one JSON object")
    args = parser.parse_args()
    if args.serve:
        serve(args.model)
        return

    child, base_url = start_server(args.model)
    cycle = hostile_requests(args.huge_mb, make_video())
    if args.only:
        cycle = [cycle[int(i)] for i in args.only.split(",")]
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
