"""The default model's training script: the task draw of each stage, and stage two run from a checkpoint.

- `pick_task` with no JSON share draws exactly stage one's tasks (so the shipped stage one stays
  reproducible), and a JSON share takes its examples from the questions only: the captions stay
  the same scenes' captions.
- `train_default_model.py --from <the bundled checkpoint> --json-steps 2` runs stage two end to end in
  a temporary directory (a few seconds): it writes a complete checkpoint whose tokenizer files equal the
  bundled ones, keeps stage one's figures in training_results.json, describes both stages in the card,
  and refuses to start from a checkpoint that has been through stage two already.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from testing.scene_splits import TRAIN_SEED
from training.data import pick_task
from vlmrun.default_model import default_model_path
from vlmrun.shape_scenes import DESCRIBE_JSON_PROMPT, DESCRIBE_PROMPT, make_scene, scene_json

ROOT = Path(__file__).resolve().parents[1]
SCENES = [make_scene(TRAIN_SEED, i) for i in range(300)]


def test_no_json_share_draws_stage_one_tasks_and_a_share_replaces_questions_only():
    for scene in SCENES:
        stage_one = pick_task(scene, 1234, 0.3)
        assert pick_task(scene, 1234, 0.3, 0.0) == stage_one
        assert stage_one.question != DESCRIBE_JSON_PROMPT
        mixed = pick_task(scene, 1234, 0.3, 0.4)
        if stage_one.question == DESCRIBE_PROMPT:
            assert mixed == stage_one
        elif mixed.question == DESCRIBE_JSON_PROMPT:
            assert mixed.answer == scene_json(scene) and json.loads(mixed.answer)["shapes"]
    share = sum(pick_task(s, 1234, 0.3, 0.4).question == DESCRIBE_JSON_PROMPT for s in SCENES) / len(SCENES)
    assert 0.3 < share < 0.5


def _train(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "training.train_default_model", *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)


def test_stage_two_from_a_checkpoint(tmp_path: Path):
    bundled = default_model_path()
    stage_one = tmp_path / "stage-one"
    stage_one.mkdir()
    for f in bundled.iterdir():  # the bundled checkpoint, dressed as a stage-one one
        (stage_one / f.name).write_bytes(f.read_bytes())
    results = json.loads((bundled / "training_results.json").read_text())
    del results["json_stage"]
    (stage_one / "training_results.json").write_text(json.dumps(results))

    out = tmp_path / "stage-two"
    run = _train("--out", str(out), "--from", str(stage_one), "--json-steps", "2", "--log-every", "1",
                 "--eval-scenes", "2")
    assert run.returncode == 0, run.stderr[-2000:]
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "preprocessor_config.json"):
        assert (out / name).read_bytes() == (bundled / name).read_bytes(), name
    assert (out / "model.safetensors").exists() and not (out / "resume_state.pt").exists()
    written = json.loads((out / "training_results.json").read_text())
    assert written["train_minutes"] == results["train_minutes"] and written["torch"] == results["torch"]
    assert written["json_stage"]["steps"] == 2 and written["json_stage"]["first_scene"] == 5000 * 16
    assert [h["step"] for h in written["json_loss_history"]] == [1, 2]
    assert "Stage two" in (out / "README.md").read_text()

    again = _train("--out", str(tmp_path / "again"), "--from", str(out), "--json-steps", "1")
    assert again.returncode != 0 and "through stage two already" in again.stderr
