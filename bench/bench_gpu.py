"""vlmrun vs HF transformers on one CUDA GPU, random weights in published Qwen configs.

Three figures per model, both sides measured in the same run, bf16:

- **decode** tokens/s at batch 1 (and at each of --decode-batches): B requests of one 448x448 image +
  prompt, `t(N+1 tokens) - t(1 token)` over N tokens (median of --repeats, fresh images each run so
  no cache hides the prefill), B tokens per step; at batch 1 also its fraction of the bandwidth floor: the bytes one decode step must read (every text-stack weight once,
  the LM head, the KV of the context, GDN state read and written) over the device-to-device copy
  bandwidth measured on this GPU in the same run;
- **caption**: R requests of one SxS image + prompt, T output tokens each (EOS ignored), images/s;
- **TTFT**: one 1024x1024 image + prompt, wall time from the decoded image to the first token.

HF is driven as its users run it: `AutoProcessor` with the checkpoint's default image processor
(the torchvision `Qwen2VLImageProcessor`), `apply_chat_template(..., tokenize=True)` on the whole
batch (left padding), one `generate` call, SDPA attention; flash-linear-attention is used by HF's
Qwen3.5 layers when it is installed. vlmrun runs `LLM.generate` with its defaults on CUDA (or the
kernels the command line names), as the side `vlmrun-fast` with the CUDA fast path (FlashInfer,
flash-linear-attention, decode CUDA graphs) over them, and as `vlmrun-torch` with the torch backends. With `VLMRUN_FLA_PINNED_CONFIGS=1` FLA's
kernels run one pinned config each, for HF's side too (`fla_backend.pin_fla_configs`). Sections run
in the order decode, caption, TTFT; past --time-limit-s the rest are skipped (their row says so).

    python -m bench.bench_gpu --models qwen3_vl_2b qwen3_5_27b_4l --out bench_gpu.jsonl
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
import statistics
import tempfile
import time
import traceback
from datetime import date
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import numpy as np
import torch
from PIL import Image

from vlmrun.cli_options import add_kernel_args, kernel_options
from vlmrun.layers.attention.fla_backend import PIN_CONFIGS_ENV, pin_fla_configs

CONFIGS = Path(__file__).resolve().parents[2] / "shared" / "configs"
PROMPT = "Describe the image."
SIDES = ("vlmrun", "vlmrun-fast", "vlmrun-torch", "HF")
# the kernels of the sides that name them, over the command line's: the fast path, the torch path
SIDE_KERNELS = {"vlmrun-fast": {"attention_backend": "flashinfer", "gdn_backend": "fla"},
                "vlmrun-torch": {"attention_backend": "torch", "gdn_backend": "torch"}}
# name: (published config file, text layers kept or None for all)
MODELS: dict[str, tuple[str, int | None]] = {
    "qwen3_vl_2b": ("Qwen3-VL-2B-Instruct.json", None),
    "qwen3_5_27b_4l": ("Qwen3.5-27B.json", 4),  # 27B's per-layer shapes, 3 GDN + 1 full-attention layer
}
PREPROCESSOR = {  # Qwen3-VL / Qwen3.5's published preprocessor, torchvision class (HF's default)
    "image_processor_type": "Qwen2VLImageProcessor", "do_resize": True, "do_rescale": True,
    "rescale_factor": 1 / 255, "do_normalize": True, "do_convert_rgb": True, "image_mean": [0.5] * 3,
    "image_std": [0.5] * 3, "patch_size": 16, "temporal_patch_size": 2, "merge_size": 2, "resample": 3,
    "size": {"shortest_edge": 65536, "longest_edge": 16777216},
}


# ------------------------------------------------------------------ checkpoint


def build_checkpoint(name: str, out_dir: Path, config_dir: Path, layers: int | None = None,
                     device: str = "cuda") -> Path:
    """A random-weight bf16 checkpoint in the published config's shapes, with the tiny tokenizer."""
    from transformers import AutoConfig, AutoModelForImageTextToText, AutoTokenizer, GenerationConfig

    from testing.tiny_models import build_tiny_tokenizer, special_ids

    file, kept = MODELS[name]
    layers = layers or kept
    work = out_dir / "published"
    work.mkdir(parents=True, exist_ok=True)
    (work / "config.json").write_text((config_dir / file).read_text())
    config = AutoConfig.from_pretrained(work)
    build_tiny_tokenizer(out_dir)
    ids = special_ids(AutoTokenizer.from_pretrained(out_dir))
    text = config.text_config
    if layers is not None:
        text.num_hidden_layers = layers
        if getattr(text, "layer_types", None):
            text.layer_types = text.layer_types[:layers]
    for key, value in dict(image_token_id=ids.image_pad, video_token_id=ids.video_pad,
                           vision_start_token_id=ids.vision_start, vision_end_token_id=ids.vision_end).items():
        setattr(config, key, value)
    text.pad_token_id = ids.endoftext
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForImageTextToText.from_config(config, dtype=torch.bfloat16)
    model.generation_config = GenerationConfig(eos_token_id=[ids.im_end, ids.endoftext], pad_token_id=ids.endoftext)
    model.save_pretrained(out_dir)
    del model
    (out_dir / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR, indent=1))
    return out_dir


def random_image(side: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    small = rng.integers(0, 256, (side // 8, side // 8, 3), dtype=np.uint8)
    return Image.fromarray(small).resize((side, side), Image.BILINEAR)


# ------------------------------------------------------------------ the two sides


class VlmrunSide:
    name = "vlmrun"

    def __init__(self, model_dir: Path, cache_bytes: int, device: str, kernels: dict[str, Any]):
        from vlmrun import LLM, SamplingParams

        self.llm = LLM(str(model_dir), dtype="bfloat16", device=device, kv_cache_memory_bytes=cache_bytes, **kernels)
        self.params = SamplingParams

    def run(self, images: list[Image.Image], max_tokens: int) -> int:
        params = self.params(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        outs = self.llm.generate([{"prompt": PROMPT, "images": [img]} for img in images], params, use_tqdm=False)
        assert all(o.error is None and len(o.token_ids) == max_tokens for o in outs), outs[0].error
        return sum(len(o.token_ids) for o in outs)

    def decode_bytes_per_step(self, context_tokens: int) -> int:
        runner = self.llm.engine.executor
        total = 0
        for pname, p in runner.model.named_parameters():
            if "visual" in pname:
                continue
            if "embed_tokens" in pname:  # one row is read; a tied LM head reads all of it
                tied = runner.model.lm_head.weight is p
                total += p.numel() * p.element_size() if tied else 0
                continue
            total += p.numel() * p.element_size()
        plan = self.llm.engine.caches.plan
        total += context_tokens * plan.kv_bytes_per_token
        total += 2 * plan.gdn_bytes_per_request  # GDN conv + recurrent state, read and written
        return total


class HFSide:
    name = "HF"

    def __init__(self, model_dir: Path, device: str):
        from transformers import AutoModelForImageTextToText, AutoProcessor

        self.processor = AutoProcessor.from_pretrained(model_dir)
        self.processor.tokenizer.padding_side = "left"
        self.model = AutoModelForImageTextToText.from_pretrained(
            model_dir, dtype=torch.bfloat16, attn_implementation="sdpa", device_map=device).eval()
        self.device = device

    def run(self, images: list[Image.Image], max_tokens: int, batch_size: int = 0) -> int:
        batch_size = batch_size or len(images)
        done = 0
        for i in range(0, len(images), batch_size):
            msgs = [[{"role": "user", "content": [{"type": "image", "image": img}, {"type": "text", "text": PROMPT}]}]
                    for img in images[i:i + batch_size]]
            inputs = self.processor.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True,
                                                        return_dict=True, return_tensors="pt", padding=True)
            inputs = inputs.to(self.device)
            with torch.inference_mode():
                out = self.model.generate(**inputs, max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                                          do_sample=False)
            assert out.shape[1] - inputs["input_ids"].shape[1] == max_tokens
            done += len(msgs) * max_tokens
        return done


# ------------------------------------------------------------------ measurements


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn: Callable[[], Any]) -> float:
    synchronize()
    start = time.perf_counter()
    fn()
    synchronize()
    return time.perf_counter() - start


def copy_bandwidth() -> float:
    """Device-to-device copy, bytes read + written per second (median of 20 copies of 1 GiB)."""
    if not torch.cuda.is_available():
        return float("nan")
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    times = []
    for _ in range(20):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return 2 * src.numel() / statistics.median(times)


class Seeds:
    """A fresh image seed for every run, so neither side's caches (vlmrun's encoder and prefix
    caches) ever see the same pixels twice."""

    def __init__(self) -> None:
        self.next = 10_000

    def take(self, n: int = 1) -> list[int]:
        self.next += n
        return list(range(self.next - n, self.next))


def measure_decode(side, seeds: Seeds, tokens: int, repeats: int, batch: int = 1) -> dict:
    """Batch 1's keys are decode_step_ms / decode_tok_s; batch B's end in _b{B}."""
    def run(n: int) -> float:
        images = [random_image(448, s) for s in seeds.take(batch)]
        return timed(lambda: side.run(images, n))

    one = [run(1) for _ in range(repeats + 1)][1:]
    many = [run(tokens + 1) for _ in range(repeats + 1)][1:]
    step = (statistics.median(many) - statistics.median(one)) / tokens
    tag = "" if batch == 1 else f"_b{batch}"
    return {f"decode_step_ms{tag}": step * 1e3, f"decode_tok_s{tag}": batch / step,
            f"prefill_1_token_s{tag}": statistics.median(one)}


def measure_decode_batches(side, seeds: Seeds, args: argparse.Namespace) -> Iterator[dict]:
    """Each batch size's figures as soon as they are measured; past the deadline the rest are skipped."""
    for batch in args.decode_batches:
        if time.monotonic() > args.deadline:
            yield {f"decode_b{batch}_skipped": f"past --time-limit-s {args.time_limit_s}"}
            continue
        yield measure_decode(side, seeds, args.decode_tokens, args.repeats, batch)


def measure_caption(side, seeds: Seeds, requests: int, side_px: int, tokens: int) -> dict:
    side.run([random_image(side_px, s) for s in seeds.take(min(requests, 16))], tokens)  # warm-up
    images = [random_image(side_px, s) for s in seeds.take(requests)]
    elapsed = timed(lambda: side.run(images, tokens))
    return {"caption_s": elapsed, "caption_images_s": requests / elapsed,
            "caption_out_tok_s": requests * tokens / elapsed}


def measure_ttft(side, seeds: Seeds, repeats: int) -> dict:
    runs = [timed(lambda s=s: side.run([random_image(1024, s)], 1)) for s in seeds.take(repeats + 2)][2:]
    return {"ttft_ms": statistics.median(runs) * 1e3, "ttft_runs_ms": [round(r * 1e3, 1) for r in runs]}


def profile_decode(side, seeds: Seeds, tokens: int = 32) -> dict:
    """torch.profiler over one batch-1 request: where a step's host and device time go."""
    from torch.profiler import ProfilerActivity, profile

    side.run([random_image(448, seeds.take()[0])], tokens)  # warm-up
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        side.run([random_image(448, seeds.take()[0])], tokens)
    events = prof.key_averages()
    print(events.table(sort_by="self_cpu_time_total", row_limit=30), flush=True)
    print(events.table(sort_by="self_cuda_time_total", row_limit=15), flush=True)
    counts = {e.key: e.count for e in events if e.key in ("cudaStreamSynchronize", "cudaMemcpyAsync",
                                                          "cudaLaunchKernel", "aten::item", "aten::nonzero")}
    return {"profile_" + k: v for k, v in counts.items()}


# section -> its measurement of one side (the side, its image seeds, the command line): figures as they come
SECTIONS: dict[str, Callable[[Any, Seeds, argparse.Namespace], Iterable[dict]]] = {
    "decode": measure_decode_batches,
    "caption": lambda side, seeds, args: [measure_caption(side, seeds, args.caption_requests, args.caption_px,
                                                          args.caption_tokens)],
    "ttft": lambda side, seeds, args: [measure_ttft(side, seeds, args.repeats)],
    "profile": lambda side, seeds, args: [profile_decode(side, seeds)],
}


def side_kernels(side_name: str, args: argparse.Namespace) -> dict[str, Any]:
    """A vlmrun side's engine options: the command line's kernels, with the side's own over them."""
    return {**kernel_options(args), **SIDE_KERNELS.get(side_name, {})}


def bench_model(name: str, args, bandwidth: float, log) -> None:
    with tempfile.TemporaryDirectory(dir=args.tmp) as tmp:
        model_dir = build_checkpoint(name, Path(tmp), args.configs, args.layers, args.device)
        for side_name in args.sides:
            seeds = Seeds()
            row: dict[str, Any] = {"model": name, "side": side_name}
            is_vlmrun = side_name != "HF"
            if is_vlmrun:
                row.update(side_kernels(side_name, args))
            try:
                side = (VlmrunSide(model_dir, args.cache_gib << 30, args.device, side_kernels(side_name, args))
                        if is_vlmrun
                        else HFSide(model_dir, args.device))
                for what, measure in SECTIONS.items():
                    if what not in args.sections:
                        continue
                    if time.monotonic() > args.deadline:
                        row[f"{what}_skipped"] = f"past --time-limit-s {args.time_limit_s}"
                        continue
                    try:
                        for figures in measure(side, seeds, args):
                            row.update(figures)
                    except Exception:  # one failed section must not lose the others
                        row[f"{what}_error"] = traceback.format_exc(limit=6)
                        print(row[f"{what}_error"], flush=True)
                if is_vlmrun and "decode_step_ms" in row:
                    context = 230 + args.decode_tokens // 2  # ~ prompt (448^2 image) + half the outputs
                    step_bytes = side.decode_bytes_per_step(context)
                    floor_s = step_bytes / bandwidth
                    row.update(decode_bytes_per_step=step_bytes, decode_floor_ms=floor_s * 1e3,
                               bandwidth_fraction=floor_s / (row["decode_step_ms"] / 1e3))
                del side
            except Exception:
                row["error"] = traceback.format_exc(limit=8)
                print(row["error"], flush=True)
            except KeyboardInterrupt:  # the acceptance run's time limit: keep what was measured
                row["error"] = "interrupted (time limit)"
                log(row)
                raise
            gc.collect()  # free one side's weights and cache before the other loads
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            log(row)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--sides", nargs="+", default=["vlmrun", "HF"], choices=list(SIDES))
    parser.add_argument("--sections", nargs="+", default=["decode", "caption", "ttft"], choices=list(SECTIONS))
    parser.add_argument("--configs", type=Path, default=CONFIGS)
    parser.add_argument("--decode-tokens", type=int, default=256)
    parser.add_argument("--decode-batches", nargs="+", type=int, default=[1], help="decode tokens/s at these batch sizes")
    parser.add_argument("--time-limit-s", type=float, default=None, help="skip the sections that would start later")
    parser.add_argument("--caption-requests", type=int, default=256)
    parser.add_argument("--caption-px", type=int, default=448)
    parser.add_argument("--caption-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--cache-gib", type=int, default=24, help="vlmrun's KV + GDN budget")
    parser.add_argument("--layers", type=int, default=None, help="keep this many text layers (smoke runs)")
    parser.add_argument("--device", default="cuda", help="cpu only for a smoke run of the script itself")
    parser.add_argument("--tmp", default=None, help="folder for the random checkpoints")
    parser.add_argument("--out", type=Path, default=None, help="append one JSON line per model and side")
    add_kernel_args(parser)  # vlmrun's kernels: --attention-backend flashinfer --gdn-backend fla for the fast path
    args = parser.parse_args()
    args.deadline = time.monotonic() + (args.time_limit_s or float("inf"))
    if os.environ.get(PIN_CONFIGS_ENV) == "1" and importlib.util.find_spec("fla"):
        pin_fla_configs()  # before either side runs FLA's kernels (HF's Qwen3.5 layers use them too)

    bandwidth = copy_bandwidth()
    device_name = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    header = {"date": date.today().isoformat(), "device": device_name, "torch": torch.__version__,
              "copy_bandwidth_GBs": bandwidth / 1e9}
    import transformers

    header["transformers"] = transformers.__version__
    print(json.dumps(header), flush=True)

    def log(row: dict) -> None:
        print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}), flush=True)
        if args.out:
            with args.out.open("a") as f:
                f.write(json.dumps({**header, **row}) + "\n")

    for name in args.models:
        bench_model(name, args, bandwidth, log)


if __name__ == "__main__":
    main()
