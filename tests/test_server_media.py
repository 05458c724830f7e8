"""Where the server may fetch images from: the address policy, the bounded fetcher, local paths.

A small HTTP server on 127.0.0.1 plays the image host. Names like `public.test` are mapped to
addresses by an injected resolver, so redirects between "public" and "private" hosts can be
tested without any real DNS or network.
"""

from __future__ import annotations

import http.server
import os
import threading
import time
from typing import Iterator

import httpx
import pytest

from vlmrun.processors import InputError
from tests.server_fixtures import tiny_engine
from tests.test_server import data_uri, image_part, picture, png_bytes
from vlmrun.server import media
from vlmrun.server.launch import serve_in_thread
from vlmrun.server.media import MediaPolicy, MediaResolver, address_refusal
from vlmrun.server.settings import ServerSettings

PNG = png_bytes(picture(48, 32, 9))
BIG = b"\x89PNG" + b"\x00" * (300 << 10)


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:  # quiet
        pass

    def _send(self, status: int, body: bytes = b"", headers: dict | None = None, length: bool = True) -> None:
        self.send_response(status)
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        if length:
            self.send_header("Content-Length", str(len(body)))
        else:
            self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        path = self.path
        if path == "/img.png":
            self._send(200, PNG, {"Content-Type": "image/png"})
        elif path == "/big":
            self._send(200, BIG)
        elif path == "/big-unsized":
            self.close_connection = True
            self._send(200, BIG, length=False)
        elif path == "/slow":
            time.sleep(3)
            self._send(200, PNG)
        elif path == "/to-internal":
            self._send(302, headers={"Location": f"http://internal.test:{self.server.server_port}/img.png"})
        elif path == "/to-img":
            self._send(301, headers={"Location": "/img.png"})
        elif path == "/loop":
            self._send(302, headers={"Location": "/loop"})
        else:
            self._send(404, b"no")


@pytest.fixture(scope="module")
def image_host() -> Iterator[str]:
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    srv.daemon_threads = True
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    yield f"127.0.0.1:{srv.server_port}"
    srv.shutdown()
    srv.server_close()


def fake_dns(host: str, port: int) -> list[str]:
    table = {"public.test": ["127.0.0.1"], "internal.test": ["127.0.0.2"], "127.0.0.1": ["127.0.0.1"]}
    if host not in table:
        raise InputError(f"cannot resolve {host!r}")
    return table[host]


def pretend_public(monkeypatch) -> None:
    """Treat 127.0.0.1 as public (the test host), every other address by the real rules."""
    real = media.address_refusal
    monkeypatch.setattr(media, "address_refusal", lambda a: None if a == "127.0.0.1" else real(a))


@pytest.mark.parametrize("address, why", [
    ("10.0.0.1", "private"), ("172.16.5.4", "private"), ("192.168.1.1", "private"), ("127.0.0.1", "loopback"),
    ("127.8.9.10", "loopback"), ("::1", "loopback"), ("169.254.169.254", "link-local"), ("fe80::1", "link-local"),
    ("::ffff:127.0.0.1", "loopback"), ("::ffff:10.0.0.1", "private"), ("0.0.0.0", "unspecified"),
    ("100.64.0.1", "non-public"), ("224.0.0.1", "multicast"), ("fc00::1", "private"),
    ("8.8.8.8", None), ("93.184.215.14", None), ("2606:4700:4700::1111", None),
])
def test_address_policy(address, why):
    refusal = address_refusal(address)
    assert (refusal is None) if why is None else (why in refusal)


def test_private_hosts_are_refused_before_any_connection(image_host):
    strict = MediaResolver(MediaPolicy())
    with pytest.raises(InputError, match="loopback"):
        strict.fetch(f"http://{image_host}/img.png")
    with pytest.raises(InputError, match="loopback"):
        strict.fetch("http://localhost/img.png")
    no_urls = MediaResolver(MediaPolicy(allow_remote_urls=False))
    with pytest.raises(InputError, match="data: URI"):
        no_urls.fetch("http://example.com/cat.png")
    with pytest.raises(InputError, match="credentials"):
        strict.fetch("http://user:pw@example.com/cat.png")


def test_fetch_with_private_urls_allowed(image_host):
    lax = MediaResolver(MediaPolicy(allow_private_urls=True, url_timeout_s=5))
    assert lax.fetch(f"http://{image_host}/img.png") == PNG
    assert lax.fetch(f"http://{image_host}/to-img") == PNG  # a relative redirect
    with pytest.raises(InputError, match="HTTP 404"):
        lax.fetch(f"http://{image_host}/missing")
    with pytest.raises(InputError, match="redirected more than"):
        lax.fetch(f"http://{image_host}/loop")


def test_size_cap_and_timeout(image_host):
    small = MediaResolver(MediaPolicy(allow_private_urls=True, max_image_bytes=100 << 10, url_timeout_s=0.5))
    with pytest.raises(InputError, match="more than the limit"):
        small.fetch(f"http://{image_host}/big")
    with pytest.raises(InputError, match="more than the limit"):
        small.fetch(f"http://{image_host}/big-unsized")
    start = time.monotonic()
    with pytest.raises(InputError, match="timed out"):
        small.fetch(f"http://{image_host}/slow")
    assert time.monotonic() - start < 2.0


def test_each_redirect_hop_is_checked_and_connections_are_pinned(image_host, monkeypatch):
    pretend_public(monkeypatch)
    port = image_host.split(":")[1]
    resolver = MediaResolver(MediaPolicy(), resolver=fake_dns)
    # public.test is not a real name: the connection goes to the vetted address from the resolver
    assert resolver.fetch(f"http://public.test:{port}/img.png") == PNG
    with pytest.raises(InputError, match="loopback address \\(127.0.0.2\\)"):
        resolver.fetch(f"http://public.test:{port}/to-internal")


def test_local_paths(tmp_path):
    root = tmp_path / "media"
    (root / "sub").mkdir(parents=True)
    (root / "sub" / "a.png").write_bytes(PNG)
    (tmp_path / "secret.png").write_bytes(PNG)
    os.symlink(tmp_path / "secret.png", root / "link.png")
    allowed = MediaResolver(MediaPolicy(allowed_local_media_path=str(root)))
    assert allowed.resolve_source(str(root / "sub" / "a.png")) == PNG
    assert allowed.resolve_source("sub/a.png") == PNG
    assert allowed.resolve_source(f"file://{root}/sub/a.png") == PNG
    for escape in ("../secret.png", str(tmp_path / "secret.png"), "link.png", f"file://{tmp_path}/secret.png"):
        with pytest.raises(InputError, match="outside the allowed"):
            allowed.resolve_source(escape)
    with pytest.raises(InputError, match="not found"):
        allowed.resolve_source("sub/missing.png")
    with pytest.raises(InputError, match="not accepted"):
        MediaResolver(MediaPolicy()).resolve_source(str(root / "sub" / "a.png"))


def test_messages_are_rewritten_to_bytes(tmp_path):
    (tmp_path / "a.png").write_bytes(PNG)
    resolver = MediaResolver(MediaPolicy(allowed_local_media_path=str(tmp_path)))
    uri = data_uri(PNG)
    messages = [{"role": "system", "content": "be brief"},
                {"role": "user", "content": [image_part(uri), {"type": "image", "image": "a.png", "max_pixels": 5000},
                                             {"type": "text", "text": "hi"}]}]
    out = resolver.resolve_messages(messages)
    assert out[0] == messages[0]
    items = out[1]["content"]
    assert items[0] == {"type": "image", "image": uri}
    assert items[1] == {"type": "image", "image": PNG, "max_pixels": 5000}
    assert items[2] == {"type": "text", "text": "hi"}
    with pytest.raises(InputError, match="image 2"):
        resolver.resolve_messages([{"role": "user", "content": [image_part(uri), image_part("/etc/passwd")]}])


def test_server_fetches_urls_and_local_files_when_allowed(qwen3_vl_dir, image_host, tmp_path):
    (tmp_path / "local.png").write_bytes(PNG)
    engine = tiny_engine(qwen3_vl_dir, max_model_len=512)
    srv = serve_in_thread(engine, ServerSettings(served_model_name="m", allow_private_urls=True,
                                                 allowed_local_media_path=str(tmp_path)))
    try:
        def ask(*urls: str) -> httpx.Response:
            content = [image_part(u) for u in urls] + [{"type": "text", "text": "what?"}]
            return httpx.post(srv.base_url + "/v1/chat/completions", timeout=30, json={
                "model": "m", "max_tokens": 2, "temperature": 0, "messages": [{"role": "user", "content": content}]})

        by_url = ask(f"http://{image_host}/img.png")
        by_path = ask("local.png")
        by_data = ask(data_uri(PNG))
        for r in (by_url, by_path, by_data):
            assert r.status_code == 200, r.text
        # the same picture from three places: the same prompt, the same greedy answer
        assert by_url.json()["usage"] == by_path.json()["usage"] == by_data.json()["usage"]
        assert by_url.json()["choices"][0]["message"] == by_data.json()["choices"][0]["message"]
        r = ask(f"http://{image_host}/missing")
        assert r.status_code == 400 and "HTTP 404" in r.json()["error"]["message"]
        r = ask("../outside.png")
        assert r.status_code == 400 and "outside the allowed" in r.json()["error"]["message"]
    finally:
        srv.stop()
        engine.shutdown()
