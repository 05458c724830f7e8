"""The GPU acceptance run: every GPU check and benchmark of vlmrun, in two parts of under ten minutes each.

On the lent GPU machine (torch, triton, nvcc; no registry), from the repository root, with the
wheels of `bench/gpu_wheels.sh` carried in `.whl/`:

    python3 -m bench.gpu_acceptance --part 1 --commit SHA --out $OUT
    python3 -m bench.gpu_acceptance --part 2 --commit SHA --out $OUT

A part checks `nvcc --version` first (FlashInfer 0.6 compiles each kernel with it at first use),
installs the wheels into a target folder (`--site`), then runs its checks one after the other: each
a command with its own time limit, its output in `<log-dir>/<check>.log`. FlashInfer's JIT cache
is kept in `.flashinfer/` of the checkout (ignored), so a later part on the same machine reuses the
kernels compiled before. A part stops starting checks when too little of its `--budget` is left for
the next one (it is reported "not run"). The results of every part run in the same log folder are
merged into `report.md` (pass / fail per check; each benchmark figure with the device, date and
commit) and `report.json`; `--out` receives those two and `logs.tar.gz` (three files: a device
call brings back at most eight).

`--dry-run` (any machine, no CUDA needed) lists what a part would run and checks that every test
file, test function, script, benchmark model and config it names exists; tests/test_gpu_acceptance.py
runs it, so the list cannot rot. The checks are listed in bench/gpu_checks.py, the report is written
by bench/gpu_report.py. Only the standard library is imported: the wheels are not importable until
the script has installed them.
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
from dataclasses import asdict
from pathlib import Path
from typing import Optional

from bench.gpu_checks import (
    CHECKS,
    DEVICE_CALL_S,
    INSTALL_TIMEOUT_S,
    NVCC_TIMEOUT_S,
    PARTS,
    PYTHON,
    ROOT,
    SETUP_SECONDS,
    Check,
    missing_names,
    part_time_limit,
)
from bench.gpu_report import (
    Result,
    closing_line,
    export,
    load_report,
    markdown,
    ordered_names,
    outcome,
    read_figures,
)


# ------------------------------------------------------------------ the dry run


def dry_run(parts: list[int]) -> int:
    problems = []
    for check in CHECKS:
        if check.part not in parts:
            continue
        print(f"[part {check.part}] {check.name} (limit {check.timeout_s} s): {check.what}")
        print("    " + shlex.join(check.command))
        for name in missing_names(check):
            problems.append(f"{check.name}: {name} does not exist")
    for part in parts:
        limit = part_time_limit(part)
        print(f"part {part}: time limits add up to {limit} s")
        if limit > DEVICE_CALL_S:
            problems.append(f"part {part}: its time limits add up to {limit} s, over a {DEVICE_CALL_S} s device call")
    for problem in problems:
        print("MISSING " + problem)
    return 1 if problems else 0


# ------------------------------------------------------------------ running a part


def run_part(args: argparse.Namespace) -> int:
    log_dir = args.log_dir.resolve()
    log_dir.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + args.budget
    env = child_env(args.site)
    report = load_report(log_dir / "report.json")
    report.update(run_info(args))
    results = {r["name"]: r for r in report.get("checks", [])}
    nvcc = Check("nvcc", args.part, "CUDA compiler (FlashInfer compiles its kernels with it at first use)",
                 ["nvcc", "--version"], NVCC_TIMEOUT_S)
    results["nvcc"] = asdict(run_check(nvcc, log_dir, env))
    results["install"] = asdict(install_wheels(args.wheels, args.site, log_dir, args.part))
    checks = [c for c in CHECKS if c.part == args.part and (not args.checks or c.name in args.checks)]
    for check in checks:
        left = deadline - time.monotonic() - SETUP_SECONDS
        if left < min(check.timeout_s, 30):
            results[check.name] = asdict(Result(check.name, check.part, check.what, "not run", 0.0,
                                                f"{left:.0f} s of the part's budget left", ""))
            continue
        results[check.name] = asdict(run_check(check, log_dir, env, min(check.timeout_s, int(left))))
    report["checks"] = [results[n] for n in ordered_names(results)]
    report["figures"] = read_figures(log_dir / "bench.jsonl", report["commit"])
    (log_dir / "report.json").write_text(json.dumps(report, indent=1))
    (log_dir / "report.md").write_text(markdown(report))
    if args.out:
        export(log_dir, args.out)
    print((log_dir / "report.md").read_text(), flush=True)
    part_results = [results[name] for name in ("nvcc", "install", *(c.name for c in checks))]
    return 0 if all(r["status"] == "passed" for r in part_results) else 1


def child_env(site: Path) -> dict[str, str]:
    """The checks' environment: the installed wheels and the checkout importable, HF offline,
    FlashInfer's JIT cache in the checkout, unbuffered output."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(site), str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.update(HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1", FLASHINFER_WORKSPACE_BASE=str(ROOT / ".flashinfer"),
               OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    return env


def install_wheels(wheels: Path, site: Path, log_dir: Path, part: int) -> Result:
    found = sorted(wheels.glob("*.whl"))
    check = Check("install", part, f"{len(found)} wheels from {wheels} into {site}",
                  [PYTHON, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                   "--no-cache-dir", "--upgrade", "--target", str(site), *map(str, found)], INSTALL_TIMEOUT_S)
    if not found:
        return Result(check.name, part, check.what, "failed", 0.0, f"no wheels in {wheels} (bench/gpu_wheels.sh)", "")
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
            return Result(check.name, check.part, check.what, "failed", 0.0, str(exc), log.name)
        timed_out = wait_or_interrupt(proc, timeout_s)
    seconds = time.monotonic() - start
    text = log.read_text(errors="replace")
    summary = closing_line(text)
    status = "timeout" if timed_out else outcome(proc.returncode, summary, is_pytest="pytest" in command)
    print(f"   {status} in {seconds:.0f} s: {summary}", flush=True)
    return Result(check.name, check.part, check.what, status, round(seconds, 1), summary, log.name)


def wait_or_interrupt(proc: subprocess.Popen, timeout_s: int) -> bool:
    """Wait for `proc`; past `timeout_s` interrupt it, then kill it 15 s later. True when it timed out."""
    try:
        proc.wait(timeout=timeout_s)
        return False
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        return True


def run_info(args: argparse.Namespace) -> dict:
    return {"device": device_name(), "date": datetime.date.today().isoformat(), "commit": commit(args.commit),
            "python": sys.version.split()[0]}


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
    parser.add_argument("--part", type=int, choices=PARTS, help="which part to run (each under ten minutes)")
    parser.add_argument("--dry-run", action="store_true", help="list what would run and check it exists (no CUDA)")
    parser.add_argument("--log-dir", type=Path, default=ROOT / "gpu_report", help="logs and the merged report")
    parser.add_argument("--wheels", type=Path, default=ROOT / ".whl", help="the wheels of bench/gpu_wheels.sh")
    parser.add_argument("--site", type=Path, default=Path("/tmp/site"), help="where the wheels are installed")
    parser.add_argument("--out", type=Path, default=None, help="copy report.md, report.json, logs.tar.gz here")
    parser.add_argument("--commit", default=None, help="the checkout's commit (default: git's, where .git is)")
    parser.add_argument("--budget", type=int, default=570, help="seconds a part may take, all checks together")
    parser.add_argument("--checks", nargs="+", choices=[c.name for c in CHECKS],
                        help="run only these checks of the part (a rerun); nvcc and the install always run")
    args = parser.parse_args()
    if args.dry_run:
        return dry_run([args.part] if args.part else PARTS)
    if args.part is None:
        parser.error("--part is required (or --dry-run)")
    return run_part(args)


if __name__ == "__main__":
    raise SystemExit(main())
