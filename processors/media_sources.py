"""The bytes behind a media source string: a local file, an http(s) URL or a base64 `data:` URI.

Each read is capped (`max_bytes`, checked before the bytes are read or while they download) and
policed by `ProcessorLimits` (`allow_local_paths`, `allow_remote_urls`, `url_timeout_s`); anything
else is an `InputError` naming the source. Image loading (`image_io.py`) and video loading
(`video_io.py`) both read through these; `what` / `media` name the kind in messages.
"""

from __future__ import annotations

import base64
import binascii
import os
import stat
import time
import urllib.error
import urllib.parse
import urllib.request

from vlmrun.processors.limits import InputError, ProcessorLimits, quote

_USER_AGENT = "vlmrun-image-fetch/1"
_URL_CHUNK = 1 << 16


def read_local_file(path: str, limits: ProcessorLimits, max_bytes: int, what: str = "image") -> bytes:
    """The bytes of a regular file of at most `max_bytes` (InputError otherwise, or if local paths are off)."""
    if not limits.allow_local_paths:
        raise InputError(f"local {what} paths are not accepted here: send the {what} as a data URI or URL")
    label = f"{what} file {quote(path)}"
    try:
        info = os.stat(path)
    except FileNotFoundError:
        hint = f" (a base64 string must be sent as a data:{what}/...;base64, URI)" if len(path) > 256 else ""
        raise InputError(f"{label} not found{hint}") from None
    except OSError as exc:
        raise InputError(f"{label} cannot be accessed: {exc.strerror or exc}") from None
    if not stat.S_ISREG(info.st_mode):  # never opened: reading a FIFO or a device could block or never end
        raise InputError(f"{label} is {_file_kind(info.st_mode)}, not {'an' if what[0] in 'aeiou' else 'a'} "
                         f"{what} file")
    size = info.st_size
    if size == 0:
        raise InputError(f"{label} is empty (0 bytes)")
    if size > max_bytes:
        raise InputError(f"{label} is {size:,} bytes, more than the limit of {max_bytes:,}")
    try:
        with open(path, "rb") as fh:
            return fh.read(max_bytes + 1)
    except OSError as exc:
        raise InputError(f"{label} cannot be read: {exc.strerror or exc}") from None


def _file_kind(mode: int) -> str:
    """What a non-regular file is, in words."""
    kinds = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISSOCK, "a socket"),
             (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))
    return next((name for test, name in kinds if test(mode)), "not a regular file")


def file_uri_to_path(uri: str) -> str:
    """`file:///abs/p.jpg` -> `/abs/p.jpg` (also `file://localhost/...`, and %-escapes if needed).

    Like qwen-vl-utils, everything after `file://` is the path (so `file://rel/p.jpg` is relative).
    """
    path = uri[len("file://"):]
    if path.startswith("localhost/"):
        path = path[len("localhost"):]
    if not os.path.exists(path):
        unquoted = urllib.parse.unquote(path)
        if unquoted != path and os.path.exists(unquoted):
            return unquoted
    return path


def decode_data_uri(uri: str, max_bytes: int, media: str = "image") -> bytes:
    """The bytes of a base64 `data:<media>/...` URI of at most ~`max_bytes`."""
    header, comma, payload = uri.partition(",")
    if not comma:
        raise InputError("malformed data URI: no ',' between the header and the data")
    params = header[len("data:"):].split(";")
    media_type = params[0].strip().lower()
    if "base64" not in (p.strip().lower() for p in params[1:]):
        raise InputError(f"data URI must be base64-encoded: data:{media}/<type>;base64,<data>")
    if media_type and not media_type.startswith(f"{media}/") and media_type != "application/octet-stream":
        raise InputError(f"data URI media type {media_type!r} is not {'an' if media[0] in 'aeiou' else 'a'} "
                         f"{media} type")
    payload = "".join(payload.split())  # clients wrap long base64 lines
    if not payload:
        raise InputError("data URI is empty (0 bytes)")
    if len(payload) // 4 * 3 > max_bytes + 3:
        raise InputError(f"data URI holds ~{len(payload) // 4 * 3:,} bytes, more than the limit of {max_bytes:,}")
    payload += "=" * (-len(payload) % 4)  # tolerate missing padding
    try:
        if "-" in payload or "_" in payload:  # URL-safe alphabet
            data = base64.b64decode(payload, altchars=b"-_", validate=True)
        else:
            data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise InputError("data URI does not contain valid base64 data") from None
    return data


class _HttpOnlyRedirects(urllib.request.HTTPRedirectHandler):
    """Follow redirects only to http(s) URLs (never to ftp:// or anything else)."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):  # type: ignore[no-untyped-def]
        if urllib.parse.urlsplit(newurl).scheme.lower() not in ("http", "https"):
            raise InputError(f"URL redirected to a non-http(s) location: {quote(newurl)}")
        return super().redirect_request(req, fp, code, msg, headers, newurl)


def fetch_url(url: str, limits: ProcessorLimits, max_bytes: int, what: str = "image") -> bytes:
    """Download `url` with a total deadline of `limits.url_timeout_s` and a cap of `max_bytes`."""
    if not limits.allow_remote_urls:
        raise InputError(f"{what} URLs are not accepted here: send the {what} as a data URI")
    label = f"{what} URL {quote(url)}"
    deadline = time.monotonic() + limits.url_timeout_s
    request = urllib.request.Request(url, headers={"User-Agent": _USER_AGENT, "Accept": f"{what}/*,*/*;q=0.5"})
    opener = urllib.request.build_opener(_HttpOnlyRedirects)  # per call: honours current proxy env
    try:
        with opener.open(request, timeout=limits.url_timeout_s) as response:
            declared = response.headers.get("Content-Length")
            if declared is not None and declared.isdigit() and int(declared) > max_bytes:
                raise InputError(
                    f"{label} is {int(declared):,} bytes, more than the limit of {max_bytes:,}"
                )
            chunks: list[bytes] = []
            total = 0
            while True:
                if time.monotonic() > deadline:
                    raise InputError(f"fetching {label} timed out after {limits.url_timeout_s:g} s")
                chunk = response.read(_URL_CHUNK)
                if not chunk:
                    break
                total += len(chunk)
                if total > max_bytes:
                    raise InputError(f"{label} is more than the limit of {max_bytes:,} bytes")
                chunks.append(chunk)
    except InputError:
        raise
    except urllib.error.HTTPError as exc:
        raise InputError(f"could not fetch {label}: HTTP {exc.code} {exc.reason}") from None
    except urllib.error.URLError as exc:
        reason = exc.reason
        if isinstance(reason, TimeoutError):
            raise InputError(f"fetching {label} timed out after {limits.url_timeout_s:g} s") from None
        raise InputError(f"could not fetch {label}: {reason}") from None
    except TimeoutError:
        raise InputError(f"fetching {label} timed out after {limits.url_timeout_s:g} s") from None
    except (OSError, ValueError) as exc:  # connection reset, malformed URL, bad status line, ...
        raise InputError(f"could not fetch {label}: {exc}") from None
    return b"".join(chunks)
