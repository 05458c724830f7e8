"""How much one client's heavy image requests slow another client's small request, on the server.

The bundled default model behind `vlmrun serve`'s app in this process (loopback). Idle first: the
latency of a small text chat request (2 output tokens), one at a time. Then `--heavy-clients`
threads each send, back to back, a chat request with `--images` JPEGs of `--megapixels` MP as data
URIs (decoded and resized on the server); while they run, the small request is timed again. Prints
median and worst latencies, idle and beside the heavy load, and their ratio; and the CPU's name.

    python -m bench.bench_server_fairness [--heavy-clients 4] [--images 4] [--megapixels 12] [--small 20]
"""

from __future__ import annotations

import argparse
import base64
import io
import statistics
import threading
import time

import httpx
import numpy as np
from PIL import Image

from bench.common import hide_flash_linear_attention
from vlmrun.config import EngineConfig
from vlmrun.engine.async_engine import AsyncEngine
from vlmrun.engine.engine import Engine
from vlmrun.layers.cpu_kernels import cpu_features
from vlmrun.server.launch import serve_in_thread
from vlmrun.server.settings import ServerSettings

SMALL = {"model": "m", "max_tokens": 2, "temperature": 0, "messages": [{"role": "user", "content": "Say hi."}]}


def jpeg_data_uri(megapixels: float, seed: int) -> str:
    side = int((megapixels * 1e6) ** 0.5)
    rng = np.random.default_rng(seed)
    small = rng.integers(0, 256, size=(side // 16, side // 16, 3), dtype=np.uint8)
    image = Image.fromarray(small).resize((side, side), Image.Resampling.BILINEAR)  # smooth: a photo-sized JPEG
    buf = io.BytesIO()
    image.save(buf, format="JPEG", quality=90)
    return "data:image/jpeg;base64," + base64.b64encode(buf.getvalue()).decode()


def small_latencies(client: httpx.Client, n: int) -> list[float]:
    out = []
    for _ in range(n):
        start = time.perf_counter()
        r = client.post("/v1/chat/completions", json=SMALL)
        r.raise_for_status()
        out.append(time.perf_counter() - start)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--heavy-clients", type=int, default=4)
    parser.add_argument("--images", type=int, default=4)
    parser.add_argument("--megapixels", type=float, default=12.0)
    parser.add_argument("--small", type=int, default=20, help="small requests timed, idle and under load")
    args = parser.parse_args()
    hide_flash_linear_attention()

    print(f"CPU: {cpu_features().describe()}", flush=True)
    engine = AsyncEngine(Engine(EngineConfig(dtype="float32", device="cpu"))).start()
    server = serve_in_thread(engine, ServerSettings(served_model_name="m"))
    uris = [jpeg_data_uri(args.megapixels, seed) for seed in range(args.images)]
    heavy = {"model": "m", "max_tokens": 2, "temperature": 0, "messages": [{"role": "user", "content": [
        *({"type": "image_url", "image_url": {"url": u}} for u in uris), {"type": "text", "text": "Describe."}]}]}
    print(f"heavy request: {args.images} JPEGs of {args.megapixels:g} MP, "
          f"{sum(len(u) for u in uris) / 1e6:.1f} MB of JSON", flush=True)
    stop = threading.Event()
    heavy_times: list[float] = []

    def heavy_client() -> None:
        with httpx.Client(base_url=server.base_url, timeout=600) as client:
            while not stop.is_set():
                start = time.perf_counter()
                client.post("/v1/chat/completions", json=heavy).raise_for_status()
                heavy_times.append(time.perf_counter() - start)

    try:
        with httpx.Client(base_url=server.base_url, timeout=600) as client:
            small_latencies(client, 3)  # warm-up
            idle = small_latencies(client, args.small)
            threads = [threading.Thread(target=heavy_client, daemon=True) for _ in range(args.heavy_clients)]
            for t in threads:
                t.start()
            time.sleep(1.0)  # the heavy requests are under way
            loaded = small_latencies(client, args.small)
            stop.set()
            for t in threads:
                t.join(timeout=600)
    finally:
        server.stop()
        engine.shutdown()
    med_idle, med_loaded = statistics.median(idle), statistics.median(loaded)
    print(f"small request idle:        median {med_idle * 1e3:8.1f} ms, worst {max(idle) * 1e3:8.1f} ms")
    print(f"beside {args.heavy_clients} heavy clients: median {med_loaded * 1e3:8.1f} ms, worst {max(loaded) * 1e3:8.1f} ms"
          f" -> {med_loaded / med_idle:.1f}x median, {max(loaded) / med_idle:.1f}x worst / idle median")
    if heavy_times:
        print(f"heavy requests: {len(heavy_times)} done, median {statistics.median(heavy_times):.2f} s each")


if __name__ == "__main__":
    main()
