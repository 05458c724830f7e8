"""The GPU acceptance run's results and its one report: how a check's output reads (pytest's closing
line; a run that skipped everything is no pass), and the markdown report whose first section is the
speed table (fast path / torch path / HF per model, each figure with its device, date and commit, and
the fast path's ratios), then pass / fail per check; exported with the logs.
"""

from __future__ import annotations

import json
import re
import shutil
import tarfile
from dataclasses import dataclass
from pathlib import Path

from bench.gpu_checks import TIERS


@dataclass
class Result:
    name: str
    tier: int
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


SIDE_NAMES = {"vlmrun-fast": "fast path", "vlmrun-torch": "torch path", "vlmrun": "vlmrun", "HF": "HF"}
FIGURES = [("decode_tok_s", "decode tok/s b1", "{:.1f}"), ("decode_tok_s_b16", "b16", "{:.0f}"),
           ("decode_tok_s_b64", "b64", "{:.0f}"), ("bandwidth_fraction", "b1 share of floor", "{:.0%}"),
           ("caption_images_s", "captions/s", "{:.1f}"), ("ttft_ms", "TTFT ms", "{:.0f}")]
RATIOS = [("decode_tok_s", "decode b1"), ("decode_tok_s_b64", "decode b64"), ("caption_images_s", "captions/s")]


def read_figures(path: Path, sha: str) -> list[dict]:
    """The benchmark rows of bench.jsonl, each with the device, date and commit it was measured at."""
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        row = json.loads(line)
        kernels = f"{row.get('attention_backend', '')} / {row.get('gdn_backend', '')}" if row["side"] != "HF" else ""
        problems = [k for k in row if k == "error" or k.endswith("_error") or k.endswith("_skipped")]
        rows.append({"model": row["model"], "side": row["side"], "kernels": kernels, "device": row.get("device"),
                     "date": row.get("date"), "commit": sha, "problems": problems,
                     **{key: row.get(key) for key, _, _ in FIGURES}})
    return rows


def speed_lines(figures: list[dict]) -> list[str]:
    lines = ["## Speed (bf16, random weights in the published shapes)", "",
             "| model | side | kernels | " + " | ".join(label for _, label, _ in FIGURES) + " | device | date | commit |",
             "| --- " * (len(FIGURES) + 6) + "|"]
    if not figures:
        return lines + ["", "No figures: the speed checks did not run or wrote nothing (see their logs)."]
    for row in figures:
        values = [fmt.format(row[key]) if isinstance(row.get(key), (int, float)) else "—" for key, _, fmt in FIGURES]
        side = SIDE_NAMES.get(row["side"], row["side"]) + (f" ({', '.join(row['problems'])})" if row["problems"] else "")
        lines.append(f"| {row['model']} | {side} | {row['kernels']} | " + " | ".join(values)
                     + f" | {row['device']} | {row['date']} | {row['commit']} |")
    lines.append("")
    for model in dict.fromkeys(r["model"] for r in figures):
        sides = {r["side"]: r for r in figures if r["model"] == model}
        fast = sides.get("vlmrun-fast")
        parts = []
        for key, label in RATIOS:
            for other in ("vlmrun-torch", "HF"):
                a, b = (fast or {}).get(key), sides.get(other, {}).get(key)
                if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b:
                    parts.append(f"{label} {a / b:.2f}x {SIDE_NAMES[other]}")
        lines.append(f"- {model}, fast path: " + ("; ".join(parts) if parts else "no pair of figures to compare"))
    return lines


def markdown(report: dict) -> str:
    lines = [f"# GPU acceptance report: {report['device']}, {report['date']}, commit {report['commit']}", "",
             f"One device call, {report.get('seconds', '?')} s of its {report.get('budget_s', '?')} s budget.", ""]
    lines += speed_lines(report.get("figures", []))
    lines += ["", "## Checks", "", "| check | tier | result | seconds | summary |", "| --- | --- | --- | --- | --- |"]
    for r in report["checks"]:
        lines.append(f"| {r['name']}: {r['what']} | {TIERS.get(r['tier'], r['tier'])} | **{r['status']}** | "
                     f"{r['seconds']:.0f} | {r['summary'].replace('|', '/')} |")
    return "\n".join(lines) + "\n"


def export(log_dir: Path, out: Path) -> None:
    """report.md, report.json and every log as logs.tar.gz into `out` (the Triton cache is there already)."""
    out.mkdir(parents=True, exist_ok=True)
    for name in ("report.md", "report.json"):
        shutil.copy(log_dir / name, out / name)
    with tarfile.open(out / "logs.tar.gz", "w:gz") as tar:
        for path in sorted(log_dir.iterdir()):
            if path.suffix in (".log", ".jsonl"):
                tar.add(path, arcname=path.name)
