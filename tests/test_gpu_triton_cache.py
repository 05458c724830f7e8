"""The GPU run's Triton cache carried between device calls (bench/gpu_triton_cache.py): harvested with
the key it was made under, restored only under the same key, nothing unpacked outside the cache."""

from __future__ import annotations

import io
import json
import tarfile

from bench.gpu_triton_cache import KEY_MEMBER, archive_key, harvest, restore

KEY = {"triton": "3.6.0", "triton_key": "a" * 64}


def fake_cache(folder):
    (folder / "ABC123").mkdir(parents=True)
    (folder / "ABC123" / "chunk_fwd_kernel_o.cubin").write_bytes(b"\x7fELF cubin")
    (folder / "ABC123" / "chunk_fwd_kernel_o.json").write_text(json.dumps({"name": "chunk_fwd_kernel_o"}))
    (folder / "DEF456").mkdir()
    (folder / "DEF456" / "__grp__l2norm_fwd_kernel.json").write_text(json.dumps({"child_paths": {}}))
    return folder


def test_the_cache_comes_back_under_the_same_key(tmp_path):
    cache = fake_cache(tmp_path / "made")
    archive = tmp_path / "out" / "triton_cache.tar.gz"
    assert "harvested 3 files" in harvest(cache, archive, KEY)
    assert archive_key(archive) == KEY
    restored = tmp_path / "next"
    assert "restored 3 files" in restore(archive, restored, KEY)
    for path in cache.rglob("*"):
        if path.is_file():
            assert (restored / path.relative_to(cache)).read_bytes() == path.read_bytes()


def test_another_triton_key_restores_nothing(tmp_path):
    archive = tmp_path / "triton_cache.tar.gz"
    harvest(fake_cache(tmp_path / "made"), archive, KEY)
    line = restore(archive, tmp_path / "next", {"triton": "3.7.0", "triton_key": "b" * 64})
    assert line.startswith("skipped") and "3.6.0" in line and "3.7.0" in line
    assert not (tmp_path / "next").exists()


def test_no_carried_cache_is_said_and_an_empty_one_still_carries_its_key(tmp_path):
    assert "no carried Triton cache" in restore(tmp_path / "absent.tar.gz", tmp_path / "next", KEY)
    archive = tmp_path / "empty.tar.gz"
    assert "harvested 0 files" in harvest(tmp_path / "no_cache_dir", archive, KEY)
    assert archive_key(archive) == KEY


def test_a_member_outside_the_cache_is_not_unpacked(tmp_path):
    archive = tmp_path / "evil.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        for name, data in [(KEY_MEMBER, json.dumps(KEY).encode()), ("outside.txt", b"x"), ("cache/ok.cubin", b"y")]:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    assert "restored 1 files" in restore(archive, tmp_path / "cache", KEY)
    assert (tmp_path / "cache" / "ok.cubin").exists() and not (tmp_path / "outside.txt").exists()
