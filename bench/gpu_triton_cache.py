"""The GPU machine's Triton cache, brought back from one device call and carried into the next.

Triton compiles FLA's kernels at first use (about a second each, in the engine's process) and
caches them under `TRITON_CACHE_DIR`; the device machine starts bare, so each call compiled them
again. Here the acceptance run (bench/gpu_acceptance.py) uses a fixed cache folder
(`CACHE_DIR`, bench/gpu_checks.py's: the cache's group files hold absolute paths) with
`TRITON_STORE_BINARY_ONLY=1` (the binaries, not the IRs), and

  - `harvest`, at the end of a call, packs that folder into one archive under `$OUT`
    (`triton_cache.tar.gz`), its first member `triton_key.json`: the `triton_key()` the binaries
    were made under (a hash of Triton's own sources, libtriton and its ptxas) and Triton's version;
  - `restore`, at the start of the next, unpacks a carried archive (`CARRIED`, the folder named in
    the call's `carry`) into the cache folder, only when its key is this machine's: a different
    Triton would not use those entries anyway.

    python -m bench.gpu_triton_cache restore   # prints what it did; never fails the call
    python -m bench.gpu_triton_cache harvest --out $OUT/triton_cache.tar.gz

The archive and key handling are plain functions (tests/test_gpu_triton_cache.py); only `machine_key`
imports triton.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import tarfile
from pathlib import Path

from bench.gpu_checks import TRITON_CACHE_DIR as CACHE_DIR  # fixed on every device call

ROOT = Path(__file__).resolve().parents[1]
CARRIED = ROOT / ".cache" / "gpu_carry" / "triton_cache.tar.gz"  # ignored by git (.cache/); named in `carry`
KEY_MEMBER = "triton_key.json"
CACHE_PREFIX = "cache/"


def machine_key() -> dict[str, str]:
    """This machine's Triton: its version and the sha256 of its `triton_key()` (a few kB of hashes)."""
    import hashlib

    import triton
    from triton.runtime.cache import triton_key

    return {"triton": triton.__version__, "triton_key": hashlib.sha256(triton_key().encode()).hexdigest()}


def harvest(cache_dir: Path, archive: Path, key: dict[str, str]) -> str:
    """Pack `cache_dir` into `archive` (gzip tar), `key` as its first member. One line: what it packed."""
    files = sorted(p for p in cache_dir.rglob("*") if p.is_file()) if cache_dir.is_dir() else []
    archive.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(archive, "w:gz") as tar:
        data = json.dumps(key, indent=1).encode()
        info = tarfile.TarInfo(KEY_MEMBER)
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
        for path in files:
            tar.add(path, arcname=CACHE_PREFIX + path.relative_to(cache_dir).as_posix())
    return (f"harvested {len(files)} files ({sum(p.stat().st_size for p in files) / 2**20:.1f} MiB) from {cache_dir} "
            f"into {archive} ({archive.stat().st_size / 2**20:.2f} MiB), triton {key.get('triton')}")


def archive_key(archive: Path) -> dict[str, str]:
    with tarfile.open(archive, "r:gz") as tar:
        member = tar.extractfile(KEY_MEMBER)
        if member is None:
            raise ValueError(f"{archive} has no {KEY_MEMBER}")
        return json.loads(member.read())


def restore(archive: Path, cache_dir: Path, key: dict[str, str]) -> str:
    """Unpack `archive`'s cache into `cache_dir` when it was made under `key`. One line: what it did."""
    if not archive.exists():
        return f"no carried Triton cache ({archive}): every kernel compiles"
    made_under = archive_key(archive)
    if made_under.get("triton_key") != key.get("triton_key"):
        return (f"skipped {archive}: made under triton {made_under.get('triton')} (key "
                f"{str(made_under.get('triton_key'))[:12]}...), this machine runs triton {key.get('triton')} "
                f"(key {str(key.get('triton_key'))[:12]}...)")
    cache_dir.mkdir(parents=True, exist_ok=True)
    count = 0
    with tarfile.open(archive, "r:gz") as tar:
        for member in tar.getmembers():
            if not member.isfile() or not member.name.startswith(CACHE_PREFIX):
                continue
            member.name = member.name[len(CACHE_PREFIX):]
            tar.extract(member, cache_dir, filter="data")  # no absolute paths, no '..'
            count += 1
    return f"restored {count} files from {archive} into {cache_dir}, triton {key.get('triton')}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("action", choices=["restore", "harvest"])
    parser.add_argument("--cache-dir", type=Path, default=Path(os.environ.get("TRITON_CACHE_DIR", CACHE_DIR)))
    parser.add_argument("--archive", type=Path, default=CARRIED, help="restore: the carried archive")
    parser.add_argument("--out", type=Path, default=None, help="harvest: the archive to write")
    args = parser.parse_args()
    key = machine_key()
    if args.action == "restore":
        print(restore(args.archive, args.cache_dir, key))
        return 0
    if args.out is None:
        parser.error("harvest needs --out")
    print(harvest(args.cache_dir, args.out, key))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
