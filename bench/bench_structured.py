"""Structured outputs on CPU with the bundled default model: throughput cost, and held-out accuracy.

throughput: R image requests (held-out scenes), each decoding exactly --max-tokens tokens, with
0 %, 50 % and 100 % of them constrained by a JSON schema (an array of at least 100 scene objects,
so no request ends early; the rest run with ignore_eos). Output tokens per second (prefill
included), the median of --repeats runs per mix (the order rotated each repeat), on one engine with prefix caching off, warmed up
on the same images both ways (so every mix finds their vision embeddings cached); the mixes run
interleaved.
Only the sampler's grammar work (host bitmask fill, mask, matcher advance) differs between mixes.

accuracy: the held-out scenes captioned three ways, greedy: plain (the caption must equal the
scene's canonical caption), asked for JSON (`DESCRIBE_JSON_PROMPT`) and constrained to
`vlmrun.shape_scenes.SCENE_SCHEMA` (the object must equal the scene's), and constrained to the model's
own caption language (`caption_grammar`), then parsed into the same objects (`caption_objects`).

    python -m bench.bench_structured throughput --requests 32 --max-tokens 64 --repeats 3
    python -m bench.bench_structured accuracy --scenes 300
    python -m bench.bench_structured mask --vocab 151936 --batch 32

mask: the sampler alone at a real Qwen vocabulary: one greedy step of --batch rows with 0 / 50 /
100 % grammar rows (a stand-in grammar that allows every other token; xgrammar's own bitmask fill
is left out: it needs the real tokenizer), median of 50 steps.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch

from testing.scene_drawing import render_scene
from testing.scene_splits import eval_scenes
from vlmrun import LLM, SamplingParams
from vlmrun.shape_scenes import (DESCRIBE_JSON_PROMPT, DESCRIBE_PROMPT, SCENE_SCHEMA, caption_grammar, caption_objects,
                                 scene_objects)

ENDLESS_SCHEMA = {"type": "array", "minItems": 100, "items": SCENE_SCHEMA["properties"]["shapes"]["items"]}


def requests(count: int, prompt: str = DESCRIBE_PROMPT) -> list[dict]:
    return [{"prompt": prompt, "images": [render_scene(s)]} for s in eval_scenes(count)]


def throughput(args: argparse.Namespace) -> None:
    llm = LLM(dtype="float32", device="cpu", enable_prefix_caching=False)
    prompts = requests(args.requests)
    plain = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    constrained = SamplingParams(temperature=0, max_tokens=args.max_tokens,
                                 structured_outputs={"json": ENDLESS_SCHEMA})
    llm.generate(prompts, plain, use_tqdm=False)  # warm-up: images encoded, the grammar compiled
    llm.generate(prompts, constrained, use_tqdm=False)
    shares = (0.0, 0.5, 1.0)
    rates: dict[float, list[float]] = {s: [] for s in shares}
    for repeat in range(args.repeats):
        for share in shares[repeat % 3:] + shares[:repeat % 3]:  # each mix takes each place in turn
            k = round(share * len(prompts))
            params = [constrained] * k + [plain] * (len(prompts) - k)
            start = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            elapsed = time.perf_counter() - start
            tokens = sum(len(o.token_ids) for o in outs)
            assert tokens == len(prompts) * args.max_tokens, "every request must decode --max-tokens tokens"
            rates[share].append(tokens / elapsed)
    base = statistics.median(rates[0.0])
    print(f"# {platform.processor() or platform.machine()}, torch threads {torch.get_num_threads()}, "
          f"{args.requests} requests x {args.max_tokens} tokens, median of {args.repeats}")
    print("| constrained | out tok/s | vs unconstrained | runs |")
    print("| --- | --- | --- | --- |")
    for share in shares:
        rate = statistics.median(rates[share])
        runs = ", ".join(f"{r:.1f}" for r in rates[share])
        print(f"| {share:.0%} | {rate:.1f} | {rate / base:.3f}x | {runs} |")


def accuracy(args: argparse.Namespace) -> None:
    llm = LLM(dtype="float32", device="cpu")
    scenes = eval_scenes(args.scenes)
    prompts = requests(args.scenes)
    truth = [scene_objects(s) for s in scenes]
    plain = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=64), use_tqdm=False)
    as_json = llm.generate(requests(args.scenes, DESCRIBE_JSON_PROMPT),
                           SamplingParams(temperature=0, max_tokens=400, structured_outputs={"json": SCENE_SCHEMA}),
                           use_tqdm=False)
    as_caption = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=64,
                                                      structured_outputs={"grammar": caption_grammar()}),
                              use_tqdm=False)

    def parsed_json(text: str):
        try:
            return json.loads(text)
        except ValueError:
            return None

    n = len(scenes)
    rows = [("plain caption == canonical caption", sum(o.text == s.caption for o, s in zip(plain, scenes))),
            ("JSON prompt + SCENE_SCHEMA, object == truth", sum(parsed_json(o.text) == t for o, t in zip(as_json, truth))),
            ("caption grammar, parsed object == truth",
             sum(caption_objects(o.text) == t for o, t in zip(as_caption, truth)))]
    print(f"# {n} held-out scenes (split seed 1), greedy, the bundled default model")
    print("| decoding | exact | share |")
    print("| --- | --- | --- |")
    for name, hits in rows:
        print(f"| {name} | {hits}/{n} | {hits / n:.1%} |")
    print(f"\nexample JSON output: {as_json[0].text}\nexample grammar output: {as_caption[0].text}")


class _EveryOther:
    """A stand-in grammar state: allows the even token ids."""

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        bitmask[row] = 0x55555555


def mask(args: argparse.Namespace) -> None:
    from vlmrun.layers.sampler import Sampler
    from vlmrun.layers.sampling_batch import SamplingBatch, SamplingRow

    logits = torch.randn(args.batch, args.vocab)
    params = SamplingParams(temperature=0)
    sampler = Sampler()
    print(f"# sampler step, {args.batch} rows x {args.vocab} vocab, greedy, CPU, torch threads {torch.get_num_threads()}")
    print("| grammar rows | ms / step |")
    print("| --- | --- |")
    for share in (0.0, 0.5, 1.0):
        k = round(share * args.batch)
        rows = [SamplingRow(params, [1], [], None, (), _EveryOther() if i < k else None) for i in range(args.batch)]
        times = []
        for _ in range(50):
            start = time.perf_counter()
            sampler.sample(logits, SamplingBatch.build(rows, args.vocab)).to_host()
            times.append(time.perf_counter() - start)
        print(f"| {share:.0%} | {statistics.median(times) * 1e3:.2f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="what", required=True)
    t = sub.add_parser("throughput")
    t.add_argument("--requests", type=int, default=32)
    t.add_argument("--max-tokens", type=int, default=64)
    t.add_argument("--repeats", type=int, default=3)
    a = sub.add_parser("accuracy")
    a.add_argument("--scenes", type=int, default=300)
    m = sub.add_parser("mask")
    m.add_argument("--vocab", type=int, default=151936)
    m.add_argument("--batch", type=int, default=32)
    args = parser.parse_args()
    {"throughput": throughput, "accuracy": accuracy, "mask": mask}[args.what](args)


if __name__ == "__main__":
    main()
