"""Write a few generator scenes to assets/images (`python -m training.make_scene_assets`).

Files are named `scene_s{split}_i{index}.png` so anyone can rebuild the scene (and its caption)
with `vlmrun.shape_scenes.scene_from_file(path)`. They come from split ASSET_SEED, which neither
training nor the held-out evaluation uses.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from testing.scene_drawing import render_scene
from vlmrun.shape_scenes import make_scene, scene_file_name

ASSET_SEED = 2
ASSET_INDICES = (0, 1, 2, 3, 8, 10)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "assets" / "images")
    args = parser.parse_args(argv)
    for index in ASSET_INDICES:
        scene = make_scene(ASSET_SEED, index)
        path = args.out / scene_file_name(scene)
        render_scene(scene).save(path, optimize=True)
        print(f"{path.name}  {scene.width}x{scene.height}  {scene.caption}")


if __name__ == "__main__":
    main()
