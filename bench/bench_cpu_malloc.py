"""vlmrun on the CPU with and without `keep_freed_memory` (glibc's malloc keeping freed blocks).

The setting is process-wide, so each side runs in a process of its own, the two alternating
(`--rounds` times each): the CPU bench checkpoint and workloads (bench/common.py), a warm-up run then
`--repeats` timed runs per workload and dtype. Per side it prints requests/s (median of its
processes' medians) and, per timed run, the minor page faults, the system CPU time (the kernel's:
faulting memory in is counted there) and the process's whole CPU time (user + system, both
threads; steadier than wall time on a shared machine) beside the wall time.

    python -m bench.bench_cpu_malloc --dtypes float32 bfloat16 --workloads uniform mixed text
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import tempfile
from pathlib import Path

from bench.common import (DTYPES, WORKLOADS, VlmrunSide, build_checkpoint, hide_flash_linear_attention, make_requests,
                          run_child)


def run_side(keep: bool, dtypes: list[str], workloads: list[str], repeats: int) -> dict:
    """In this process: {"dtype workload": [rate, faults, sys s, user + sys s, wall s]} (the last four per run)."""
    hide_flash_linear_attention()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_checkpoint(Path(tmp))
        for dtype in dtypes:
            side = VlmrunSide(model_dir, dtype, keep_freed_memory=keep)
            for workload in workloads:
                side.run(*make_requests(32, workload, 1000, 32))
                before, seconds = resource.getrusage(resource.RUSAGE_SELF), []
                for r in range(repeats):
                    seconds.append(side.run(*make_requests(32, workload, 1001 + r, 32))[0])
                after = resource.getrusage(resource.RUSAGE_SELF)
                cpu = (after.ru_stime + after.ru_utime) - (before.ru_stime + before.ru_utime)
                results[f"{dtype} {workload}"] = [32 / statistics.median(seconds),
                                                  (after.ru_minflt - before.ru_minflt) / repeats,
                                                  (after.ru_stime - before.ru_stime) / repeats, cpu / repeats,
                                                  sum(seconds) / repeats]
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=DTYPES)
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=WORKLOADS)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2, help="processes per side, the sides alternating")
    parser.add_argument("--side", choices=["keep", "off"], help=argparse.SUPPRESS)  # one side, in a subprocess
    args = parser.parse_args()
    if args.side:
        print(json.dumps(run_side(args.side == "keep", args.dtypes, args.workloads, args.repeats)))
        return
    runs: dict[str, list[dict]] = {"off": [], "keep": []}
    for _ in range(args.rounds):
        for side in runs:
            runs[side].append(run_child(__spec__.name, ["--side", side, "--repeats", str(args.repeats),
                                                        "--dtypes", *args.dtypes, "--workloads", *args.workloads]))
            print(f"{side}: " + "; ".join(f"{k} {v[0]:.2f} req/s" for k, v in runs[side][-1].items()), flush=True)
    print(f"vlmrun, keep_freed_memory=False (glibc's defaults) vs True, {args.rounds} processes each, "
          f"{args.repeats} timed runs per process:")
    for key in runs["keep"][0]:
        cells = []
        for side in ("off", "keep"):
            rate = statistics.median(r[key][0] for r in runs[side])
            faults = statistics.median(r[key][1] for r in runs[side])
            sys_s, cpu_s, wall = (statistics.median(r[key][i] for r in runs[side]) for i in (2, 3, 4))
            cells.append(f"{side} {rate:6.2f} req/s ({faults:6.0f} faults, sys {sys_s:.2f} s, CPU {cpu_s:.2f} s, "
                         f"wall {wall:.2f} s a run)")
        off, keep = (statistics.median(r[key][0] for r in runs[s]) for s in ("off", "keep"))
        print(f"  {key:18s} " + " | ".join(cells) + f" | keep / off {keep / off:.2f}x", flush=True)


if __name__ == "__main__":
    main()
