"""Weight memory of Qwen's FP8 checkpoints against bf16, at the published shapes: counted, then measured.

Two figures per model of `MODELS` (published `config.json` copies, `--configs`):

- **counted at the real shape**: the model built on the meta device (no memory) exactly as the engine
  builds it (`vlmrun.models.registry.build_for_checkpoint`: the same `QuantizationConfig` and the same
  per-layer method assignment from the checkpoint's tensor names), its parameters' bytes summed as
  they stay once loaded (`resident_bytes`). Three variants: bf16; Qwen's FP8 format with its
  unquantized modules (`testing.fp8_checkpoints.QWEN_UNQUANTIZED`: LM head, embeddings, GDN
  `in_proj_a` / `in_proj_b` / `in_proj_ba`, MoE routers and shared-expert gates; norms, `A_log`,
  `dt_bias` and the GDN conv are no linear layers and stay as they are anyway) and the vision tower
  left in bf16; the same with the vision tower quantized too.
- **measured on a layer-cut copy** (`--no-measure` skips it): the published config with its per-layer
  shapes kept (widths, heads, every expert, the vocabulary) and fewer layers (`cut_config`), written as
  random-weight checkpoints (bf16, and FP8 in Qwen's format: `float8_e4m3fn` weights, `weight_scale_inv`
  per 128 x 128 block), each loaded by the engine on the CPU in a fresh process: `Engine.stats()`'s
  `weight_bytes` and the growth of the process's anonymous resident memory (RssAnon) over the load.
  The bf16 checkpoint is loaded a second time with `quantization="fp8"` (online FP8). The counted
  bytes of the cut copy must equal the engine's `weight_bytes` (the script fails otherwise).

    python -m bench.bench_quantized_memory [--models Qwen3-VL-8B ...] [--no-measure] [--workdir /tmp]
"""

from __future__ import annotations

import argparse
import copy
import ctypes
import gc
import json
import platform
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path
from typing import Any, Iterator, Optional

import torch
from torch import nn

from vlmrun.config import ModelConfig
from vlmrun.configs.quantization import resolve_quantization
from vlmrun.layers.linear import LinearBase
from vlmrun.layers.moe import FusedExperts
from vlmrun.models.registry import build_for_checkpoint
from vlmrun.quantization.fp8 import Fp8BlockLinear, Fp8OnlineLinear, part_rows, weight_and_scale_names
from vlmrun.quantization.fp8_blocks import BLOCK, ROW_GROUPS, quantize_weight
from testing.fp8_checkpoints import QWEN_UNQUANTIZED, VISION_PATTERN

CONFIGS = Path(__file__).resolve().parents[2] / "shared" / "configs"
MODELS: dict[str, str] = {  # name -> published config file
    "Qwen3-VL-8B": "Qwen3-VL-8B-Instruct.json",
    "Qwen3-VL-30B-A3B": "Qwen3-VL-30B-A3B-Instruct.json",
    "Qwen3.5-27B": "Qwen3.5-27B.json",
    "Qwen3.5-35B-A3B": "Qwen3.5-35B-A3B.json",
    "Qwen3-Next-80B-A3B": "Qwen3-Next-80B-A3B-Thinking.json",
}
VARIANTS = ("bf16", "fp8", "fp8+vision")  # fp8: the vision tower in bf16; fp8+vision: quantized too
SHARD_BYTES = 2 << 30
CACHE_BYTES = 16 << 20  # the measured engines' KV + GDN budget (in their RSS growth)


# ------------------------------------------------------------------ configs


def read_config(path: Path) -> dict[str, Any]:
    return json.loads(Path(path).read_text())


def hf_config(config: dict[str, Any]) -> Any:
    """The transformers config object of a config.json dict (its architecture's own config class)."""
    import transformers

    cls = getattr(transformers, config["architectures"][0])
    return cls.config_class.from_dict(copy.deepcopy(config))


def fp8_quantization_config(quantize_vision: bool) -> dict[str, Any]:
    """Qwen's `quantization_config` of a `-FP8` checkpoint (block-wise e4m3, dynamic activations)."""
    unquantized = list(QWEN_UNQUANTIZED) + ([] if quantize_vision else [VISION_PATTERN])
    return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128],
            "modules_to_not_convert": unquantized}


def with_variant(config: dict[str, Any], variant: str) -> dict[str, Any]:
    """`config` as the checkpoint of `variant` (one of `VARIANTS`) declares it."""
    out = copy.deepcopy(config)
    out.pop("quantization_config", None)
    if variant != "bf16":
        out["quantization_config"] = fp8_quantization_config(quantize_vision=variant == "fp8+vision")
    return out


def cut_config(config: dict[str, Any]) -> dict[str, Any]:
    """The published config with its per-layer shapes and fewer layers: two text layers (a GDN and a
    full-attention one for hybrid models), a vision tower of three blocks (each a deepstack one where
    the model has deepstack mergers, three as published)."""
    out = copy.deepcopy(config)
    text = out.get("text_config", out)
    text["num_hidden_layers"] = 2
    if text.get("layer_types") or text.get("full_attention_interval"):
        text["layer_types"] = ["linear_attention", "full_attention"]
    vision = out.get("vision_config")
    if vision is not None:
        vision["depth"] = 3
        if vision.get("deepstack_visual_indexes"):
            vision["deepstack_visual_indexes"] = [0, 1, 2]
    return out


# ------------------------------------------------------------------ the checkpoint's tensors


def hf_tensors(config: Any) -> dict[str, tuple[tuple[int, ...], bool]]:
    """name -> (shape, whether it is a linear layer's weight) of the checkpoint transformers would save for
    `config`, its MoE experts as the hub stores them: one `experts.{e}.{gate,up,down}_proj.weight` each."""
    import transformers

    with torch.device("meta"):
        model = getattr(transformers, config.architectures[0])(config)
    linear = {f"{name}.weight" for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    text = config.get_text_config()
    tensors: dict[str, tuple[tuple[int, ...], bool]] = {}
    for name, tensor in model.state_dict().items():
        prefix, _, leaf = name.rpartition(".")
        if prefix.endswith(".experts") and leaf in ("gate_up_proj", "down_proj"):
            hidden, width = text.hidden_size, text.moe_intermediate_size
            for e in range(tensor.shape[0]):
                for projection in (("gate_proj", "up_proj") if leaf == "gate_up_proj" else ("down_proj",)):
                    shape = (hidden, width) if projection == "down_proj" else (width, hidden)
                    tensors[f"{prefix}.{e}.{projection}.weight"] = (shape, True)
            continue
        tensors[name] = (tuple(tensor.shape), name in linear)
    return tensors


def fp8_tensor_names(tensors: dict[str, tuple[tuple[int, ...], bool]], config: Any) -> Iterator[tuple[str, bool]]:
    """(name, quantized) of every tensor of `config`'s checkpoint (FP8 ones followed by their
    `weight_scale_inv`); `config.quantization_config` says which linear weights are FP8."""
    quantization = resolve_quantization(config, None)
    for name, (_, is_linear) in tensors.items():
        quantized = quantization is not None and is_linear and quantization.quantizes(name.rpartition(".")[0])
        yield name, quantized


def checkpoint_names(config: Any) -> list[str]:
    names = []
    for name, quantized in fp8_tensor_names(hf_tensors(config), config):
        names += [name, f"{name}_scale_inv"] if quantized else [name]
    return names


# ------------------------------------------------------------------ counted on the meta device


def counted_bytes(config: dict[str, Any], quantization: Optional[str] = None) -> int:
    """The bytes the engine's model of `config` (with its quantization_config, if any) keeps once loaded,
    counted on the meta device; `quantization` as `LLM(quantization=...)` ("fp8" on bf16: online FP8)."""
    hf = hf_config(config)
    model_config = ModelConfig(path=Path("(meta)"), hf_config=hf, dtype=torch.bfloat16, max_model_len=4096,
                               quantization=resolve_quantization(hf, quantization))
    names = checkpoint_names(hf) if model_config.quantization is not None else ()
    return resident_bytes(build_for_checkpoint(model_config, torch.device("meta"), names))


def resident_bytes(model: nn.Module) -> int:
    """`vlmrun.models.weights.weight_bytes` of `model` as it will be once loaded, counted before: an FP8
    layer's scales are loaded one row per output row, then compacted (`Fp8BlockLinear.after_loading`)
    to one row per g rows (`scale_row_group`); an online-FP8 layer's float weight becomes FP8 values and
    the same scales (`Fp8OnlineLinear.after_loading` quantizes each fused part on its own)."""
    total = 0
    counted: set[int] = set()
    for module in model.modules():
        method = getattr(module, "method", None)
        if isinstance(module, (LinearBase, FusedExperts)) and isinstance(method, (Fp8BlockLinear, Fp8OnlineLinear)):
            for weight_name, scale_name in weight_and_scale_names(module):
                weight = getattr(module, weight_name)
                *lead, rows, cols = weight.shape
                g = scale_row_group(part_rows(module, weight_name))
                scales = int(torch.Size(lead).numel()) * -(-rows // g) * -(-cols // BLOCK)
                total += weight.numel() + scales * 4  # FP8 values, float32 scales
                counted.update((id(weight), id(getattr(module, scale_name, None))))
        for param in module.parameters(recurse=False):
            if id(param) not in counted:
                counted.add(id(param))
                total += param.numel() * param.element_size()
    return total


def scale_row_group(parts: list[int]) -> int:
    """Output rows per scale row once an FP8 weight stacked from parts of `parts` rows (q | k | v, gate |
    up) has its scales compacted: each part's 128-row blocks start at its own first row, so the largest
    of `ROW_GROUPS` that divides every part's offset (128 where each starts on a multiple of 128, as at
    real shapes)."""
    offsets = [sum(parts[:i]) for i in range(len(parts))]
    return next(g for g in ROW_GROUPS if all(offset % g == 0 for offset in offsets))


# ------------------------------------------------------------------ random-weight checkpoints


def write_checkpoint(config: dict[str, Any], out_dir: Path, seed: int = 0) -> Path:
    """A random-weight checkpoint of `config` (bf16; Qwen's FP8 format where its quantization_config says),
    with the tests' tiny tokenizer and image processor so that the engine can load it."""
    from safetensors.torch import save_file

    from testing.tiny_models import _image_processor, _video_processor, build_tiny_tokenizer, special_ids
    from transformers import AutoTokenizer

    out_dir.mkdir(parents=True, exist_ok=True)
    build_tiny_tokenizer(out_dir)
    ids = special_ids(AutoTokenizer.from_pretrained(out_dir))
    config = copy.deepcopy(config)
    if "vision_config" in config:
        config.update(image_token_id=ids.image_pad, video_token_id=ids.video_pad,
                      vision_start_token_id=ids.vision_start, vision_end_token_id=ids.vision_end)
        family = "qwen3_vl" if config["architectures"][0].startswith("Qwen3VL") else "qwen3_5"
        _image_processor(family).save_pretrained(str(out_dir))
        _video_processor(family).save_pretrained(str(out_dir))
    (out_dir / "config.json").write_text(json.dumps(config, indent=1))
    hf = hf_config(config)
    generator = torch.Generator().manual_seed(seed)
    shard: dict[str, torch.Tensor] = {}
    weight_map: dict[str, str] = {}
    shard_bytes = 0

    def flush() -> None:
        nonlocal shard, shard_bytes
        if shard:
            file = f"model-{len(set(weight_map.values())) + 1:05d}.safetensors"
            save_file(shard, str(out_dir / file), metadata={"format": "pt"})
            weight_map.update({name: file for name in shard})
            shard, shard_bytes = {}, 0

    tensors = hf_tensors(hf)
    for name, quantized in fp8_tensor_names(tensors, hf):
        shape = tensors[name][0]
        value = torch.randn(shape, generator=generator, dtype=torch.bfloat16).mul_(0.02)
        pieces = dict(zip((name, f"{name}_scale_inv"), quantize_weight(value))) if quantized else {name: value}
        for piece_name, piece in pieces.items():
            shard[piece_name] = piece
            shard_bytes += piece.numel() * piece.element_size()
        if shard_bytes >= SHARD_BYTES:
            flush()
    flush()
    index = {"metadata": {}, "weight_map": weight_map}
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index))
    return out_dir


# ------------------------------------------------------------------ measured in a fresh process


def rss_anon_bytes() -> int:
    """This process's anonymous resident memory (heap, tensors; not mapped files)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("/proc/self/status has no RssAnon line")


def release_freed_memory() -> None:
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def measure_here(model_dir: Path, quantization: Optional[str]) -> dict[str, Any]:
    """Load `model_dir` in this process's engine (CPU, bf16); its weight bytes and RSS growth."""
    from vlmrun.engine.engine import Engine
    from vlmrun.config import EngineConfig

    release_freed_memory()
    before = rss_anon_bytes()
    start = time.perf_counter()
    engine = Engine(EngineConfig(model=str(model_dir), device="cpu", dtype="bfloat16", quantization=quantization,
                                 kv_cache_memory_bytes=CACHE_BYTES, max_model_len=4096, max_num_seqs=4,
                                 linear_backend="torch", keep_freed_memory=False, enable_prefix_caching=False))
    seconds = time.perf_counter() - start
    release_freed_memory()
    stats = engine.stats()
    return {"weight_bytes": stats.weight_bytes[0], "rss_growth": rss_anon_bytes() - before, "load_s": seconds}


def measure(model_dir: Path, quantization: Optional[str] = None) -> dict[str, Any]:
    """`measure_here` in a fresh process (a clean RSS baseline, its memory gone after)."""
    command = [sys.executable, "-m", "bench.bench_quantized_memory", "--measure-one", str(model_dir)]
    if quantization is not None:
        command += ["--quantization", quantization]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"measuring {model_dir} failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


# ------------------------------------------------------------------ report


def gib(n: int) -> str:
    return f"{n / 2**30:.2f}"


def count_model(config: dict[str, Any]) -> dict[str, int]:
    """Counted bytes of each variant of `config` at its published shape (no vision variant without a tower)."""
    variants = VARIANTS if "vision_config" in config else VARIANTS[:2]
    return {variant: counted_bytes(with_variant(config, variant)) for variant in variants}


def measure_model(name: str, config: dict[str, Any], workdir: Path) -> list[dict[str, Any]]:
    """The cut copy of `config`: per variant, and for online FP8 of the bf16 checkpoint, the counted bytes
    and what the engine holds (`measure`)."""
    cut = cut_config(config)
    variants = [v for v in VARIANTS if v != "fp8+vision" or "vision_config" in cut]
    runs = [(variant, variant, None) for variant in variants] + [("online fp8", "bf16", "fp8")]
    rows = []
    with tempfile.TemporaryDirectory(dir=workdir, prefix="vlmrun-qmem-") as tmp:
        for label, checkpoint_variant, quantization in runs:
            checkpoint = Path(tmp) / checkpoint_variant
            if not checkpoint.exists():
                write_checkpoint(with_variant(cut, checkpoint_variant), checkpoint)
            counted = counted_bytes(with_variant(cut, checkpoint_variant), quantization)
            rows.append({"model": name, "variant": label, "counted": counted, **measure(checkpoint, quantization)})
            print(f"  {name} cut: {label}: counted {counted} B, engine {rows[-1]['weight_bytes']} B, "
                  f"RSS +{gib(rows[-1]['rss_growth'])} GiB, load {rows[-1]['load_s']:.1f} s", flush=True)
    return rows


def print_tables(counts: dict[str, dict[str, int]], rows: list[dict[str, Any]]) -> None:
    """The two tables of BENCHMARKS.md's section, in markdown."""
    print("\n| model | bf16 | FP8, vision tower bf16 | FP8, vision tower FP8 |")
    print("| --- | --- | --- | --- |")
    for name, bytes_of in counts.items():
        cells = [f"{gib(b)} GiB ({b / bytes_of['bf16']:.1%})" for v, b in bytes_of.items() if v != "bf16"]
        print(f"| {name} | {gib(bytes_of['bf16'])} GiB | " + " | ".join(cells + ["(no tower)"] * (2 - len(cells))) + " |")
    if not rows:
        return
    print("\n| model (cut) | weights | counted (bytes) | engine `weight_bytes` | RSS growth | load |")
    print("| --- | --- | --- | --- | --- | --- |")
    for row in rows:
        print(f"| {row['model']} | {row['variant']} | {row['counted']:,} | {row['weight_bytes']:,} | "
              f"{gib(row['rss_growth'])} GiB | {row['load_s']:.1f} s |")


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--configs", type=Path, default=CONFIGS, help="folder of the published config.json copies")
    parser.add_argument("--no-measure", action="store_true", help="count at the real shapes only")
    parser.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()),
                        help="where the cut checkpoints are written (deleted after each model)")
    parser.add_argument("--measure-one", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--quantization", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.measure_one is not None:
        print(json.dumps(measure_here(args.measure_one, args.quantization)))
        return 0
    print(f"# {date.today()}, {platform.processor() or platform.machine()}, torch {torch.__version__}")
    counts: dict[str, dict[str, int]] = {}
    rows: list[dict[str, Any]] = []
    for name in args.models:
        config = read_config(args.configs / MODELS[name])
        counts[name] = count_model(config)
        print(f"{name}: " + ", ".join(f"{v} {gib(b)} GiB" for v, b in counts[name].items()), flush=True)
        if not args.no_measure:
            rows += measure_model(name, config, args.workdir)
    print_tables(counts, rows)
    mismatches = [row for row in rows if row["counted"] != row["weight_bytes"]]
    for row in mismatches:
        print(f"MISMATCH {row['model']} {row['variant']}: counted {row['counted']} != engine {row['weight_bytes']}")
    return 1 if mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
