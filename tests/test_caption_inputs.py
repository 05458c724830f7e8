"""Caption-job inputs: directories, globs, manifests (.txt / .csv / .jsonl / .parquet), de-duplication."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from vlmrun.jobs.inputs import InputStats, JobItem, count_new, iter_items, new_items
from vlmrun.jobs.records import key_hash


def _touch(path: Path) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"x")
    return str(path)


def _keys(items) -> list[str]:
    return [it.key for it in items]


def test_directory_walk_is_recursive_sorted_and_skips_hidden_and_non_images(tmp_path: Path) -> None:
    root = tmp_path / "imgs"
    b = _touch(root / "b.JPG")
    a = _touch(root / "a.png")
    deep = _touch(root / "sub" / "deeper" / "c.webp")
    sub = _touch(root / "sub" / "d.jpeg")
    _touch(root / "notes.txt")
    _touch(root / ".hidden.png")
    _touch(root / ".cache" / "e.png")
    stats = InputStats()
    assert _keys(iter_items([str(root)], stats=stats)) == [a, b, sub, deep]
    assert stats.ignored_files == 1


def test_globs_urls_and_plain_paths(tmp_path: Path) -> None:
    a = _touch(tmp_path / "x" / "a.png")
    b = _touch(tmp_path / "y" / "b.jpg")
    _touch(tmp_path / "y" / "c.txt")
    stats = InputStats()
    items = list(iter_items([str(tmp_path / "**" / "*.*"), "https://example.com/i.jpg", str(tmp_path / "nope.png")],
                            stats=stats))
    assert sorted(_keys(items[:2])) == sorted([a, b])
    assert items[2] == JobItem("https://example.com/i.jpg", "https://example.com/i.jpg")
    assert items[3].key == str(tmp_path / "nope.png") and items[3].error is None  # loading will report it
    assert stats.ignored_files == 1
    (missing,) = iter_items([str(tmp_path / "none" / "*.png")])
    assert missing.error is not None and "no file matches" in missing.error


def test_txt_manifest_resolves_relative_entries_against_its_folder(tmp_path: Path) -> None:
    folder = tmp_path / "m"
    img = _touch(folder / "pics" / "a.png")
    manifest = folder / "list.txt"
    manifest.write_text(f"# comment\npics/a.png\n\n  {img}  \nhttp://h/x.png\n")
    items = list(iter_items([str(manifest)]))
    assert [(i.key, i.source) for i in items] == [
        ("pics/a.png", str(folder / "pics" / "a.png")), (img, img), ("http://h/x.png", "http://h/x.png")]


def test_csv_manifest_with_and_without_header(tmp_path: Path) -> None:
    with_header = tmp_path / "h.csv"
    with_header.write_text("id,Path,label\n1,a.png,cat\n2,b.png,dog\n")
    assert _keys(iter_items([str(with_header)])) == ["a.png", "b.png"]
    bare = tmp_path / "bare.csv"
    bare.write_text("a.png,1\nb.png,2\n")
    assert _keys(iter_items([str(bare)])) == ["a.png", "b.png"]
    named = tmp_path / "named.csv"
    named.write_text("src,other\nx.png,y.png\n")
    assert _keys(iter_items([str(named)], image_column="other")) == ["y.png"]
    (bad,) = iter_items([str(named)], image_column="missing")
    assert bad.error is not None and "no column 'missing'" in bad.error


def test_jsonl_manifest_strings_objects_and_bad_lines(tmp_path: Path) -> None:
    manifest = tmp_path / "m.jsonl"
    manifest.write_text("\n".join([json.dumps("a.png"), json.dumps({"url": "http://h/b.png", "label": 1}),
                                   "{not json", json.dumps({"caption": "no image field"}), ""]) + "\n")
    items = list(iter_items([str(manifest)]))
    assert _keys(items[:2]) == ["a.png", "http://h/b.png"]
    assert items[2].error is not None and "line 3" in items[2].error and "not JSON" in items[2].error
    assert items[3].error is not None and "line 4" in items[3].error


def test_parquet_manifest_streams_the_image_column(tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    manifest = tmp_path / "m.parquet"
    pq.write_table(pa.table({"label": list(range(20_000)), "image": [f"{i}.png" for i in range(20_000)]}), manifest,
                   row_group_size=3000)
    keys = _keys(iter_items([str(manifest)]))
    assert keys[:2] == ["0.png", "1.png"] and len(keys) == 20_000 and keys[-1] == "19999.png"


def test_unreadable_manifest_is_an_error_item(tmp_path: Path) -> None:
    manifest = tmp_path / "m.txt"
    manifest.write_bytes(b"\xff\xfe\x00bad utf8")
    (item,) = iter_items([str(manifest)])
    assert item.error is not None and "cannot read manifest" in item.error


def test_new_items_skips_recorded_and_repeated_keys(tmp_path: Path) -> None:
    items = [JobItem(k, k) for k in ["a", "b", "a", "c", "b", "d"]]
    stats = InputStats()
    assert _keys(new_items(iter(items), {key_hash("c")}, stats)) == ["a", "b", "d"]
    assert (stats.skipped_done, stats.duplicates) == (1, 2)


def test_inputs_are_read_lazily(tmp_path: Path) -> None:
    manifest = tmp_path / "big.txt"
    with open(manifest, "w") as fh:
        for i in range(100_000):
            fh.write(f"img_{i}.png\n")
    it = iter_items([str(manifest)])
    assert next(it).key == "img_0.png"  # nothing was listed ahead
    assert count_new([str(manifest)], {key_hash("img_5.png")}) == 99_999
    assert os.path.getsize(manifest) > 0
