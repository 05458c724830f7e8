"""Train the bundled default model from scratch: `python -m training.train_default_model --out DIR`.

Two stages, one command, fixed seeds, a deterministic data order. Stage one (`Recipe`): scene k of the
training split (seed `testing.scene_splits.TRAIN_SEED`) is example k, so step s sees scenes s*B .. s*B+B-1,
each with one task (its caption, or one question) picked by a fixed seed. Stage two (`JSON_STAGE`)
teaches the stage-one model a third prompt, `DESCRIBE_JSON_PROMPT`, answered with the scene's
`SCENE_SCHEMA` object (`scene_json`), on the training scenes after stage one's, with captions and
questions kept in the mix; a fresh optimiser, no probes. `--from DIR` starts stage two from a
stage-one checkpoint (its training_results.json carries stage one's figures into the card). Stage
three, the MTP layer that drafts for speculative decoding, is its own command on the stage-two
checkpoint: `python -m training.train_mtp` (training/train_mtp.py).

The model is HF transformers' own `Qwen3_5ForConditionalGeneration` (float32, CPU); the compute runs
on one intra-op thread (bitwise repeatable, and robust on a shared machine) while one worker process
renders and tokenises the next batches. At the end it evaluates on held-out scenes (`EVAL_SEED`) with
HF greedy decoding and writes the checkpoint (safetensors, config, tokenizer, chat template,
preprocessor config, model card). An interrupted run continues from its last snapshot when started
again with the same --out.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
# HF runs its GDN layers on flash-linear-attention whenever `fla` imports (the CUDA extra), even on CPU
# tensors where its Triton kernels cannot run: training is HF's torch path.
sys.modules["fla"] = None  # type: ignore[assignment]

import torch  # noqa: E402

from testing.scene_splits import EVAL_SEED, eval_scenes  # noqa: E402
from training.aux_targets import AuxProbe  # noqa: E402
from training.checkpoint_files import (  # noqa: E402
    RESUME_FILE, ModelSize, build_config, generation_config, write_preprocessor_config, write_tokenizer,
)
from training.data import IGNORE, StageBatches  # noqa: E402
from training.evaluate import eval_requests, hf_greedy, score  # noqa: E402
from training.fast_ops import linear_patch_embed, restore_patch_embed, short_gdn_chunks  # noqa: E402
from training.model_card import write_model_card  # noqa: E402
from training.schedule import warmup_cosine  # noqa: E402
from vlmrun.processors import Processor  # noqa: E402

SNAPSHOT_EVERY = 250  # steps between snapshots (RESUME_FILE)


@dataclass(frozen=True)
class Recipe:
    """One training stage; the defaults are stage one of the shipped recipe (the command-line defaults)."""

    steps: int = 5000
    batch_size: int = 16
    lr: float = 1.5e-3
    min_lr_ratio: float = 0.05
    warmup: int = 150
    weight_decay: float = 0.05
    grad_clip: float = 1.0
    caption_fraction: float = 0.3  # of training examples; the rest are questions (training.data.pick_task)
    json_fraction: float = 0.0  # of training examples answered with the scene's JSON object
    aux_weight: float = 1.0  # the probes' losses (training.aux_targets), added to the answer loss (0: no probes)
    seed: int = 1234
    eval_scenes: int = 300
    first_scene: int = 0  # the stage's step s trains on scenes first_scene + s*B ..


# Stage two: the JSON prompt at 40 % of examples, captions and questions kept (so nothing is forgotten),
# on the scenes after stage one's (first_scene is set from stage one's length).
JSON_STAGE = Recipe(steps=2000, lr=5e-4, warmup=30, caption_fraction=0.2, json_fraction=0.4, aux_weight=0.0)


def lr_at(step: int, recipe: Recipe) -> float:
    """Linear warm-up, then cosine decay to min_lr_ratio * lr."""
    return warmup_cosine(step, recipe.lr, recipe.warmup, recipe.steps, recipe.min_lr_ratio)


def answer_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over the batch's answer tokens (captions, being longer, weigh more: averaging
    per example instead slowed learning to tell the shapes apart, so captions lagged; see docs/default_model.md)."""
    keep = labels != IGNORE  # [batch, seq]
    return torch.nn.functional.cross_entropy(logits[keep], labels[keep])


def evaluate(model, processor: Processor, count: int) -> dict[str, float]:
    requests = eval_requests(eval_scenes(count, EVAL_SEED))
    model.eval()
    tokens = hf_greedy(model, processor, requests)
    model.train()
    answers = [processor.tokenizer.decode(t, skip_special_tokens=True) for t in tokens]
    return score(requests, answers)


def train(out: Path, recipe: Recipe, json_stage: Recipe, size: ModelSize, eval_every: int, log_every: int,
          start_from: Path | None = None) -> dict:
    """Both stages (stage two alone, from start_from's weights, when given), then the checkpoint and card."""
    from transformers import Qwen3_5ForConditionalGeneration

    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = write_tokenizer(out)
    write_preprocessor_config(out, size)
    config = build_config(tokenizer, size)
    processor = Processor.from_pretrained(out)
    stream = _Stream(out, processor, tokenizer.convert_tokens_to_ids("<|endoftext|>"),
                     tokenizer.convert_tokens_to_ids("<|image_pad|>"), eval_every, log_every)
    json_stage = replace(json_stage, first_scene=recipe.steps * recipe.batch_size)

    torch.manual_seed(recipe.seed)
    model = Qwen3_5ForConditionalGeneration(config).to(torch.float32).train()
    linear_patch_embed(model)
    probed: dict[str, torch.Tensor] = {}  # what the probes read in this forward
    first_full = config.text_config.layer_types.index("full_attention")
    hooks = [
        model.model.visual.merger.register_forward_hook(lambda m, i, o: probed.__setitem__("vision", o)),
        model.model.language_model.layers[first_full].register_forward_hook(
            lambda m, i, o: probed.__setitem__("hidden", o[0] if isinstance(o, tuple) else o)),
    ]
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params / 1e6:.2f} M parameters; vocab {config.text_config.vocab_size}", flush=True)

    snapshot = _load_snapshot(out)
    if snapshot is not None and snapshot.get("stage", 1) == 2:
        stage_one = snapshot["stage_one"]
    else:  # stage two starts afresh after stage one (run here, or the weights of start_from)
        if start_from is not None:
            stage_one = _stage_one_results(start_from)
            loaded = Qwen3_5ForConditionalGeneration.from_pretrained(str(start_from), dtype=torch.float32)
            model.load_state_dict(loaded.state_dict())
            print(f"stage one: the weights of {start_from}", flush=True)
        else:
            stage_one = _run_stage(1, model, recipe, stream, probed, snapshot, None)
        snapshot = None
    stage_two = _run_stage(2, model, json_stage, stream, probed, snapshot, stage_one)
    (out / RESUME_FILE).unlink(missing_ok=True)
    for hook in hooks:
        hook.remove()
    return _finish(out, model, tokenizer, processor, stage_one, stage_two, size, n_params, recipe.eval_scenes)


@dataclass(frozen=True)
class _Stream:
    """Where a stage reads its batches from and reports to."""

    out: Path
    processor: Processor
    pad: int
    image: int
    eval_every: int
    log_every: int


def _stage_one_results(start_from: Path) -> dict:
    """Stage one's figures from the training_results.json of the checkpoint stage two starts from."""
    done = json.loads((start_from / "training_results.json").read_text(encoding="utf-8"))
    if "json_stage" in done:
        raise ValueError(f"--from {start_from}: that checkpoint has been through stage two already")
    return {"recipe": done["recipe"], "minutes": done["train_minutes"], "history": done["loss_history"],
            "torch": done["torch"]}


def _run_stage(stage: int, model, recipe: Recipe, stream: _Stream, probed: dict, snapshot: dict | None,
               stage_one: dict | None) -> dict:
    """Train `model` in place for one stage (from its snapshot when one is given); its figures."""
    probe = AuxProbe(model.config.text_config.hidden_size) if recipe.aux_weight else None
    named = list(model.named_parameters())
    if probe is not None:
        named += [(f"probe.{n}", p) for n, p in probe.named_parameters()]
    decay = [p for n, p in named if p.dim() >= 2 and "embed" not in n]
    no_decay = [p for n, p in named if not (p.dim() >= 2 and "embed" not in n)]
    optim = torch.optim.AdamW([{"params": decay, "weight_decay": recipe.weight_decay},
                               {"params": no_decay, "weight_decay": 0.0}], lr=recipe.lr, betas=(0.9, 0.98))
    keep = {"stage": stage, "stage_one": stage_one}  # what each snapshot of this stage carries besides the state
    first_step, history, minutes_before = 0, [], 0.0
    if snapshot is not None:
        model.load_state_dict(snapshot["model"])
        if probe is not None:
            probe.load_state_dict(snapshot["probe"])
        optim.load_state_dict(snapshot["optim"])
        first_step, history, minutes_before = snapshot["step"], snapshot["history"], snapshot["minutes"]
        print(f"stage {stage}: resuming at step {first_step}", flush=True)
    elif stage == 2:  # so that an interruption from here on does not redo stage one
        _snapshot(stream.out, model, probe, optim, 0, [], 0.0, keep)
    loader = torch.utils.data.DataLoader(
        StageBatches(stream.out, recipe.steps, recipe.first_scene, recipe.batch_size, recipe.seed,
                     recipe.caption_fraction, recipe.json_fraction, stream.pad, stream.image),
        batch_size=None, shuffle=False, num_workers=1, prefetch_factor=4, persistent_workers=False,
        sampler=range(first_step, recipe.steps),
    )
    start = time.time()
    with short_gdn_chunks():
        history = _loop(model, probe, named, optim, loader, probed, recipe, stream, first_step, history,
                        minutes_before, keep)
    minutes = minutes_before + (time.time() - start) / 60
    return {"recipe": asdict(recipe), "minutes": round(minutes, 1), "history": history, "torch": torch.__version__}


def _load_snapshot(out: Path) -> dict | None:
    """The last snapshot of an interrupted run (the same result: no randomness after init)."""
    path = out / RESUME_FILE
    return torch.load(path, weights_only=False) if path.exists() else None


def _snapshot(out: Path, model, probe, optim, step: int, history: list[dict], minutes: float, keep: dict) -> None:
    tmp = out / (RESUME_FILE + ".tmp")
    torch.save({"model": model.state_dict(), "probe": None if probe is None else probe.state_dict(),
                "optim": optim.state_dict(), "step": step, "history": history, "minutes": minutes, **keep}, tmp)
    tmp.replace(out / RESUME_FILE)


def _loop(model, probe, named, optim, loader, probed, recipe: Recipe, stream: _Stream, first_step: int,
          history: list[dict], minutes_before: float, keep: dict) -> list[dict]:
    start = time.time()
    running, running_aux = 0.0, 0.0
    log_every = stream.log_every
    for step, batch in enumerate(loader, start=first_step):
        for group in optim.param_groups:
            group["lr"] = lr_at(step, recipe)
        labels = batch.pop("labels")
        aux_labels = batch.pop("aux_labels")
        subject_pos, subject_labels = batch.pop("subject_pos"), batch.pop("subject_labels")
        logits = model(**batch, use_cache=False).logits
        loss = answer_loss(logits, labels)
        vision, hidden = probed.pop("vision"), probed.pop("hidden")
        aux = torch.zeros(()) if probe is None else (
            probe.vision_loss(vision, aux_labels) + probe.question_loss(hidden, subject_pos, subject_labels))
        (loss + recipe.aux_weight * aux).backward()
        torch.nn.utils.clip_grad_norm_([p for _, p in named], recipe.grad_clip)
        optim.step()
        optim.zero_grad(set_to_none=True)
        running += loss.item()
        running_aux += aux.item()
        if (step + 1) % log_every == 0:
            elapsed = minutes_before * 60 + time.time() - start
            print(f"stage {keep['stage']} step {step + 1}/{recipe.steps} loss {running / log_every:.4f} "
                  f"aux {running_aux / log_every:.4f} lr {lr_at(step, recipe):.2e} {elapsed / 60:.1f} min", flush=True)
            history.append({"step": step + 1, "loss": round(running / log_every, 5),
                            "aux": round(running_aux / log_every, 5), "minutes": round(elapsed / 60, 2)})
            running, running_aux = 0.0, 0.0
        if (step + 1) % SNAPSHOT_EVERY == 0 and step + 1 < recipe.steps:
            _snapshot(stream.out, model, probe, optim, step + 1, history,
                      minutes_before + (time.time() - start) / 60, keep)
        if stream.eval_every and (step + 1) % stream.eval_every == 0 and step + 1 < recipe.steps:
            print(f"  eval@{step + 1}: {evaluate(model, stream.processor, 100)}", flush=True)
    return history


def _finish(out: Path, model, tokenizer, processor, stage_one: dict, stage_two: dict, size: ModelSize,
            n_params: int, eval_count: int) -> dict:
    restore_patch_embed(model)
    model.eval()
    model.generation_config = generation_config(tokenizer)
    model.save_pretrained(str(out))
    t0 = time.time()
    metrics = evaluate(model, processor, eval_count)
    results = {
        "train_minutes": stage_one["minutes"],
        "json_minutes": stage_two["minutes"],
        "eval_minutes": round((time.time() - t0) / 60, 1),
        "parameters": n_params,
        "torch": stage_one["torch"],
        "json_torch": stage_two["torch"],
        "recipe": stage_one["recipe"],
        "json_stage": stage_two["recipe"],
        "size": size.__dict__,
        "heldout": {"split_seed": EVAL_SEED, "scenes": eval_count,
                    "decoder": "HF transformers greedy", **{k: round(v, 4) for k, v in metrics.items()}},
        "loss_history": stage_one["history"],
        "json_loss_history": stage_two["history"],
    }
    (out / "training_results.json").write_text(json.dumps(results, indent=1) + "\n", encoding="utf-8")
    write_model_card(out, results)
    print(f"trained in {stage_one['minutes']} + {stage_two['minutes']} min; held-out (HF greedy): {metrics}",
          flush=True)
    return results


def main(argv: list[str] | None = None) -> None:
    d = Recipe()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="checkpoint directory to write")
    parser.add_argument("--from", dest="start_from", type=Path, default=None,
                        help="a stage-one checkpoint: run stage two alone, from its weights")
    parser.add_argument("--steps", type=int, default=d.steps)
    parser.add_argument("--json-steps", type=int, default=JSON_STAGE.steps, help="stage two's steps")
    parser.add_argument("--batch-size", type=int, default=d.batch_size)
    parser.add_argument("--lr", type=float, default=d.lr)
    parser.add_argument("--seed", type=int, default=d.seed)
    parser.add_argument("--caption-fraction", type=float, default=d.caption_fraction)
    parser.add_argument("--eval-scenes", type=int, default=d.eval_scenes)
    parser.add_argument("--eval-every", type=int, default=0, help="steps between dev evals on 100 scenes (0: none)")
    parser.add_argument("--log-every", type=int, default=50)
    args = parser.parse_args(argv)
    recipe = Recipe(steps=args.steps, batch_size=args.batch_size, lr=args.lr, seed=args.seed,
                    caption_fraction=args.caption_fraction,
                    eval_scenes=args.eval_scenes, warmup=min(d.warmup, max(1, args.steps // 10)))
    json_stage = replace(JSON_STAGE, steps=args.json_steps, batch_size=args.batch_size, seed=args.seed,
                         warmup=min(JSON_STAGE.warmup, max(1, args.json_steps // 10)))
    train(args.out, recipe, json_stage, ModelSize(), args.eval_every, args.log_every, args.start_from)


if __name__ == "__main__":
    main()
