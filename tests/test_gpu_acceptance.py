"""The GPU acceptance run on the CPU: its dry run names only tests, scripts, models and configs that
exist (so its plan cannot rot) and its planned limits fit one device call with the install; speed
comes first, then the fast path's correctness; a check whose limit no longer fits is not started;
the report's first section is the speed table, each figure with its device, date and commit."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from bench import gpu_acceptance
from bench.gpu_checks import CALL_BUDGET_S, CHECKS, Check, missing_names, plan_seconds, planned
from bench.gpu_report import closing_line, markdown, outcome, read_figures

ROOT = Path(__file__).resolve().parents[1]


def dry_run(*extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "bench.gpu_acceptance", "--dry-run", *extra], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


def test_dry_run_shows_one_call_that_fits_and_finds_everything_it_names():
    proc = dry_run()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for check in CHECKS:
        assert f"{check.name} (limit {check.timeout_s} s)" in proc.stdout
    assert plan_seconds() <= CALL_BUDGET_S < 600
    assert f"add up to {plan_seconds()} s of the {CALL_BUDGET_S} s budget" in proc.stdout


def test_dry_run_fails_a_plan_over_the_budget():
    proc = dry_run("--budget", str(plan_seconds() - 1))
    assert proc.returncode == 1 and "over the call's" in proc.stdout


def test_speed_comes_first_then_the_fast_paths_correctness():
    tiers = [c.tier for c in CHECKS]
    assert tiers == sorted(tiers)
    speed = [c for c in CHECKS if c.tier == 1]
    assert [c.command[c.command.index("--models") + 1] for c in speed] == ["qwen3_vl_2b", "qwen3_5_27b_4l"]
    for check in speed:
        line = " ".join(check.command)
        assert "--sides vlmrun-fast vlmrun-torch HF" in line and "--decode-batches 1 16 64" in line
        assert "--caption-requests 256 --caption-px 448 --caption-tokens 128" in line
    correctness = " ".join(" ".join(c.test_ids) for c in planned() if c.tier == 2)
    for test in ("test_flashinfer_equals_torch_backend", "test_fast_path_follows_torch_backends_in_bf16",
                 "test_cuda_graphs_equal_eager", "test_cuda_kernel_matches_the_dequantized_reference"):
        assert test in correctness


def test_dry_run_reports_what_does_not_exist():
    check = Check("x", 2, "x", ["python", "-m", "bench.no_such_script"], 1,
                  ("tests/test_gpu_kernels.py::test_no_such_test",
                   "tests/test_gpu_kernels.py::test_cuda_graphs_equal_eager[qwen3_vl_2b]", "tests/test_no_such_file.py"))
    assert missing_names(check) == ["tests/test_gpu_kernels.py::test_no_such_test", "tests/test_no_such_file.py",
                                    "bench.no_such_script"]
    bench = Check("y", 1, "y", ["python", "-m", "bench.bench_gpu", "--models", "qwen3_vl_2b", "no_such_model", "--x"], 1)
    assert missing_names(bench) == ["bench/bench_gpu.py MODELS['no_such_model']"]


def fake_check(name: str, tier: int, timeout_s: int) -> Check:
    return Check(name, tier, name, [sys.executable, "-c", "print('1 passed in 0.1s')"], timeout_s)


def test_a_check_whose_limit_no_longer_fits_is_not_started(tmp_path, monkeypatch):
    """Budget 60 s, 20 for the report: the planned check runs, a tier-3 check of 50 s is not started."""
    args = argparse.Namespace(log_dir=tmp_path / "logs", wheels=tmp_path / "no_wheels", site=tmp_path / "site",
                              out=tmp_path / "out", commit="abc1234", budget=60)
    monkeypatch.setattr(gpu_acceptance, "HARVEST", fake_check("triton_harvest", 0, 10))
    status = gpu_acceptance.run_call(args, [fake_check("planned", 2, 30), fake_check("extra", 3, 50)])
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    by_name = {c["name"]: c for c in report["checks"]}
    assert by_name["install"]["status"] == "failed"  # no wheels: said, and the call goes on
    assert by_name["planned"]["status"] == "passed" and by_name["extra"]["status"] == "not run"
    assert status == 1  # the failed install
    assert {p.name for p in (tmp_path / "out").iterdir()} >= {"report.md", "report.json", "logs.tar.gz"}


def test_a_check_that_skipped_everything_is_not_a_pass():
    log = "....\n===== 3 skipped in 2.1s =====\n"
    assert closing_line(log) == "3 skipped in 2.1s"
    assert outcome(0, closing_line(log), is_pytest=True) == "skipped"
    assert outcome(0, "2 passed, 1 skipped in 4s", is_pytest=True) == "passed"
    assert outcome(1, "1 failed, 2 passed in 4s", is_pytest=True) == "failed"


def test_the_reports_first_section_is_the_speed_table(tmp_path):
    header = {"date": "2026-11-29", "device": "NVIDIA H200", "torch": "2.11.0"}
    rows = [{**header, "model": "qwen3_vl_2b", "side": "vlmrun-fast", "attention_backend": "flashinfer",
             "gdn_backend": "fla", "decode_tok_s": 212.5, "decode_tok_s_b16": 3000.0, "decode_tok_s_b64": 9000.0,
             "bandwidth_fraction": 0.61, "caption_images_s": 88.0, "ttft_ms": 41.0},
            {**header, "model": "qwen3_vl_2b", "side": "vlmrun-torch", "attention_backend": "torch",
             "gdn_backend": "torch", "decode_tok_s": 50.0, "caption_images_s": 22.0, "ttft_skipped": "past 120 s"},
            {**header, "model": "qwen3_vl_2b", "side": "HF", "decode_tok_s": 30.7, "error": "Traceback ..."}]
    bench = tmp_path / "bench.jsonl"
    bench.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    report = {"device": header["device"], "date": header["date"], "commit": "abc1234", "seconds": 512,
              "budget_s": 560, "figures": read_figures(bench, "abc1234"),
              "checks": [{"name": "fast_path", "tier": 2, "what": "fast path = torch", "status": "passed",
                          "seconds": 31.0, "summary": "9 passed in 30s", "log": "fast_path.log"}]}
    text = markdown(report)
    assert text.index("## Speed") < text.index("## Checks")
    assert ("| qwen3_vl_2b | fast path | flashinfer / fla | 212.5 | 3000 | 9000 | 61% | 88.0 | 41 | NVIDIA H200 "
            "| 2026-11-29 | abc1234 |") in text
    assert "| qwen3_vl_2b | torch path (ttft_skipped) | torch / torch | 50.0 | — | — | — | 22.0 | — |" in text
    assert "| qwen3_vl_2b | HF (error) |  | 30.7 |" in text
    assert "decode b1 4.25x torch path; decode b1 6.92x HF; captions/s 4.00x torch path" in text
    assert "| fast_path: fast path = torch | fast-path correctness | **passed** | 31 | 9 passed in 30s |" in text

