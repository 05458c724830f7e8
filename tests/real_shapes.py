"""Random-weight checkpoints with the per-layer shapes of published Qwen models, for parity tests.

`build_real_shape_checkpoint(name, out_dir)` reads a published `config.json` (tests/configs/),
keeps every per-layer shape — hidden sizes, attention and GDN heads and head dims, expert widths,
the vision tower's width, heads and patch size — and cuts what only repeats: the number of text
layers (one or two, with at least one full-attention and one GDN layer for hybrid models), vision
blocks and experts. The vocabulary is the tests' tiny tokenizer (special token ids remapped), the
images are kept small by the preprocessor config (4 to 64 merged tokens). Weights are re-initialised
as the tiny checkpoints are (`testing.tiny_models.reinit_weights`) and saved as float32 safetensors.
`REAL_SHAPES` are small enough for the CPU parity suite; `LARGE_REAL_SHAPES` (the dense hybrid
Qwen3.5-27B) serve the GPU tests only. `FAMILY` names the tiny architecture each one widens, for
helpers keyed by architecture (the parity cases, the hybrid-only ones).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from testing.tiny_models import (
    _image_processor,
    _padded_vocab,
    _write_generation_config,
    build_tiny_tokenizer,
    reinit_weights,
    special_ids,
)

CONFIG_DIR = Path(__file__).resolve().parent / "configs"
HYBRID_LAYERS = ["linear_attention", "full_attention"]
FEW_EXPERTS = {"num_experts": 4, "num_experts_per_tok": 2}


@dataclass(frozen=True)
class RealShape:
    config_file: str  # in CONFIG_DIR
    text: dict[str, Any]  # overrides of the text config (layer and expert counts)
    vision: dict[str, Any] = field(default_factory=dict)  # overrides of the vision config (block count)


REAL_SHAPES: dict[str, RealShape] = {
    "qwen2_5_vl_3b": RealShape("Qwen2.5-VL-3B-Instruct.json", {"num_hidden_layers": 1},
                               {"depth": 2, "fullatt_block_indexes": [1]}),  # one windowed, one full block
    "qwen3_vl_2b": RealShape("Qwen3-VL-2B-Instruct.json", {"num_hidden_layers": 2},
                             {"depth": 2, "deepstack_visual_indexes": [0, 1]}),
    "qwen3_5_35b_a3b": RealShape("Qwen3.5-35B-A3B.json",
                                 {"num_hidden_layers": 2, "layer_types": HYBRID_LAYERS, **FEW_EXPERTS},
                                 {"depth": 2}),
    "qwen3_next_80b_a3b": RealShape("Qwen3-Next-80B-A3B-Thinking.json",
                                    {"num_hidden_layers": 2, "layer_types": HYBRID_LAYERS, **FEW_EXPERTS}),
}
# Too large for the CPU parity suite (2.8 GB in float32: a 17,408-wide MLP on a 5,120-wide model), used
# on the GPU: the one dense hybrid model, whose decode CUDA graphs can be captured (MoE routing syncs).
LARGE_REAL_SHAPES: dict[str, RealShape] = {
    "qwen3_5_27b": RealShape("Qwen3.5-27B.json", {"num_hidden_layers": 2, "layer_types": HYBRID_LAYERS},
                             {"depth": 2}),
}
# The tiny test architecture (tests/test_engine_parity.py's ARCHS) each real shape is a wider copy of.
FAMILY: dict[str, str] = {"qwen2_5_vl_3b": "qwen2_5_vl", "qwen3_vl_2b": "qwen3_vl", "qwen3_5_35b_a3b": "qwen3_5_moe",
                          "qwen3_next_80b_a3b": "qwen3_next", "qwen3_5_27b": "qwen3_5"}


def real_shape_config(name: str, vocab_size: int, ids: Any) -> dict[str, Any]:
    """The published config of `name` with the cuts above and the tiny tokenizer's ids."""
    spec = {**REAL_SHAPES, **LARGE_REAL_SHAPES}[name]
    config = json.loads((CONFIG_DIR / spec.config_file).read_text())
    text = config.get("text_config", config)  # Qwen2.5-VL and Qwen3-Next keep the text fields at the top
    text.update(spec.text, vocab_size=vocab_size, bos_token_id=ids.endoftext, eos_token_id=ids.im_end)
    if "vision_config" in config:
        config["vision_config"].update(spec.vision)
        config.update(image_token_id=ids.image_pad, video_token_id=ids.video_pad,
                      vision_start_token_id=ids.vision_start, vision_end_token_id=ids.vision_end)
        if "vision_token_id" in config:
            config["vision_token_id"] = ids.vision_pad
    for part in (config, text):
        part.pop("torch_dtype", None)
        part["dtype"] = "float32"
    return config


def build_real_shape_checkpoint(name: str, out_dir: Path, seed: int = 0) -> Path:
    """Build the cut-down random checkpoint `name` (a key of REAL_SHAPES or LARGE_REAL_SHAPES) in out_dir;
    returns out_dir."""
    import transformers
    from transformers import AutoConfig, AutoTokenizer

    out_dir = Path(out_dir)
    build_tiny_tokenizer(out_dir)
    tokenizer = AutoTokenizer.from_pretrained(str(out_dir))
    ids = special_ids(tokenizer)
    raw = real_shape_config(name, _padded_vocab(len(tokenizer)), ids)
    (out_dir / "config.json").write_text(json.dumps(raw, indent=2))
    config = AutoConfig.from_pretrained(str(out_dir))

    torch.manual_seed(seed)
    model = getattr(transformers, raw["architectures"][0])(config).to(torch.float32).eval()
    reinit_weights(model, seed)
    _write_generation_config(model, ids)
    model.save_pretrained(str(out_dir), max_shard_size="200MB")
    if "vision_config" in raw:
        patch = raw["vision_config"]["patch_size"]
        _image_processor("qwen2_5_vl" if patch == 14 else "qwen3_vl").save_pretrained(str(out_dir))
    return out_dir
