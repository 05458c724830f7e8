"""vlmrun vs HF transformers `generate` on CPU: requests/s for concurrent image requests.

Builds a random-weight Qwen3-VL checkpoint larger than the test ones (text hidden 512; weights do
not change the speed), then runs the same N requests (one image + a short prompt each, fixed
output length with EOS ignored) through `vlmrun.LLM.generate` and through HF's batched, left-padded
`generate`, and prints both rates and their ratio. Two workloads: `uniform` (every image 224x224,
every output max-tokens long: HF's best case, nothing padded) and `mixed` (photo-like sizes and
aspect ratios, so prompts differ in length, and output lengths uniform in max/4..max, as captions
of different detail; HF's batch runs every row to the longest, vlmrun retires each when done). Each side is warmed up on its own image set of the same sizes first, and each
timed run uses fresh images (no encoder-cache hits); the median of --repeats runs is reported.

    python bench/bench_cpu_vs_hf.py --requests 32 --max-tokens 32 --repeats 3
"""

from __future__ import annotations

import argparse
import sys
import platform
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout: vlmrun, tests


MAX_SIDE = 448  # the image processor's max_pixels is MAX_SIDE**2


def build_checkpoint(out_dir: Path) -> Path:
    from transformers import AutoTokenizer, GenerationConfig, Qwen3VLConfig, Qwen3VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from tests.tiny_models import build_tiny_tokenizer, reinit_weights, special_ids

    build_tiny_tokenizer(out_dir)
    tok = AutoTokenizer.from_pretrained(out_dir)
    ids = special_ids(tok)
    vocab = (len(tok) + 7) // 8 * 8
    config = Qwen3VLConfig(
        text_config=dict(vocab_size=vocab, hidden_size=512, intermediate_size=1536, num_hidden_layers=6,
                         num_attention_heads=8, num_key_value_heads=4, head_dim=64, max_position_embeddings=8192,
                         rms_norm_eps=1e-6, pad_token_id=ids.endoftext,
                         rope_parameters={"rope_type": "default", "rope_theta": 5_000_000.0,
                                          "mrope_section": [12, 10, 10], "mrope_interleaved": True}),
        vision_config=dict(depth=4, hidden_size=256, intermediate_size=1024, num_heads=4, out_hidden_size=512,
                           patch_size=16, spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=256,
                           deepstack_visual_indexes=[1, 2]),
        image_token_id=ids.image_pad, video_token_id=ids.video_pad, vision_start_token_id=ids.vision_start,
        vision_end_token_id=ids.vision_end, tie_word_embeddings=False,
        architectures=["Qwen3VLForConditionalGeneration"], dtype="float32",
    )
    torch.manual_seed(0)
    model = Qwen3VLForConditionalGeneration(config).eval()
    reinit_weights(model, 0)
    model.generation_config = GenerationConfig(eos_token_id=[ids.im_end, ids.endoftext], pad_token_id=ids.endoftext)
    model.save_pretrained(out_dir)
    factor = 32
    Qwen2VLImageProcessorPil(patch_size=16, merge_size=2, temporal_patch_size=2, min_pixels=4 * factor**2,
                             max_pixels=MAX_SIDE**2, image_mean=[0.5] * 3,
                             image_std=[0.5] * 3).save_pretrained(out_dir)
    return out_dir


def make_requests(n: int, workload: str, seed: int, max_tokens: int) -> tuple[list[Image.Image], list[int]]:
    """Images and per-request output lengths: all max_tokens for uniform, max/4..max for mixed."""
    rng = np.random.default_rng(seed + 7)
    if workload == "uniform":
        lengths = [max_tokens] * n
    else:
        lengths = [int(x) for x in rng.integers(max_tokens // 4, max_tokens + 1, size=n)]
    return make_images(n, workload, seed), lengths


def make_images(n: int, workload: str, seed: int) -> list[Image.Image]:
    rng = np.random.default_rng(seed)
    sizes = []
    for _ in range(n):
        if workload == "uniform":
            sizes.append((224, 224))
        else:  # mixed: photo-like sizes, 96..448 px a side, landscape and portrait
            sizes.append((int(rng.integers(96, MAX_SIDE + 1)), int(rng.integers(96, MAX_SIDE + 1))))
    return [Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)) for w, h in sizes]


class VlmrunSide:
    def __init__(self, model_dir: Path, max_tokens: int):
        from vlmrun import LLM, SamplingParams

        self.llm = LLM(str(model_dir), dtype="float32", device="cpu")
        self.params_cls = SamplingParams

    def run(self, images, lengths: list[int], prompt: str) -> tuple[float, int]:
        params = [self.params_cls(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
        start = time.perf_counter()
        outs = self.llm.generate([{"prompt": prompt, "images": [img]} for img in images], params, use_tqdm=False)
        return time.perf_counter() - start, sum(len(o.token_ids) for o in outs)


class HFSide:
    def __init__(self, model_dir: Path, max_tokens: int):
        from transformers import AutoModelForImageTextToText

        from tests.hf_reference import HFReference

        self.ref = HFReference(model_dir)
        self.ref.model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32,
                                                                     attn_implementation="sdpa").eval()
    def run(self, images, lengths: list[int], prompt: str) -> tuple[float, int]:
        return run_hf(self.ref, images, lengths, prompt)


def run_hf(ref, images, lengths: list[int], prompt: str) -> tuple[float, int]:
    """One batched generate: it runs every row to the longest requested length (its batch cannot
    retire rows early); only the tokens each request asked for are counted."""
    max_tokens = max(lengths)
    msgs = [[{"role": "user", "content": [{"type": "image", "image": img}, {"type": "text", "text": prompt}]}]
            for img in images]
    start = time.perf_counter()  # HF's preprocessing is timed too, as vlmrun's is
    singles = [ref.inputs(m) for m in msgs]
    width = max(s["input_ids"].shape[1] for s in singles)
    pad = ref.tokenizer.pad_token_id
    ids = torch.full((len(singles), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    types = torch.zeros((len(singles), width), dtype=torch.int32)
    for i, s in enumerate(singles):  # left padding
        n = s["input_ids"].shape[1]
        ids[i, width - n:] = s["input_ids"][0]
        mask[i, width - n:] = 1
        types[i, width - n:] = s["mm_token_type_ids"][0]
    with torch.no_grad():
        out = ref.model.generate(input_ids=ids, attention_mask=mask, mm_token_type_ids=types,
                                 pixel_values=torch.cat([s["pixel_values"] for s in singles]),
                                 image_grid_thw=torch.cat([s["image_grid_thw"] for s in singles]),
                                 max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False)
    elapsed = time.perf_counter() - start
    assert out.shape[1] - width == max_tokens
    return elapsed, sum(lengths)


def measure(side, workload: str, n: int, max_tokens: int, prompt: str, repeats: int) -> tuple[float, int]:
    side.run(*make_requests(n, workload, 1000, max_tokens), prompt)  # warm-up: other pixels
    runs = sorted(side.run(*make_requests(n, workload, 1000 + r + 1, max_tokens), prompt) for r in range(repeats))
    return runs[len(runs) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workloads", nargs="+", default=["uniform", "mixed"], choices=["uniform", "mixed"])
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    prompt = "Describe the image in one sentence."
    print(f"device: CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads), "
          f"torch {torch.__version__}; Qwen3-VL random weights (text hidden 512, 6 layers; vision 256 x 4)")
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_checkpoint(Path(tmp))
        sides = {"vlmrun": VlmrunSide(model_dir, args.max_tokens), "HF": HFSide(model_dir, args.max_tokens)}
        for workload in args.workloads:
            lengths = f"{args.max_tokens}" if workload == "uniform" else f"{args.max_tokens // 4}..{args.max_tokens}"
            print(f"workload {workload}: {args.requests} requests, one image each, {lengths} output tokens, "
                  f"median of {args.repeats}")
            rates = {}
            for name, side in sides.items():
                t, n = measure(side, workload, args.requests, args.max_tokens, prompt, args.repeats)
                rates[name] = args.requests / t
                print(f"  {name:7s} {t:6.2f}s  {args.requests / t:6.2f} req/s  {n / t:7.1f} out tok/s")
            print(f"  ratio vlmrun / HF requests/s: {rates['vlmrun'] / rates['HF']:.2f}x")


if __name__ == "__main__":
    main()
