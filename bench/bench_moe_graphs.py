"""MoE decode with and without CUDA graphs, on a GPU: decode tokens/s at batch 1 and 64.

A random-weight bf16 checkpoint in Qwen3-VL-30B-A3B's published shapes (tests/configs: hidden 2048,
128 experts of width 768, 8 per token, head_dim 128, GQA 32 / 4), cut to `--layers` text layers and one
vision block, with the tests' tiny tokenizer; then three engines over it, one after the other:

- `vlmrun-fast`: FlashInfer attention, decode padded to buckets and replayed from CUDA graphs (the
  experts routed with torch's grouped GEMM, no host read: `SparseMoeBlock.step_capturable`); the
  script checks the graphs were captured;
- `vlmrun-fast-eager`: FlashInfer attention, `enforce_eager=True` (every step launched op by op);
- `vlmrun-torch`: the torch attention backend (no graphs: decode unpadded, `plan_bucketed_steps`).

Decode tokens/s as bench/bench_gpu.py measures it: `batch` text prompts run to 1 and to 1 + --tokens
tokens (EOS ignored), the median time of each (--repeats, after a warm-up); the difference over
--tokens steps. Greedy tokens of the graph and eager engines are compared (graphs plan FlashInfer's
decode per bucket, so they may part after a while: printed, not asserted). One JSON line per engine
(`--out`: appended, as bench_gpu's rows, so the acceptance report's speed table shows them).

    python3 -m bench.bench_moe_graphs --out /tmp/moe.jsonl
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import tempfile
import time
import traceback
from datetime import date
from pathlib import Path
from typing import Any, Callable

import torch

CONFIG = Path(__file__).resolve().parents[1] / "tests" / "configs" / "Qwen3-VL-30B-A3B-Instruct.json"
MODEL = "qwen3_vl_30b_a3b"  # the report's model name (with the layer count)
SIDES: dict[str, dict[str, Any]] = {
    "vlmrun-fast": {"attention_backend": "flashinfer"},
    "vlmrun-fast-eager": {"attention_backend": "flashinfer", "enforce_eager": True},
    "vlmrun-torch": {"attention_backend": "torch"},
}


def build_checkpoint(out_dir: Path, layers: int, device: str, experts: int = 0) -> Path:
    """The published config cut to `layers` text layers and one vision block, random bf16 weights (each
    matrix ~ N(0, 1 / fan_in), norms 1), the tiny tokenizer's vocabulary and special ids; `experts` > 0:
    that many experts instead of the published 128 (a CPU smoke run of the script)."""
    import transformers
    from transformers import AutoConfig, AutoTokenizer

    from testing.tiny_models import _padded_vocab, _write_generation_config, build_tiny_tokenizer, special_ids

    build_tiny_tokenizer(out_dir)
    ids = special_ids(AutoTokenizer.from_pretrained(str(out_dir)))
    raw = json.loads(CONFIG.read_text())
    text = raw["text_config"]
    text.update(num_hidden_layers=layers, vocab_size=_padded_vocab(len(AutoTokenizer.from_pretrained(str(out_dir)))),
                bos_token_id=ids.endoftext, eos_token_id=ids.im_end)
    if experts:
        text["num_experts"] = experts
    raw["vision_config"].update(depth=1, deepstack_visual_indexes=[0])
    raw.update(image_token_id=ids.image_pad, video_token_id=ids.video_pad, vision_start_token_id=ids.vision_start,
               vision_end_token_id=ids.vision_end)
    for part in (raw, text):
        part.pop("torch_dtype", None)
        part["dtype"] = "bfloat16"
    (out_dir / "config.json").write_text(json.dumps(raw, indent=2))
    config = AutoConfig.from_pretrained(str(out_dir))
    with torch.device(device):
        model = getattr(transformers, raw["architectures"][0])(config).to(torch.bfloat16).eval()
    gen = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() >= 2:
                param.normal_(0.0, param.shape[-1] ** -0.5, generator=gen)
            else:
                param.fill_(1.0)
    _write_generation_config(model, ids)
    model.save_pretrained(str(out_dir))
    del model
    return out_dir


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def median_seconds(fn: Callable[[], Any], repeats: int) -> float:
    times = []
    for _ in range(repeats + 1):  # the first: warm-up
        synchronize()
        start = time.perf_counter()
        fn()
        synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def measure(llm: Any, batch: int, tokens: int, repeats: int) -> tuple[float, list[list[int]]]:
    """Decode tokens/s at `batch` and the greedy tokens of the longer run."""
    from vlmrun import SamplingParams

    prompts = [f"Item {i}: tell me about the sea, the ships and the harbour number {i}." for i in range(batch)]
    outs: list = []

    def run(n: int) -> None:
        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        result = llm.generate(prompts, params, use_tqdm=False)
        assert all(o.error is None and len(o.token_ids) == n for o in result), result[0].error
        outs[:] = result

    one = median_seconds(lambda: run(1), repeats)
    many = median_seconds(lambda: run(1 + tokens), repeats)
    step = (many - one) / tokens
    return batch / step, [o.token_ids for o in outs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--sides", nargs="+", default=list(SIDES), choices=list(SIDES))
    parser.add_argument("--device", default="cuda", help="cpu only for a smoke run of the script itself")
    parser.add_argument("--experts", type=int, default=0, help="experts per layer (0: the published 128)")
    parser.add_argument("--tmp", default=None, help="folder for the random checkpoint")
    parser.add_argument("--out", type=Path, default=None, help="append one JSON line per engine")
    args = parser.parse_args()
    from vlmrun import LLM

    header = {"date": date.today().isoformat(), "torch": torch.__version__,
              "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"}
    name = f"{MODEL}_{args.layers}l" + (f"_{args.experts}e" if args.experts else "")
    tokens_of: dict[str, dict[int, list[list[int]]]] = {}
    with tempfile.TemporaryDirectory(dir=args.tmp) as tmp:
        model_dir = build_checkpoint(Path(tmp), args.layers, args.device, args.experts)
        for side in args.sides:
            options = SIDES[side]
            row: dict[str, Any] = {"model": name, "side": side, "attention_backend": options["attention_backend"],
                                   "gdn_backend": "", "enforce_eager": options.get("enforce_eager")}
            try:
                llm = LLM(str(model_dir), dtype="bfloat16", device=args.device, max_num_seqs=max(args.batches),
                          **options)
                padded = llm.engine.executor.bucketed_steps
                row["graphs"] = sorted(padded.graphs) if padded is not None else []
                row["padded"] = padded is not None
                if side == "vlmrun-fast" and args.device.startswith("cuda"):
                    assert row["graphs"], "MoE decode graphs were captured"
                tokens_of[side] = {}
                for batch in args.batches:
                    tok_s, tokens_of[side][batch] = measure(llm, batch, args.tokens, args.repeats)
                    row["decode_tok_s" if batch == 1 else f"decode_tok_s_b{batch}"] = tok_s
                del llm
            except Exception:
                row["error"] = traceback.format_exc(limit=8)
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            print(json.dumps({**header, **row}), flush=True)
            if args.out:
                with args.out.open("a") as f:
                    f.write(json.dumps({**header, **row}) + "\n")
    graphed, eager = tokens_of.get("vlmrun-fast", {}), tokens_of.get("vlmrun-fast-eager", {})
    for batch in sorted(set(graphed) & set(eager)):
        same = sum(g == e for g, e in zip(graphed[batch], eager[batch]))
        first = sum(g[:1] == e[:1] for g, e in zip(graphed[batch], eager[batch]))
        print(f"batch {batch}: graphs vs eager greedy tokens: {same} / {batch} identical, {first} / {batch} "
              f"agree on the first token", flush=True)


if __name__ == "__main__":
    main()
