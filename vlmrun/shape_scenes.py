"""The shape scenes the bundled default model knows: their words, its prompts, and their descriptions.

A scene holds 1-3 shapes (circle, square, triangle) in five colours and two sizes, each in its
own horizontal third of the picture (left, middle, right). Everything about a scene (image size
and aspect ratio, background, texture, shapes, their exact pixel positions and tints) follows from
one `(split_seed, index)` pair (`make_scene`), so the same pair always gives the same picture and text.

Each scene has one canonical caption, listing the shapes from left to right:

    "a small red circle on the left, a large blue square in the middle and a small green triangle on the right"

question-answer pairs of four kinds: the number of shapes, the colour and the kind of the shape
in a third, and the position of a shape named by colour and kind (`Scene.qa_pairs`), and a JSON
object (`SCENE_SCHEMA`, `scene_json`). The bundled default model (`vlmrun.default_model`) answers
the prompts here in these words; the web demo reads a saved scene's questions from its file name
(`scene_from_file`). Drawing scenes and the training and evaluation splits are not runtime code:
they live in the checkout's `testing/` (`scene_drawing.py`, `scene_splits.py`), `training/` holds
the recipe.

Sizes are absolute in pixels (small shapes span 30-36 px, large ones 54-64 px), and image sides stay
within 64-256 px with at most 36 864 pixels, so the model's preprocessing (multiples of 32 px, at
most 36 merged vision tokens) rescales a side by at most 25 % and never makes a small shape as large
as a large one (checked on 3,000 training scenes).
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass
from pathlib import Path

SHAPES: tuple[str, ...] = ("circle", "square", "triangle")
COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (215, 38, 38),
    "green": (34, 150, 58),
    "blue": (38, 84, 214),
    "yellow": (238, 200, 30),
    "purple": (132, 52, 170),
}
SIZES: tuple[str, ...] = ("small", "large")
SLOTS: tuple[str, ...] = ("left", "middle", "right")
SLOT_PHRASES: dict[str, str] = {"left": "on the left", "middle": "in the middle", "right": "on the right"}
COUNT_WORDS: tuple[str, ...] = ("zero", "one", "two", "three")

# Background base colours (RGB) and textures; shape colours stay clearly apart from all of them.
BACKGROUNDS: dict[str, tuple[int, int, int]] = {
    "white": (246, 246, 244),
    "light grey": (214, 214, 212),
    "cream": (240, 230, 204),
    "pale blue": (212, 226, 240),
    "dark grey": (58, 58, 62),
}
TEXTURES: tuple[str, ...] = ("plain", "noise", "gradient", "stripes")

SMALL_EXTENT = (30, 36)  # bounding-box side in pixels, inclusive
LARGE_EXTENT = (54, 64)
MIN_SIDE = 64
MAX_SIDE = 256
MAX_PIXELS = 36 * 32 * 32  # 36 merged vision tokens of 32x32 px: the default model's preprocessing limit
COUNT_WEIGHTS = (0.25, 0.35, 0.40)  # scenes with 1, 2, 3 shapes
COLOUR_JITTER = 14  # per-channel uniform jitter of a shape's colour

DESCRIBE_PROMPT = "Describe the image."
# The prompt the default model answers with the scene's `SCENE_SCHEMA` object (`scene_json`). Taught in a
# second training stage, it is not in PROMPTS: adding it there would change the shipped tokenizer.
DESCRIBE_JSON_PROMPT = "Describe the image as JSON."
COUNT_QUESTION = "How many shapes are there?"
QA_KINDS: tuple[str, ...] = ("count", "colour", "shape", "position")  # the question kinds, in eval order

# The question of each kind as a template (`Scene.qa_pairs` asks them); {where} is "on the left", "in the
# middle" or "on the right" (also the answers to "Where ..."), {colour} one of COLOURS, {shape} one of SHAPES.
QUESTION_TEMPLATES: tuple[str, ...] = (
    COUNT_QUESTION,
    "What colour is the shape {where}?",
    "What shape is {where}?",
    "Where is the {colour} {shape}?",
)

# A few concrete prompts; they are part of the default model's tokenizer training text
# (training/checkpoint_files.py), so changing them changes the shipped tokenizer.
PROMPTS: tuple[str, ...] = (
    DESCRIBE_PROMPT,
    COUNT_QUESTION,
    "What colour is the shape on the left?",
    "What colour is the shape in the middle?",
    "Where is the red square?",
    "Where is the blue circle?",
)

SCENE_FILE = re.compile(r"scene_s(\d+)_i(\d+)\.png")  # a saved scene's file name: split seed, index


@dataclass(frozen=True)
class Shape:
    """One shape: what it is and where it is drawn (centre and bounding-box side in pixels)."""

    kind: str
    colour: str
    size: str
    slot: str
    cx: float
    cy: float
    extent: int
    rgb: tuple[int, int, int]

    @property
    def phrase(self) -> str:
        """'a small red circle on the left'."""
        return f"a {self.size} {self.colour} {self.kind} {SLOT_PHRASES[self.slot]}"


@dataclass(frozen=True)
class QA:
    """A question about a scene, its one correct answer, its kind (one of QA_KINDS), and the
    shape it names (an index into `Scene.shapes`; None when it names none)."""

    question: str
    answer: str
    kind: str
    subject: int | None = None


@dataclass(frozen=True)
class Scene:
    """A full scene description; `caption` and `qa_pairs()` describe it (testing/scene_drawing.py draws it)."""

    split_seed: int
    index: int
    width: int
    height: int
    background: str
    texture: str
    shapes: tuple[Shape, ...]  # ordered left to right

    @property
    def caption(self) -> str:
        phrases = [s.phrase for s in self.shapes]
        if len(phrases) == 1:
            return phrases[0]
        return ", ".join(phrases[:-1]) + " and " + phrases[-1]

    def qa_pairs(self) -> list[QA]:
        """Every question this scene answers unambiguously, in a fixed order."""
        pairs = [QA(COUNT_QUESTION, COUNT_WORDS[len(self.shapes)], "count")]
        for k, shape in enumerate(self.shapes):
            pairs.append(QA(f"What colour is the shape {SLOT_PHRASES[shape.slot]}?", shape.colour, "colour", k))
            pairs.append(QA(f"What shape is {SLOT_PHRASES[shape.slot]}?", shape.kind, "shape", k))
        named = [(s.colour, s.kind) for s in self.shapes]
        for k, shape in enumerate(self.shapes):
            if named.count((shape.colour, shape.kind)) == 1:
                pairs.append(QA(f"Where is the {shape.colour} {shape.kind}?", SLOT_PHRASES[shape.slot], "position", k))
        return pairs


def make_scene(split_seed: int, index: int) -> Scene:
    """The scene number `index` of split `split_seed` (pure function of the two integers)."""
    rng = random.Random(f"vlmrun-shapes/{split_seed}/{index}")
    count = rng.choices((1, 2, 3), weights=COUNT_WEIGHTS)[0]
    slots = sorted(rng.sample(range(len(SLOTS)), count))
    picks = []
    for slot in slots:
        size = rng.choice(SIZES)
        lo, hi = SMALL_EXTENT if size == "small" else LARGE_EXTENT
        picks.append((SLOTS[slot], rng.choice(SHAPES), rng.choice(list(COLOURS)), size, rng.randint(lo, hi)))
    biggest = max(p[4] for p in picks)
    # Each third must hold its shape with a margin; keep the area within the pixel budget.
    min_width = max(MIN_SIDE, 3 * (biggest + 6))
    width = rng.randint(min_width, MAX_SIDE)
    min_height = max(MIN_SIDE, biggest + 10)
    max_height = min(MAX_SIDE, MAX_PIXELS // width)
    height = rng.randint(min_height, max(min_height, max_height))
    background = rng.choice(list(BACKGROUNDS))
    texture = rng.choice(TEXTURES)
    third = width / 3
    shapes = []
    for slot, kind, colour, size, extent in picks:
        k = SLOTS.index(slot)
        half = extent / 2
        lo_x, hi_x = k * third + half + 2, (k + 1) * third - half - 2
        cx = rng.uniform(lo_x, max(lo_x, hi_x))
        cy = rng.uniform(half + 3, height - half - 3)
        rgb = tuple(min(255, max(0, c + rng.randint(-COLOUR_JITTER, COLOUR_JITTER))) for c in COLOURS[colour])
        shapes.append(Shape(kind, colour, size, slot, round(cx, 2), round(cy, 2), extent, rgb))  # type: ignore[arg-type]
    return Scene(split_seed, index, width, height, background, texture, tuple(shapes))


# --------------------------------------------------------------------------------------------
# Structured descriptions
# --------------------------------------------------------------------------------------------

# A JSON Schema of a scene as objects: what `scene_objects` returns and `caption_objects` parses.
SCENE_SCHEMA: dict = {
    "type": "object",
    "properties": {"shapes": {"type": "array", "minItems": 1, "maxItems": 3, "items": {
        "type": "object",
        "properties": {"colour": {"enum": list(COLOURS)}, "shape": {"enum": list(SHAPES)},
                       "position": {"enum": list(SLOTS)}},
        "required": ["colour", "shape", "position"], "additionalProperties": False}}},
    "required": ["shapes"], "additionalProperties": False,
}
_PHRASE = re.compile(r"a (small|large) (\w+) (\w+) (on the left|in the middle|on the right)")


def caption_grammar() -> str:
    """EBNF (xgrammar syntax) of the canonical captions: 1-3 phrases in the model's own words, so a
    grammar-constrained caption always parses with `caption_objects`."""
    def alts(words) -> str:
        return " | ".join(f'"{w}"' for w in words)

    return "\n".join([
        'root ::= phrase | phrase " and " phrase | phrase ", " phrase " and " phrase',
        'phrase ::= "a " size " " colour " " shape " " where',
        f"size ::= {alts(SIZES)}",
        f"colour ::= {alts(COLOURS)}",
        f"shape ::= {alts(SHAPES)}",
        f"where ::= {alts(SLOT_PHRASES.values())}",
    ])


def caption_objects(caption: str) -> dict:
    """A canonical caption as `SCENE_SCHEMA` objects: {"shapes": [{"colour", "shape", "position"}, ...]}."""
    where = {phrase: slot for slot, phrase in SLOT_PHRASES.items()}
    return {"shapes": [{"colour": colour, "shape": kind, "position": where[place]}
                       for _, colour, kind, place in _PHRASE.findall(caption)]}


def scene_objects(scene: Scene) -> dict:
    """The truth of a scene as `SCENE_SCHEMA` objects (left to right)."""
    return {"shapes": [{"colour": s.colour, "shape": s.kind, "position": s.slot} for s in scene.shapes]}


def scene_json(scene: Scene) -> str:
    """`scene_objects` as the JSON text the default model answers `DESCRIBE_JSON_PROMPT` with: one line,
    `", "` and `": "` separators, keys in the schema's order (what schema-constrained decoding emits)."""
    return json.dumps(scene_objects(scene))


def scene_file_name(scene: Scene) -> str:
    """'scene_s2_i8.png': the name a saved scene goes by, from which `scene_from_file` rebuilds it."""
    return f"scene_s{scene.split_seed}_i{scene.index}.png"


def scene_from_file(path: str | Path) -> Scene | None:
    """The scene a file named by `scene_file_name` shows (its caption, its questions); None for any other file."""
    match = SCENE_FILE.fullmatch(Path(path).name)
    return make_scene(int(match.group(1)), int(match.group(2))) if match else None
