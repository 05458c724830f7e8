"""vlmrun vs HF transformers `generate` on CPU: requests/s for concurrent image requests.

Builds a random-weight Qwen3-VL checkpoint larger than the test ones (text hidden 512; weights do
not change the speed), then runs the same N requests (one image + a short prompt each, fixed
output length with EOS ignored) through `vlmrun.LLM.generate` and through HF's batched, left-padded
`generate`, and prints both rates and their ratio.

    python bench/bench_cpu_vs_hf.py --requests 32 --max-tokens 32
"""

from __future__ import annotations

import argparse
import platform
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image


def build_checkpoint(out_dir: Path, image_side: int) -> Path:
    from transformers import AutoTokenizer, GenerationConfig, Qwen3VLConfig, Qwen3VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from vlmrun.tiny_models import build_tiny_tokenizer, reinit_weights, special_ids

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
                             max_pixels=(image_side // factor) ** 2 * factor**2, image_mean=[0.5] * 3,
                             image_std=[0.5] * 3).save_pretrained(out_dir)
    return out_dir


def make_images(n: int, side: int) -> list[Image.Image]:
    rng = np.random.default_rng(0)
    return [Image.fromarray(rng.integers(0, 255, (side, side, 3), dtype=np.uint8)) for _ in range(n)]


def run_vlmrun(model_dir: Path, images, prompt: str, max_tokens: int) -> tuple[float, int]:
    from vlmrun import LLM, SamplingParams

    llm = LLM(str(model_dir), dtype="float32", device="cpu")
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate([{"prompt": prompt, "images": [images[0]]}], params, use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outs = llm.generate([{"prompt": prompt, "images": [img]} for img in images], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    return elapsed, sum(len(o.token_ids) for o in outs)


def run_hf(model_dir: Path, images, prompt: str, max_tokens: int) -> tuple[float, int]:
    from transformers import AutoModelForImageTextToText

    from tests.hf_reference import HFReference

    ref = HFReference(model_dir)
    ref.model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32,
                                                            attn_implementation="sdpa").eval()
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
    return elapsed, int((out.shape[1] - width) * len(singles))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--image-side", type=int, default=224)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    prompt = "Describe the image in one sentence."
    images = make_images(args.requests, args.image_side)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_checkpoint(Path(tmp), args.image_side)
        t_v, n_v = run_vlmrun(model_dir, images, prompt, args.max_tokens)
        t_h, n_h = run_hf(model_dir, images, prompt, args.max_tokens)
    print(f"device: CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads), "
          f"torch {torch.__version__}")
    print(f"workload: {args.requests} requests, one {args.image_side}x{args.image_side} image each, "
          f"{args.max_tokens} output tokens, Qwen3-VL random weights (text hidden 512, 6 layers)")
    print(f"vlmrun: {t_v:.2f}s  {args.requests / t_v:.2f} req/s  {n_v / t_v:.1f} out tok/s")
    print(f"HF    : {t_h:.2f}s  {args.requests / t_h:.2f} req/s  {n_h / t_h:.1f} out tok/s")
    print(f"ratio (vlmrun / HF requests/s): {t_h / t_v:.2f}x")


if __name__ == "__main__":
    main()
