"""The GPU acceptance script on the CPU: its dry run names only tests, scripts and configs that exist
(so its list cannot rot), each part fits a ten-minute device call, and its report gives pass/fail per
check and every benchmark figure with the device, date and commit."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from bench.gpu_checks import CHECKS, PARTS, Check, missing_names
from bench.gpu_report import closing_line, markdown, outcome, read_figures

ROOT = Path(__file__).resolve().parents[1]


def test_dry_run_finds_everything_it_names():
    proc = subprocess.run([sys.executable, "-m", "bench.gpu_acceptance", "--dry-run"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for check in CHECKS:
        assert f"{check.name} (limit" in proc.stdout
    assert PARTS == [1, 2]


def test_dry_run_reports_what_does_not_exist():
    check = Check("x", 1, "x", ["true"], 1, ("tests/test_gpu_kernels.py::test_no_such_test",
                                             "tests/test_gpu_kernels.py::test_cuda_graphs_equal_eager[qwen3_vl_2b]",
                                             "tests/test_no_such_file.py"))
    assert missing_names(check) == ["tests/test_gpu_kernels.py::test_no_such_test", "tests/test_no_such_file.py"]


def test_a_check_that_skipped_everything_is_not_a_pass():
    log = "....\n===== 3 skipped in 2.1s =====\n"
    assert closing_line(log) == "3 skipped in 2.1s"
    assert outcome(0, closing_line(log), is_pytest=True) == "skipped"
    assert outcome(0, "2 passed, 1 skipped in 4s", is_pytest=True) == "passed"
    assert outcome(1, "1 failed, 2 passed in 4s", is_pytest=True) == "failed"


def test_report_gives_each_figure_its_device_date_and_commit(tmp_path):
    header = {"date": "2026-11-25", "device": "NVIDIA H100 80GB HBM3", "torch": "2.11.0"}
    rows = [{**header, "model": "qwen3_vl_2b", "side": "vlmrun-fast", "attention_backend": "flashinfer",
             "gdn_backend": "fla", "decode_tok_s": 212.5, "bandwidth_fraction": 0.61, "caption_images_s": 88.0,
             "ttft_ms": 41.0},
            {**header, "model": "qwen3_vl_2b", "side": "HF", "decode_tok_s": 30.7, "error": "Traceback ..."}]
    bench = tmp_path / "bench.jsonl"
    bench.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    figures = read_figures(bench, "abc1234")
    report = {"device": header["device"], "date": header["date"], "commit": "abc1234", "figures": figures,
              "checks": [{"name": "fla_float32", "part": 1, "what": "FLA = torch", "status": "passed",
                          "seconds": 31.0, "summary": "2 passed in 30s", "log": "fla_float32.log"}]}
    text = markdown(report)
    assert "| fla_float32: FLA = torch | 1 | **passed** | 31 | 2 passed in 30s |" in text
    assert ("| qwen3_vl_2b | vlmrun-fast | flashinfer / fla | 212.5 | 61.0% | 88.0 | 41 | NVIDIA H100 80GB HBM3 "
            "| 2026-11-25 | abc1234 |") in text
    assert "| qwen3_vl_2b | HF (error) |  | 30.7 | — | — | — |" in text
