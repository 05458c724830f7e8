"""The docs name only code that exists: the code references they write in backticks (modules, classes
and members, functions and their parameters, paths, `vlmrun` subcommands and flags, script flags) are
checked against the checkout by `tests/doc_symbols.py`, so a rename that leaves a doc behind fails here."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.doc_symbols import DocChecker

ROOT = Path(__file__).resolve().parent.parent
DOCS = sorted(["README.md", "BENCHMARKS.md",
               *(p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").rglob("*.md")),
               *(p.relative_to(ROOT).as_posix() for p in (ROOT / "assets" / "model").glob("*/README.md"))])

# One stale reference of each kind, each on a line of its own.
STALE = """\
The loop lives in `vlmrun.engine.loop`.
Steps are recorded in a `BatchRecord`.
Start it with `vlmrun serve --max-num-seqz 8`.
Chat with `vlmrun chat`.
The scheduler is `vlmrun/engine/planner.py`.
The signature is at `vlmrun/layers/attention/base.py:9999`.
Each step calls `Engine.advance`.
Models come from `load_model(model_config, gpu)`.
Runners are built by `build_model_runnner`.
Bad input raises `processors.InputError`.
The step reads `fb.attention_plan`.

```bash
vlmrun caption assets/images --outfile caps.jsonl
python -m bench.bench_nothing --repeats 3
```

```python
from vlmrun.processors import Procesor
```
"""

STALE_REASONS = {
    1: "vlmrun.engine has no 'loop'",
    2: "no class or name BatchRecord in the code",
    3: "vlmrun serve has no flag --max-num-seqz",
    4: "vlmrun has no subcommand 'chat'",
    5: "no file or folder vlmrun/engine/planner.py",
    6: "vlmrun/layers/attention/base.py has fewer than 9999 lines",
    7: "class Engine has no member 'advance'",
    8: "load_model() takes no parameter 'gpu'",
    9: "no name build_model_runnner in the code",
    10: "not importable: it is vlmrun.processors.InputError",
    11: "no attribute attention_plan in the code",
    14: "vlmrun caption has no flag --outfile",
    15: "no script bench/bench_nothing.py",
    19: "vlmrun.processors has no 'Procesor'",
}

# The same kinds of reference, each naming code that exists.
CURRENT = """\
The loop lives in `vlmrun.engine.scheduler` and `vlmrun.LLM` drives it.
Steps are recorded in a `ForwardBatch` (`ForwardMode.EXTEND`); HF's is `Qwen2VLImageProcessor`.
Start it with `vlmrun serve --max-num-seqs 8 --no-enforce-eager` (`vlmrun caption | serve | web`).
The scheduler is `vlmrun/engine/scheduler.py`, beside `engine/request.py` and `layers/`.
The signature is at `vlmrun/layers/attention/base.py:1`.
Each step calls `Engine.step`; the plan is `EngineConfig.max_num_seqs` and `EngineConfig.max_video_*`.
Models come from `load_model(model_config, device, tp=SINGLE)`.
Runners are built by `build_model_runner`.
Bad input raises `vlmrun.processors.InputError`; `torch.set_flush_denormal(True)` is torch's.
The step reads `fb.attn_metadata`.

```bash
vlmrun caption assets/images --out caps.jsonl   # --max-tokens is a flag too
python -m bench.bench_structured throughput --requests 32
```

```python
from vlmrun.processors import Processor, ProcessorLimits
```
"""


@pytest.fixture(scope="module")
def checker() -> DocChecker:
    return DocChecker.for_checkout(ROOT)


@pytest.mark.parametrize("doc", DOCS)
def test_the_docs_name_only_code_that_exists(checker, doc):
    problems = checker.check((ROOT / doc).read_text(encoding="utf-8"), doc)
    assert not problems, "stale code references:\n" + "\n".join(map(str, problems))


def test_each_kind_of_stale_reference_is_reported(checker):
    problems = checker.check(STALE, "planted.md")
    assert {p.line: p.reason for p in problems} == STALE_REASONS
    assert len(problems) == len(STALE_REASONS)


def test_references_to_existing_code_pass(checker):
    assert checker.check(CURRENT, "current.md") == []


def test_every_doc_is_found():
    assert {"README.md", "BENCHMARKS.md", "docs/architecture.md", "docs/contracts.md"} <= set(DOCS)
    assert any(doc.startswith("assets/model/") for doc in DOCS)
