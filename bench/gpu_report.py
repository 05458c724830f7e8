"""The GPU acceptance run's results and report: how a check's output reads (pytest's closing line;
a run that skipped everything is no pass), and the merged markdown and JSON report (pass / fail per
check; each benchmark figure with the device, date and commit), exported as three files.
"""

from __future__ import annotations

import json
import re
import shutil
import tarfile
from dataclasses import dataclass
from pathlib import Path

from bench.gpu_checks import CHECKS


@dataclass
class Result:
    name: str
    part: int
    what: str
    status: str  # passed | failed | timeout | skipped (everything skipped) | not run
    seconds: float
    summary: str  # pytest's closing line, or the last line of the output
    log: str


PYTEST_CLOSING = re.compile(r"\b\d+ (passed|failed|skipped|errors?|deselected|xfailed|xpassed)\b")


def closing_line(text: str) -> str:
    lines = [line.strip("= ").strip() for line in text.splitlines() if line.strip()]
    for line in reversed(lines):
        if PYTEST_CLOSING.search(line) or "no tests ran" in line:
            return line
    return lines[-1][:200] if lines else ""


def outcome(returncode: int, summary: str, is_pytest: bool) -> str:
    """passed / failed; a pytest run that skipped everything it selected is "skipped", not a pass."""
    if returncode != 0:
        return "failed"
    if is_pytest and "passed" not in summary:
        return "skipped"
    return "passed"


def load_report(path: Path) -> dict:
    return json.loads(path.read_text()) if path.exists() else {}


def ordered_names(results: dict) -> list[str]:
    order = ["nvcc", "install"] + [c.name for c in CHECKS]
    return [n for n in order if n in results]


FIGURES = [("decode_tok_s", "decode tok/s (batch 1)", "{:.1f}"), ("bandwidth_fraction", "share of floor", "{:.1%}"),
           ("caption_images_s", "captions/s", "{:.1f}"), ("ttft_ms", "TTFT ms", "{:.0f}")]


def read_figures(path: Path, sha: str) -> list[dict]:
    """The benchmark rows of bench.jsonl, each with the device, date and commit it was measured at."""
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        row = json.loads(line)
        kernels = f"{row.get('attention_backend', '')} / {row.get('gdn_backend', '')}" if row["side"] != "HF" else ""
        rows.append({"model": row["model"], "side": row["side"], "kernels": kernels, "device": row.get("device"),
                     "date": row.get("date"), "commit": sha, "error": bool(row.get("error")),
                     **{key: row.get(key) for key, _, _ in FIGURES}})
    return rows


def markdown(report: dict) -> str:
    lines = [f"# GPU acceptance report: {report['device']}, {report['date']}, commit {report['commit']}", "",
             "| check | part | result | seconds | summary |", "| --- | --- | --- | --- | --- |"]
    for r in report["checks"]:
        lines.append(f"| {r['name']}: {r['what']} | {r['part']} | **{r['status']}** | {r['seconds']:.0f} | "
                     f"{r['summary'].replace('|', '/')} |")
    if report.get("figures"):
        lines += ["", "| model | side | kernels | " + " | ".join(label for _, label, _ in FIGURES)
                  + " | device | date | commit |", "| --- " * (len(FIGURES) + 6) + "|"]
        for row in report["figures"]:
            values = [fmt.format(row[key]) if isinstance(row.get(key), (int, float)) else "—"
                      for key, _, fmt in FIGURES]
            side = row["side"] + (" (error)" if row["error"] else "")
            lines.append(f"| {row['model']} | {side} | {row['kernels']} | " + " | ".join(values)
                         + f" | {row['device']} | {row['date']} | {row['commit']} |")
    return "\n".join(lines) + "\n"


def export(log_dir: Path, out: Path) -> None:
    """report.md, report.json and every log as logs.tar.gz into `out` (three files)."""
    out.mkdir(parents=True, exist_ok=True)
    for name in ("report.md", "report.json"):
        shutil.copy(log_dir / name, out / name)
    with tarfile.open(out / "logs.tar.gz", "w:gz") as tar:
        for path in sorted(log_dir.iterdir()):
            if path.suffix in (".log", ".jsonl"):
                tar.add(path, arcname=path.name)
