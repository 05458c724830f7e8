"""torch.compile of the text decoder layers on the CPU, against the eager engine: is it worth it?

Two engines on the CPU bench checkpoint (bench/common.py) in one process; in one, every decoder layer's forward
is `torch.compile(..., dynamic=True)` (inductor's C++ backend) with the attention call left eager
(`torch.compiler.disable` on `Attention.forward`, so the paged-KV metadata never enters a graph).
Both engines run unpacked linear weights (`linear_backend="torch"`): dynamo cannot trace oneDNN's
packed weights, so compiling means giving the packing up (or inductor's own freezing pass).
With `--freezing`, inductor's freezing pass is on (`torch._inductor.config.freezing`): the weights
become constants of the graph, which it may pre-pack for oneDNN itself, the packing the eager
engine does by hand; the eager side then runs the default (packed) linears, so the two are each at
their best. The first run of the compiled engine (which compiles) is timed apart; then the two
alternate on the same fresh requests. Prints requests/s (best and median) and whether the greedy
tokens agree. An experiment, not an engine option: vlmrun does not compile its layers
(BENCHMARKS.md says why).

    python -m bench.bench_compile_layers --dtype bfloat16 --workload text --repeats 5
    python -m bench.bench_compile_layers --dtype bfloat16 --workload text --repeats 5 --freezing
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

import torch

from bench.common import DTYPES, WORKLOADS, build_checkpoint, generate_timed, hide_flash_linear_attention, make_requests


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16", choices=DTYPES)
    parser.add_argument("--workload", default="text", choices=WORKLOADS)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--freezing", action="store_true",
                        help="inductor's freezing pass on the compiled side; the eager side packed (the default)")
    args = parser.parse_args()
    hide_flash_linear_attention()
    from vlmrun import LLM
    from vlmrun.layers.attention.base import Attention

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_checkpoint(Path(tmp))
        # The compiled side unpacked: dynamo does not trace oneDNN's packed (opaque) weight tensors. The
        # eager side unpacked too, unless inductor's freezing may pack the compiled side's weights itself.
        import torch._inductor.config as inductor_config

        inductor_config.freezing = args.freezing
        llms = {"eager": LLM(str(model_dir), dtype=args.dtype, device="cpu",
                             linear_backend="auto" if args.freezing else "torch"),
                "compiled": LLM(str(model_dir), dtype=args.dtype, device="cpu", linear_backend="torch")}
        Attention.forward = torch.compiler.disable(Attention.forward)
        layers = [m for m in llms["compiled"].engine.executor.model.modules() if type(m).__name__.endswith("DecoderLayer")]
        for layer in layers:
            layer.forward = torch.compile(layer.forward, dynamic=True)

        def run(llm, seed: int) -> tuple[float, list[list[int]]]:
            seconds, outs = generate_timed(llm, *make_requests(args.requests, args.workload, seed, 32))
            return seconds, [o.token_ids for o in outs]

        for name, llm in llms.items():
            print(f"first run ({name}, compiling when compiled: {len(layers)} layers): {run(llm, 1000)[0]:.1f} s")
        rates: dict[str, list[float]] = {name: [] for name in llms}
        same = True
        for r in range(args.repeats):
            tokens = {}
            for name in (list(llms) if r % 2 == 0 else list(reversed(llms))):
                seconds, tokens[name] = run(llms[name], 1001 + r)
                rates[name].append(args.requests / seconds)
            same &= tokens["eager"] == tokens["compiled"]
        for name, rs in rates.items():
            print(f"{args.dtype} {args.workload} {name:9s} best {max(rs):6.2f} req/s, median {statistics.median(rs):6.2f}")
        print(f"compiled / eager: best {max(rates['compiled']) / max(rates['eager']):.2f}x, median "
              f"{statistics.median(rates['compiled']) / statistics.median(rates['eager']):.2f}x; "
              f"greedy tokens identical: {same}")


if __name__ == "__main__":
    main()
