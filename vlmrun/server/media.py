"""Where the server may get images and videos from, and getting them: the address policy for URLs, the
directory policy for local paths, and a bounded fetcher.

The processors can load any source, but a server facing clients must not let them make it read
arbitrary files or reach internal services. So the server resolves every image source itself,
before the processors see it:

- `data:` URIs pass through unchanged (the processors decode them, with their byte cap);
- `http(s)` URLs are fetched here: the host is resolved once, every address it resolves to must
  be public (not private, loopback, link-local, multicast, reserved or unspecified) unless
  `allow_private_urls`, and the connection goes to that vetted address (so a second DNS answer
  cannot swap in another one). Redirects are followed by hand, each hop checked the same way.
  One total deadline covers the whole fetch; the body is capped at `max_image_bytes`
  (`max_video_bytes` for a video);
- local paths and `file://` URIs are read only when they resolve (symlinks included) inside
  `allowed_local_media_path`; relative paths are taken relative to it.

Messages that fetch (`fetches`) are resolved in the server's fetch pool before their preparation, so a
URL that never answers holds a fetch thread until its deadline, never a thread that decodes media.
The processors then receive bytes, so the server's `Processor` runs with local paths and URLs
switched off (a second line of defence). The fetcher connects directly: proxy environment
variables are not used (a proxy would hide the address that the policy checks).
"""

from __future__ import annotations

import base64
import dataclasses
import http.client
import io
import ipaddress
import os
import socket
import ssl
import time
import urllib.parse
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, Sequence

from vlmrun.processors import InputError
from vlmrun.processors.chat import IMAGE_SOURCE_KEYS, VIDEO_SOURCE_KEYS, item_source
from vlmrun.processors.video_processor import VIDEO_OPTION_KEYS

_REDIRECTS = (301, 302, 303, 307, 308)
_CHUNK = 1 << 16
_USER_AGENT = "vlmrun-server/1"
_IMAGE_TYPES = ("image", "image_url", "input_image")
_SIZE_KEYS = ("min_pixels", "max_pixels", "resized_height", "resized_width")
_VIDEO_TYPES = ("video", "video_url", "input_video")
HEADER_PEEK_BYTES = 64 << 10  # of an image, to read its declared size (`MediaResolver.declared_pixels`)

Resolver = Callable[[str, int], list[str]]


@dataclass(frozen=True)
class MediaPolicy:
    allow_remote_urls: bool = True
    allow_private_urls: bool = False
    allowed_local_media_path: Optional[str] = None
    url_timeout_s: float = 10.0
    max_image_bytes: int = 20 << 20
    max_redirects: int = 3
    max_video_bytes: int = 200 << 20


def system_resolver(host: str, port: int) -> list[str]:
    """Every address `host` resolves to (IPv4 and IPv6)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise InputError(f"cannot resolve the image URL's host {host!r}: {exc.strerror or exc}") from None
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


def address_refusal(address: str) -> Optional[str]:
    """Why `address` may not be fetched from by default, or None when it is a public address."""
    ip = ipaddress.ip_address(address.split("%", 1)[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    for attr, what in (("is_loopback", "a loopback"), ("is_link_local", "a link-local"),
                       ("is_unspecified", "an unspecified"), ("is_multicast", "a multicast"),
                       ("is_private", "a private"), ("is_reserved", "a reserved")):
        if getattr(ip, attr):
            return f"{what} address"
    if not ip.is_global:
        return "a non-public address"
    return None


class MediaResolver:
    """Turns the image sources of chat messages into bytes (or data URIs) under a `MediaPolicy`."""

    def __init__(self, policy: MediaPolicy, resolver: Resolver = system_resolver, media: str = "image"):
        self.policy = policy
        self.media = media  # the word error messages use: "image" or "video"
        self._resolve_host = resolver
        root = policy.allowed_local_media_path
        self._root = os.path.realpath(root) if root else None

    # ------------------------------------------------------------------ messages

    def resolve_messages(self, messages: Any) -> Any:
        """A copy of `messages` whose image items hold bytes or data URIs; other items unchanged.

        Malformed messages are passed through untouched: the processors reject them with a
        precise message. Images are numbered in order of appearance for error messages.
        """
        if not isinstance(messages, list):
            return messages
        counts = {"image": 0, "video": 0}
        out = []
        for message in messages:
            content = message.get("content") if isinstance(message, Mapping) else None
            if not isinstance(content, list):
                out.append(message)
                continue
            items = []
            for item in content:
                kind = _media_kind(item)
                if kind is not None:
                    counts[kind] += 1
                    item = self._resolve_item(item, counts[kind], kind)
                items.append(item)
            out.append({**message, "content": items})
        return out

    def declared_pixels(self, messages: Any) -> int:
        """The pixels the images of `messages` (data URIs or bytes, as resolved) declare in their headers,
        read from their first `HEADER_PEEK_BYTES` without decoding; an image whose header is not there
        counts 0 (the processors judge it)."""
        total = 0
        for message in messages if isinstance(messages, list) else ():
            content = message.get("content") if isinstance(message, Mapping) else None
            for item in content if isinstance(content, list) else ():
                if _media_kind(item) == "image":
                    total += _header_pixels(item_source(item, IMAGE_SOURCE_KEYS))
        return total

    def fetches(self, messages: Any) -> bool:
        """Whether resolving `messages` reads a URL or a file (waits the fetch pool takes, `state.py`)."""
        for message in messages if isinstance(messages, list) else ():
            content = message.get("content") if isinstance(message, Mapping) else None
            for item in content if isinstance(content, list) else ():
                kind = _media_kind(item)
                if kind is not None:
                    source = item_source(item, IMAGE_SOURCE_KEYS if kind == "image" else VIDEO_SOURCE_KEYS)
                    if isinstance(source, str) and not source.strip()[:10].lower().startswith("data:"):
                        return True
        return False

    def _resolve_item(self, item: Mapping[str, Any], number: int, kind: str = "image") -> Any:
        """An image (video) item with its source as bytes or a data URI, capped at `max_image_bytes`
        (`max_video_bytes`). Frame lists are left to the processors (which refuse paths and URLs here)."""
        if kind == "image":
            keys, options, resolver = IMAGE_SOURCE_KEYS, _SIZE_KEYS, self
        else:
            keys, options = VIDEO_SOURCE_KEYS, VIDEO_OPTION_KEYS
            resolver = MediaResolver(dataclasses.replace(self.policy, max_image_bytes=self.policy.max_video_bytes),
                                     self._resolve_host, media="video")
        source = item_source(item, keys)
        if not isinstance(source, str) or not source.strip():
            return item  # the processors explain what is missing
        try:
            resolved = resolver.resolve_source(source.strip())
        except InputError as exc:
            raise InputError(f"{kind} {number}: {exc}") from None
        new = {"type": kind, kind: resolved}
        new.update({k: item[k] for k in options if item.get(k) is not None})
        return new

    # ------------------------------------------------------------------ one source

    def resolve_source(self, source: str) -> Any:
        head = source[:10].lower()
        if head.startswith("data:"):
            return source
        if head.startswith(("http://", "https://")):
            return self.fetch(source)
        if head.startswith("file://"):
            return self.read_local(_file_uri_path(source))
        if "://" in source[:16]:
            scheme = source.split("://", 1)[0]
            raise InputError(f"unsupported {self.media} URL scheme {scheme!r}: use http(s)://, a data: URI or a "
                             "file path")
        return self.read_local(source)

    def read_local(self, path: str) -> bytes:
        if self._root is None:
            raise InputError(f"local {self.media} paths are not accepted by this server (send a data: URI or an "
                             "http(s) URL; the operator can allow a directory with --allowed-local-media-path)")
        real = os.path.realpath(os.path.join(self._root, path))
        if os.path.commonpath([real, self._root]) != self._root:
            raise InputError(f"the path {_short(path)} is outside the allowed media directory")
        try:
            size = os.stat(real).st_size
            if not os.path.isfile(real):
                raise InputError(f"{_short(path)} is not a file")
            if size > self.policy.max_image_bytes:
                raise InputError(f"{_short(path)} is {size:,} bytes, more than the limit of "
                                 f"{self.policy.max_image_bytes:,}")
            with open(real, "rb") as fh:
                return fh.read(self.policy.max_image_bytes + 1)
        except FileNotFoundError:
            raise InputError(f"{self.media} file {_short(path)} not found in the allowed media directory") from None
        except OSError as exc:
            raise InputError(f"{self.media} file {_short(path)} cannot be read: {exc.strerror or exc}") from None

    # ------------------------------------------------------------------ URLs

    def check_url(self, url: str) -> tuple[urllib.parse.SplitResult, list[str]]:
        """Parse and vet `url`; returns its parts and the addresses it may be fetched from."""
        if not self.policy.allow_remote_urls:
            raise InputError(f"{self.media} URLs are not accepted by this server: send the {self.media} as a data: URI")
        parts = urllib.parse.urlsplit(url)
        if parts.scheme.lower() not in ("http", "https"):
            raise InputError(f"unsupported {self.media} URL scheme {parts.scheme!r}")
        if parts.username or parts.password:
            raise InputError(f"{self.media} URLs with credentials are not accepted")
        host = parts.hostname
        if not host:
            raise InputError(f"the {self.media} URL {_short(url)} has no host")
        try:
            port = parts.port or (443 if parts.scheme.lower() == "https" else 80)
        except ValueError:
            raise InputError(f"the {self.media} URL {_short(url)} has an invalid port") from None
        addresses = self._resolve_host(host, port)
        if not addresses:
            raise InputError(f"the {self.media} URL's host {host!r} resolves to no address")
        if not self.policy.allow_private_urls:
            for address in addresses:
                why = address_refusal(address)
                if why is not None:
                    raise InputError(f"the {self.media} URL {_short(url)} points to {why} ({address}); this server "
                                     "only fetches from public addresses")
        return parts, addresses

    def fetch(self, url: str) -> bytes:
        """GET `url` under the policy: vetted addresses, redirects re-checked, deadline, byte cap."""
        deadline = time.monotonic() + self.policy.url_timeout_s
        current = url
        for _ in range(self.policy.max_redirects + 1):
            parts, addresses = self.check_url(current)
            status, location, body = self._get_once(parts, addresses, deadline, current)
            if status in _REDIRECTS:
                if not location:
                    raise InputError(f"the {self.media} URL {_short(current)} redirected without a Location")
                current = urllib.parse.urljoin(current, location)
                continue
            if status != 200:
                raise InputError(f"could not fetch the {self.media} URL {_short(current)}: HTTP {status}")
            return body
        raise InputError(f"the {self.media} URL {_short(url)} redirected more than {self.policy.max_redirects} times")

    def _get_once(self, parts: urllib.parse.SplitResult, addresses: Sequence[str], deadline: float,
                  url: str) -> tuple[int, Optional[str], bytes]:
        last_error: Optional[BaseException] = None
        for address in addresses:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            conn = _connection(parts, address, remaining)
            try:
                path = parts.path or "/"
                if parts.query:
                    path += "?" + parts.query
                conn.request("GET", path, headers={"User-Agent": _USER_AGENT, "Accept": f"{self.media}/*,*/*;q=0.5"})
                response = conn.getresponse()
                if response.status in _REDIRECTS:
                    return response.status, response.getheader("Location"), b""
                if response.status != 200:
                    return response.status, None, b""
                return 200, None, self._read_body(conn, response, deadline, url)
            except InputError:
                raise
            except (socket.timeout, TimeoutError):
                raise InputError(f"fetching the {self.media} URL {_short(url)} timed out after "
                                 f"{self.policy.url_timeout_s:g} s") from None
            except (OSError, http.client.HTTPException, ssl.SSLError) as exc:
                last_error = exc
            finally:
                conn.close()
        if last_error is None:
            raise InputError(f"fetching the {self.media} URL {_short(url)} timed out after "
                             f"{self.policy.url_timeout_s:g} s")
        raise InputError(f"could not fetch the {self.media} URL {_short(url)}: {last_error}")

    def _read_body(self, conn: http.client.HTTPConnection, response: http.client.HTTPResponse,
                   deadline: float, url: str) -> bytes:
        cap = self.policy.max_image_bytes
        declared = response.getheader("Content-Length")
        if declared is not None and declared.strip().isdigit() and int(declared) > cap:
            raise InputError(f"the {self.media} at {_short(url)} is {int(declared):,} bytes, more than the limit "
                             f"of {cap:,}")
        chunks: list[bytes] = []
        total = 0
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise InputError(f"fetching the {self.media} URL {_short(url)} timed out after "
                                 f"{self.policy.url_timeout_s:g} s")
            if conn.sock is not None:
                conn.sock.settimeout(remaining)
            chunk = response.read1(_CHUNK) if hasattr(response, "read1") else response.read(_CHUNK)
            if not chunk:
                break
            total += len(chunk)
            if total > cap:
                raise InputError(f"the {self.media} at {_short(url)} is more than the limit of {cap:,} bytes")
            chunks.append(chunk)
        if not chunks:
            raise InputError(f"the {self.media} at {_short(url)} is empty (0 bytes)")
        return b"".join(chunks)


# ---------------------------------------------------------------------------- connections


class _PinnedHTTPConnection(http.client.HTTPConnection):
    """An HTTP connection to `host` that connects to one vetted address."""

    def __init__(self, host: str, port: int, address: str, timeout: float):
        super().__init__(host, port, timeout=timeout)
        self._address = address

    def connect(self) -> None:
        self.sock = socket.create_connection((self._address, self.port), self.timeout)


class _PinnedHTTPSConnection(http.client.HTTPSConnection):
    """An HTTPS connection to `host` (certificate checked for `host`) over one vetted address."""

    def __init__(self, host: str, port: int, address: str, timeout: float, context: ssl.SSLContext):
        super().__init__(host, port, timeout=timeout, context=context)
        self._address = address
        self._tls = context

    def connect(self) -> None:
        raw = socket.create_connection((self._address, self.port), self.timeout)
        self.sock = self._tls.wrap_socket(raw, server_hostname=self.host)


def _connection(parts: urllib.parse.SplitResult, address: str, timeout: float) -> http.client.HTTPConnection:
    host = parts.hostname or ""
    if parts.scheme.lower() == "https":
        return _PinnedHTTPSConnection(host, parts.port or 443, address, timeout, ssl.create_default_context())
    return _PinnedHTTPConnection(host, parts.port or 80, address, timeout)


def _header_pixels(source: Any) -> int:
    """width x height from the header of an image given as a data URI or bytes; 0 when not found there."""
    if isinstance(source, str) and source[:5].lower() == "data:" and "," in source[:256]:
        text = source.split(",", 1)[1][:HEADER_PEEK_BYTES * 4 // 3]
        try:
            head = base64.b64decode(text[:len(text) - len(text) % 4])
        except (ValueError, TypeError):
            return 0
    elif isinstance(source, (bytes, bytearray)):
        head = bytes(source[:HEADER_PEEK_BYTES])
    else:
        return 0
    try:
        from PIL import Image

        with Image.open(io.BytesIO(head)) as image:
            width, height = image.size
    except Exception:  # not an image, a header past the peek, a decompression bomb (refused later)
        return 0
    return width * height


def _media_kind(item: Any) -> Optional[str]:
    """"image" or "video" for a media item (typed, or known by its key as the templates do), else None."""
    if not isinstance(item, Mapping):
        return None
    kind = item.get("type")
    for media, types in (("image", _IMAGE_TYPES), ("video", _VIDEO_TYPES)):
        if kind in types or (kind is None and (media in item or f"{media}_url" in item)):
            return media
    return None


def _file_uri_path(uri: str) -> str:
    path = uri[len("file://"):]
    if path.startswith("localhost/"):
        path = path[len("localhost"):]
    return urllib.parse.unquote(path)


def _short(text: str, limit: int = 100) -> str:
    return repr(text if len(text) <= limit else text[: limit - 3] + "...")
