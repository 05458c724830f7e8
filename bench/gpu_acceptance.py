"""The GPU acceptance run: vlmrun's GPU speed figures and checks in ONE device call of under ten minutes.

On the lent GPU machine (torch, triton; no registry; nvcc is not needed), from the repository root,
carrying `.whl` (bench/gpu_wheels.sh: the wheels the machine lacks and FlashInfer's kernels built
ahead for sm_90a) and `.cache/gpu_carry` (the Triton cache a previous call brought back, if any):

    python3 -m bench.gpu_acceptance --commit SHA --out $OUT

It installs the wheels once into a target folder (`--site`), then runs bench/gpu_checks.py's plan:
setup (the Triton cache restored, every FlashInfer module loaded from the kernel wheel), speed
(bench/bench_gpu.py per model: fast path, torch path, HF side by side), the fast path's correctness,
then the rest as time allows: each check a command with its own time limit, its output in
`<log-dir>/<check>.log`. Planned checks (tiers 0-2) run with what is left of `--budget` when that is
less than their limit; a tier-3 check starts only when its whole limit fits; a check not started is
reported "not run". At the end the Triton cache is packed for the next call and one report is
written whose first section is the speed table (each figure with device, date and commit), then
pass / fail per check: `--out` receives report.md, report.json, logs.tar.gz and triton_cache.tar.gz.

`--dry-run` (any machine, no CUDA) prints the plan with its time limits, checks that the planned
limits fit the call's budget and that every test, script, benchmark model and config named exists;
tests/test_gpu_acceptance.py runs it in CI, so the plan cannot rot. Only the standard library is
imported here: the wheels are not importable until the script has installed them.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Optional

from bench.gpu_checks import (
    CALL_BUDGET_S,
    CHECK_ENV,
    CHECKS,
    HARVEST,
    INSTALL_TIMEOUT_S,
    KILL_GRACE_S,
    PYTHON,
    REPORT_SECONDS,
    ROOT,
    TIERS,
    Check,
    missing_names,
    plan_seconds,
)
from bench.gpu_report import Result, closing_line, export, markdown, outcome, read_figures

# ------------------------------------------------------------------ the dry run


def dry_run(checks: list[Check], budget: int) -> int:
    problems = []
    print(f"one device call: `{PYTHON} -m bench.gpu_acceptance --commit SHA --out $OUT`, budget {budget} s "
          f"(a device command may run 600 s)")
    print(f"[{TIERS[0]}] install (limit {INSTALL_TIMEOUT_S} s): the carried wheels into --site, once")
    for check in checks:
        print(f"[{TIERS[check.tier]}] {check.name} (limit {check.timeout_s} s): {check.what}")
        print("    " + shlex.join(check.command))
        problems += [f"{check.name}: {name} does not exist" for name in missing_names(check)]
    print(f"[report] {HARVEST.name}, report.md, logs (limit {REPORT_SECONDS} s)")
    travels = carried_bytes()
    if travels is not None:
        print(f"[carry] the tree, .whl and .cache/gpu_carry: {travels / 2**20:.1f} MiB of the {CARRY_LIMIT_MIB} MiB a call carries")
        if travels > CARRY_LIMIT_MIB * 2**20:
            problems.append(f"{travels / 2**20:.1f} MiB would travel, over {CARRY_LIMIT_MIB} MiB")
    total = plan_seconds(checks)
    print(f"planned (install, tiers 0-2, report): their limits add up to {total} s of the {budget} s budget; "
          f"tier 3 runs in what they leave")
    if total > budget:
        problems.append(f"the planned checks' limits add up to {total} s, over the call's {budget} s")
    for problem in problems:
        print("MISSING " + problem)
    return 1 if problems else 0


CARRY_LIMIT_MIB = 64
CARRIED = [".whl", ".cache/gpu_carry"]  # the ignored folders the call carries


def carried_bytes() -> Optional[int]:
    """What a device call from this checkout carries: git's tracked files, the untracked ones it does
    not ignore, and the carried folders. None where git is not there."""
    try:
        listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                                capture_output=True, check=True).stdout.split(b"\0")
    except (FileNotFoundError, subprocess.CalledProcessError):
        return None
    files = [ROOT / name.decode() for name in listed if name]
    files += [p for folder in CARRIED for p in (ROOT / folder).rglob("*")]
    return sum(p.stat().st_size for p in files if p.is_file() and not p.is_symlink())


# ------------------------------------------------------------------ the call


def run_call(args: argparse.Namespace, checks: list[Check]) -> int:
    start = time.monotonic()
    deadline = start + args.budget
    log_dir = args.log_dir.resolve()
    log_dir.mkdir(parents=True, exist_ok=True)
    (log_dir / "bench.jsonl").unlink(missing_ok=True)
    env = child_env(args.site)
    results: list[Result] = [install_wheels(args.wheels, args.site, log_dir)]
    for check in checks:
        left = int(deadline - time.monotonic() - REPORT_SECONDS)  # a check's kill grace comes out of the slack to 600 s
        if check.tier == 3 and left < check.timeout_s or left < min(check.timeout_s, 20):
            results.append(Result(check.name, check.tier, check.what, "not run", 0.0,
                                  f"{max(left, 0)} s of the call's budget left", ""))
            continue
        results.append(run_check(check, log_dir, env, min(check.timeout_s, left)))
    if args.out:
        harvest = replace(HARVEST, command=[part.format(out=args.out) for part in HARVEST.command])
        results.append(run_check(harvest, log_dir, env))
    report = {**run_info(args), "seconds": round(time.monotonic() - start), "checks": [asdict(r) for r in results],
              "figures": read_figures(log_dir / "bench.jsonl", commit(args.commit))}
    (log_dir / "report.json").write_text(json.dumps(report, indent=1))
    (log_dir / "report.md").write_text(markdown(report))
    if args.out:
        export(log_dir, args.out)
    print((log_dir / "report.md").read_text(), flush=True)
    return 0 if all(r.status == "passed" for r in results if r.tier <= 2) else 1


def child_env(site: Path) -> dict[str, str]:
    """The checks' environment: the installed wheels and the checkout importable, HF offline, FlashInfer
    without JIT, FLA pinned, the Triton cache at its fixed folder, unbuffered output."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(site), str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.update(HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1", FLASHINFER_WORKSPACE_BASE=str(ROOT / ".flashinfer"),
               OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", **CHECK_ENV)
    return env


def install_wheels(wheels: Path, site: Path, log_dir: Path) -> Result:
    found = sorted(wheels.glob("*.whl"))
    check = Check("install", 0, f"{len(found)} wheels from {wheels} into {site}",
                  [PYTHON, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                   "--no-cache-dir", "--upgrade", "--target", str(site), *map(str, found)], INSTALL_TIMEOUT_S)
    if not found:
        return Result(check.name, 0, check.what, "failed", 0.0, f"no wheels in {wheels} (bench/gpu_wheels.sh)", "")
    result = run_check(check, log_dir, dict(os.environ))
    write_layout_hook(site)
    return result


def write_layout_hook(site: Path) -> None:
    """vlmrun is not installed there, and its folders processors/ and web/ import as vlmrun.processors
    and vlmrun.web only through pyproject's package-dir. A `sitecustomize` in the site folder (first on
    PYTHONPATH, so every check's interpreter runs it at start-up) maps them to the checkout's folders,
    as an editable install does."""
    import tomllib  # Python 3.11+, as the GPU machine runs; the dry run never gets here

    package_dir = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    mapped = {name: str(ROOT / folder) for name, folder in package_dir.items()}
    site.mkdir(parents=True, exist_ok=True)
    (site / "sitecustomize.py").write_text(f'''"""Written by bench/gpu_acceptance.py: the checkout's package-dir folders under vlmrun's name."""
import importlib.abc
import importlib.util
import os
import sys

MAPPED = {mapped!r}


class CheckoutLayout(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        folder = MAPPED.get(name)
        if folder is None:
            return None
        return importlib.util.spec_from_file_location(name, os.path.join(folder, "__init__.py"),
                                                      submodule_search_locations=[folder])


sys.meta_path.insert(0, CheckoutLayout())
''')


def run_check(check: Check, log_dir: Path, env: dict[str, str], timeout_s: Optional[int] = None) -> Result:
    """Run one check with its time limit (SIGINT first, so pytest still prints its summary), its output
    into <log_dir>/<name>.log."""
    timeout_s = timeout_s or check.timeout_s
    log = log_dir / f"{check.name}.log"
    command = [part.format(log_dir=log_dir) for part in check.command]
    print(f"== {check.name} (limit {timeout_s} s): {' '.join(command)}", flush=True)
    start = time.monotonic()
    with log.open("w") as out:
        out.write("$ " + " ".join(command) + "\n")
        out.flush()
        try:
            proc = subprocess.Popen(command, cwd=ROOT, env={**env, **check.env}, stdout=out, stderr=subprocess.STDOUT)
        except FileNotFoundError as exc:
            out.write(f"{exc}\n")
            return Result(check.name, check.tier, check.what, "failed", 0.0, str(exc), log.name)
        timed_out = wait_or_interrupt(proc, timeout_s)
    seconds = time.monotonic() - start
    text = log.read_text(errors="replace")
    summary = closing_line(text)
    status = "timeout" if timed_out else outcome(proc.returncode, summary, is_pytest="pytest" in command)
    print(f"   {status} in {seconds:.0f} s: {summary}", flush=True)
    return Result(check.name, check.tier, check.what, status, round(seconds, 1), summary, log.name)


def wait_or_interrupt(proc: subprocess.Popen, timeout_s: int) -> bool:
    """Wait for `proc`; past `timeout_s` interrupt it, then kill it KILL_GRACE_S later. True when it timed out."""
    try:
        proc.wait(timeout=timeout_s)
        return False
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=KILL_GRACE_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        return True


def run_info(args: argparse.Namespace) -> dict:
    return {"device": device_name(), "date": datetime.date.today().isoformat(), "commit": commit(args.commit),
            "python": sys.version.split()[0], "budget_s": args.budget}


def device_name() -> str:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=30)
        if out.returncode == 0 and out.stdout.strip():
            return out.stdout.strip().splitlines()[0]
    except (FileNotFoundError, subprocess.TimeoutExpired):
        pass
    return "no CUDA device"


def commit(given: Optional[str]) -> str:
    """The commit the checkout is at: as given, else git's (+ "-dirty" with uncommitted changes)."""
    if given:
        return given
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True)
    except FileNotFoundError:
        return "unknown (pass --commit)"
    if sha.returncode != 0:
        return "unknown (pass --commit)"
    return sha.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="print the plan and check it (no CUDA)")
    parser.add_argument("--log-dir", type=Path, default=ROOT / "gpu_report", help="logs and the report")
    parser.add_argument("--wheels", type=Path, default=ROOT / ".whl", help="the wheels of bench/gpu_wheels.sh")
    parser.add_argument("--site", type=Path, default=Path("/tmp/site"), help="where the wheels are installed")
    parser.add_argument("--out", type=Path, default=None,
                        help="report.md, report.json, logs.tar.gz and triton_cache.tar.gz go here")
    parser.add_argument("--commit", default=None, help="the checkout's commit (default: git's, where .git is)")
    parser.add_argument("--budget", type=int, default=CALL_BUDGET_S, help="seconds the whole call may take")
    parser.add_argument("--checks", nargs="+", choices=[c.name for c in CHECKS],
                        help="run only these checks (a rerun); the install always runs")
    args = parser.parse_args()
    checks = [c for c in CHECKS if not args.checks or c.name in args.checks]
    if args.dry_run:
        return dry_run(checks, args.budget)
    return run_call(args, checks)


if __name__ == "__main__":
    raise SystemExit(main())
