"""Speculative decoding off and on, on the CPU: decode tokens/s at batch 1 and 16, mean accepted length.

Two engines over the bundled default model (`vlmrun-shapes-qwen3_5`, float32, a hybrid Gated
DeltaNet model), one plain and one with n-gram speculative decoding (`--spec`, default
{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2, "prompt_lookup_max": 4}),
in one process, run alternately (--rounds times each, the median reported). Each call captions
generated shape scenes with the model's own prompt (`DESCRIBE_PROMPT`), greedy, two workloads:
**captions** (up to --max-tokens, ending at EOS: 8 to 24 tokens) and **continued** (--max-tokens
tokens, EOS ignored: after its caption the model goes on in the JSON of its training records).
**decode tokens/s**: the tokens after each request's first, over the time from the batch's last
first token to its last finished request (`RequestOutput.metrics`; the prefill left out). The
speculating engine's tokens must equal the plain one's (checked), and its mean accepted length
(tokens per verify step: 1 + accepted drafts) and acceptance rate come from
`RequestOutput.metrics.spec_decode`.

The bundled model has no MTP layer, so method "mtp" has no figure here.

    python -m bench.bench_spec_decode --rounds 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from bench.common import describe_run
from testing.scene_drawing import render_scene
from vlmrun import LLM, SamplingParams
from vlmrun.shape_scenes import DESCRIBE_PROMPT, make_scene
from vlmrun.spec_decode.metrics import SpecDecodeStats

DEFAULT_SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2, "prompt_lookup_max": 4}


def caption_batch(llm: LLM, images: list, max_tokens: int,
                  ignore_eos: bool) -> tuple[float, list[list[int]], SpecDecodeStats]:
    """Decode tokens/s of one `generate` call over `images`, the token ids, and the summed speculation counters."""
    prompts = [{"prompt": DESCRIBE_PROMPT, "images": [image]} for image in images]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=ignore_eos),
                        use_tqdm=False)
    decode_start = max(o.metrics.first_token_time for o in outs)
    decode_end = max(o.metrics.finished_time for o in outs)
    stats = SpecDecodeStats()
    for out in outs:
        if out.metrics.spec_decode is not None:
            stats = stats.merged(out.metrics.spec_decode)
    decoded = sum(len(o.token_ids) - 1 for o in outs)
    return decoded / max(decode_end - decode_start, 1e-9), [o.token_ids for o in outs], stats


WORKLOADS = {"captions": False, "continued": True}  # name -> ignore_eos


def measure(engines: dict[str, LLM], args: argparse.Namespace) -> None:
    scenes = {batch: [render_scene(make_scene(11, batch * 100 + i)) for i in range(batch)] for batch in args.batches}
    for llm in engines.values():  # warm-up: first calls pack weights and fault memory in
        caption_batch(llm, scenes[args.batches[0]][:1], 8, ignore_eos=True)
    rates: dict[tuple[str, str, int], list[float]] = {}
    spec_stats: dict[tuple[str, int], SpecDecodeStats] = {}
    for r in range(args.rounds):
        for mode in (("off", "on") if r % 2 == 0 else ("on", "off")):
            for workload, ignore_eos in WORKLOADS.items():
                for batch in args.batches:
                    tok_s, tokens, stats = caption_batch(engines[mode], scenes[batch], args.max_tokens, ignore_eos)
                    rates.setdefault((mode, workload, batch), []).append(tok_s)
                    if mode == "on" and r == 0:
                        spec_stats[(workload, batch)] = stats
                        plain = caption_batch(engines["off"], scenes[batch], args.max_tokens, ignore_eos)[1]
                        assert tokens == plain, "speculation changed a greedy token"
    print(describe_run("bench.bench_spec_decode"))
    print(f"speculative_config: {json.dumps(args.spec)}")
    for workload in WORKLOADS:
        for batch in args.batches:
            off, on = (statistics.median(rates[(mode, workload, batch)]) for mode in ("off", "on"))
            stats = spec_stats[(workload, batch)]
            print(f"{workload}, batch {batch}: off {off:.1f} decode tok/s; on {on:.1f} ({on / off:.2f}x); mean "
                  f"accepted length {stats.mean_accepted_length:.2f}, acceptance {stats.acceptance_rate:.0%} "
                  f"({stats.num_accepted_tokens} of {stats.num_draft_tokens} drafts, {stats.num_drafts} verify steps)",
                  flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--spec", type=json.loads, default=DEFAULT_SPEC, help="the speculative_config, as JSON")
    args = parser.parse_args()
    engines = {mode: LLM(None, dtype="float32", device="cpu", speculative_config=args.spec if mode == "on" else None)
               for mode in ("off", "on")}
    measure(engines, args)
    for llm in engines.values():
        llm.engine.shutdown()


if __name__ == "__main__":
    main()
