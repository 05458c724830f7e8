"""The shape scenes the default model is trained and evaluated on: their layout and words
(vlmrun/shape_scenes.py), their pictures (testing/scene_drawing.py) and splits (testing/scene_splits.py)."""

from __future__ import annotations

import numpy as np

from testing.scene_drawing import render_scene, render_scene_with_masks
from testing.scene_splits import EVAL_SEED, TRAIN_SEED, eval_question
from vlmrun.processors import smart_resize
from vlmrun.shape_scenes import (COUNT_WORDS, MAX_PIXELS, MAX_SIDE, MIN_SIDE, SLOTS, make_scene, scene_file_name,
                                 scene_from_file)

N = 300


def test_a_scene_is_a_pure_function_of_its_seed_and_index():
    a, b = make_scene(TRAIN_SEED, 7), make_scene(TRAIN_SEED, 7)
    assert a == b
    assert np.array_equal(np.asarray(render_scene(a)), np.asarray(render_scene(b)))
    assert make_scene(EVAL_SEED, 7) != a  # the held-out split draws other scenes


def test_scene_layout_stays_within_its_bounds():
    for index in range(N):
        scene = make_scene(TRAIN_SEED, index)
        assert MIN_SIDE <= scene.width <= MAX_SIDE and MIN_SIDE <= scene.height <= MAX_SIDE
        assert scene.width * scene.height <= MAX_PIXELS
        assert 1 <= len(scene.shapes) <= 3
        slots = [SLOTS.index(s.slot) for s in scene.shapes]
        assert slots == sorted(set(slots)), "one shape per third, listed left to right"
        third = scene.width / 3
        for shape, k in zip(scene.shapes, slots):
            half = shape.extent / 2
            assert k * third <= shape.cx - half and shape.cx + half <= (k + 1) * third
            assert 0 <= shape.cy - half and shape.cy + half <= scene.height


def test_caption_and_answers_follow_the_shapes():
    assert make_scene(2, 0).caption == "a large blue circle on the left"
    assert make_scene(2, 2).caption == "a small red triangle on the left and a large yellow triangle on the right"
    scene = make_scene(2, 1)
    assert scene.caption == ("a small purple square on the left, a small blue triangle in the middle "
                             "and a large blue circle on the right")
    answers = {qa.question: qa.answer for qa in scene.qa_pairs()}
    assert answers["How many shapes are there?"] == COUNT_WORDS[len(scene.shapes)]
    for shape in scene.shapes:
        where = shape.phrase.split(f"{shape.kind} ", 1)[1]  # 'on the left'
        assert answers[f"What colour is the shape {where}?"] == shape.colour
        assert answers[f"What shape is {where}?"] == shape.kind
    for index in range(N):
        scene = make_scene(EVAL_SEED, index)
        assert eval_question(scene) in scene.qa_pairs()


def test_rendered_shapes_have_their_colour():
    scene = make_scene(TRAIN_SEED, 3)
    image, masks = render_scene_with_masks(scene)
    pixels = np.asarray(image).astype(int)
    for shape, mask in zip(scene.shapes, masks):
        inside = pixels[mask >= 0.999]  # fully covered pixels
        assert len(inside) > 0.2 * shape.extent ** 2  # fully covered pixels: even a triangle's exceed this
        assert np.abs(inside - np.asarray(shape.rgb)).max() <= 1


def test_preprocessing_never_makes_a_small_shape_look_large():
    """The model sees each scene resized to multiples of 32 px within 36 merged tokens: sizes stay apart."""
    largest_small, smallest_large = 0.0, float("inf")
    for index in range(N):
        scene = make_scene(TRAIN_SEED, index)
        height, width = smart_resize(scene.height, scene.width, 32, 4 * 1024, MAX_PIXELS)
        grow, shrink = max(width / scene.width, height / scene.height), min(width / scene.width, height / scene.height)
        for shape in scene.shapes:
            if shape.size == "small":
                largest_small = max(largest_small, shape.extent * grow)
            else:
                smallest_large = min(smallest_large, shape.extent * shrink)
    assert largest_small < smallest_large


def test_a_saved_scene_is_found_again_from_its_file_name(tmp_path):
    scene = make_scene(2, 8)
    assert scene_file_name(scene) == "scene_s2_i8.png"
    assert scene_from_file(tmp_path / scene_file_name(scene)) == scene
    assert scene_from_file("assets/images/chelsea_451x300.jpg") is None
    assert scene_from_file("scene_s2_i8.png.bak") is None
