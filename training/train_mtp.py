"""Stage three of the bundled model: its MTP layer, `python -m training.train_mtp --from DIR --out DIR`.

Fits one multi-token-prediction layer (`training.mtp_head.MTPHead`: the weights and maths of vlmrun's
`MultiTokenPredictor`) on the stage-two checkpoint in --from, whose weights stay frozen: the model runs
without gradients and gives the layer its final hidden states, its (image-spliced) input embeddings and
its M-RoPE rotary; the layer learns token p + 2 from h_p and the embedding of token p + 1, and
(`--depth` > 1) from its own output one position back, as vlmrun drafts its second and third tokens.
The loss is the cross-entropy over answer tokens of draft step s, weighted 2^-(s-1).

Same rules as the other stages: one command, fixed seeds, a deterministic data order (step s trains on
training scenes `first_scene` + s*B .., after stage two's, one task each by `pick_task`), one intra-op
thread for the compute and one worker process that renders the batches. At the end it evaluates on
held-out scenes (`EVAL_SEED`): per draft step the layer's top-1 accuracy against the model's own
greedy answers, and the speculation counters that predicts for vlmrun; then writes the checkpoint
(--from's files unchanged, the layer in `model-mtp.safetensors`, a shard index, `mtp_num_hidden_layers`
in config.json), runs it in vlmrun with MTP drafts on the same prompts, and records all of it in
training_results.json and the model card.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.modules["fla"] = None  # type: ignore[assignment]  # HF's torch GDN path, as in train_default_model

import torch  # noqa: E402

from testing.scene_splits import EVAL_SEED, eval_scenes  # noqa: E402
from training.data import IGNORE, StageBatches  # noqa: E402
from training.evaluate import eval_requests  # noqa: E402
from training.fast_ops import linear_patch_embed, restore_patch_embed, short_gdn_chunks  # noqa: E402
from training.model_card import write_model_card  # noqa: E402
from training.mtp_eval import draft_hits, greedy_sequences, measure_in_vlmrun, predicted  # noqa: E402
from training.mtp_head import FrozenModel, MTPHead, load_mtp_head  # noqa: E402
from training.schedule import warmup_cosine  # noqa: E402
from vlmrun.default_model import default_model_path  # noqa: E402
from vlmrun.layers.cpu_kernels import _cpu_model_name as cpu_model_name  # noqa: E402
from vlmrun.processors import Processor  # noqa: E402

MTP_SHARD = "model-mtp.safetensors"
MAIN_SHARD = "model.safetensors"
INDEX = "model.safetensors.index.json"


@dataclass(frozen=True)
class MTPRecipe:
    steps: int = 900
    batch_size: int = 16
    lr: float = 2e-3
    min_lr_ratio: float = 0.05
    warmup: int = 50
    weight_decay: float = 0.05
    grad_clip: float = 1.0
    depth: int = 2  # draft steps trained (vlmrun's drafts 1 .. depth)
    caption_fraction: float = 0.6
    json_fraction: float = 0.3  # the rest: questions (one-word answers, little to draft)
    seed: int = 1234
    first_scene: int = 112_000  # after stage one's 5000 x 16 and stage two's 2000 x 16 training scenes
    eval_scenes: int = 200


def lr_at(step: int, r: MTPRecipe) -> float:
    return warmup_cosine(step, r.lr, r.warmup, r.steps, r.min_lr_ratio)


def draft_loss(logits: list[torch.Tensor], targets: torch.Tensor) -> tuple[torch.Tensor, list[float]]:
    """sum_s 2^-(s-1) CE(step s) over the answer tokens; and each step's CE."""
    keep = targets != IGNORE  # [B, L-1]
    losses = [torch.nn.functional.cross_entropy(lg[keep], targets[keep]) for lg in logits]
    total = sum(loss * 0.5 ** s for s, loss in enumerate(losses))
    return total, [loss.item() for loss in losses]


def build_head(model, recipe: MTPRecipe) -> MTPHead:
    """The layer, seeded; its decoder layer starts from the model's last full-attention layer (same shapes)."""
    torch.manual_seed(recipe.seed)
    head = MTPHead(model.config).to(torch.float32)
    text = model.model.language_model
    last_full = max(i for i, t in enumerate(text.config.layer_types) if t == "full_attention")
    head.layers[0].load_state_dict(text.layers[last_full].state_dict())
    return head.train()


def train(frozen: FrozenModel, head: MTPHead, recipe: MTPRecipe, model_dir: Path, pad: int, image: int,
          log_every: int) -> list[dict]:
    decay = [p for p in head.parameters() if p.dim() >= 2]
    no_decay = [p for p in head.parameters() if p.dim() < 2]
    optim = torch.optim.AdamW([{"params": decay, "weight_decay": recipe.weight_decay},
                               {"params": no_decay, "weight_decay": 0.0}], lr=recipe.lr, betas=(0.9, 0.98))
    loader = torch.utils.data.DataLoader(
        StageBatches(model_dir, recipe.steps, recipe.first_scene, recipe.batch_size, recipe.seed,
                     recipe.caption_fraction, recipe.json_fraction, pad, image),
        batch_size=None, shuffle=False, num_workers=1, prefetch_factor=4, persistent_workers=False)
    history: list[dict] = []
    running = [0.0] * recipe.depth
    start = time.time()
    with short_gdn_chunks():
        for step, batch in enumerate(loader):
            for group in optim.param_groups:
                group["lr"] = lr_at(step, recipe)
            labels = batch.pop("labels")
            for name in ("aux_labels", "subject_pos", "subject_labels"):
                batch.pop(name)
            loss, per_step = draft_loss(frozen.draft_logits(head, batch, recipe.depth), labels[:, 1:])
            loss.backward()
            torch.nn.utils.clip_grad_norm_(head.parameters(), recipe.grad_clip)
            optim.step()
            optim.zero_grad(set_to_none=True)
            running = [a + b for a, b in zip(running, per_step)]
            if (step + 1) % log_every == 0:
                minutes = (time.time() - start) / 60
                losses = [round(x / log_every, 5) for x in running]
                print(f"mtp step {step + 1}/{recipe.steps} draft losses {losses} lr {lr_at(step, recipe):.2e} "
                      f"{minutes:.1f} min", flush=True)
                history.append({"step": step + 1, "loss": losses, "minutes": round(minutes, 2)})
                running = [0.0] * recipe.depth
    return history


def write_checkpoint(src: Path, out: Path, head: MTPHead) -> None:
    """--from's files copied unchanged, the layer in its own shard, the index, mtp_num_hidden_layers."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    if src.resolve() != out.resolve():
        for f in src.iterdir():
            if f.is_file() and f.name not in (MTP_SHARD, INDEX):
                shutil.copyfile(f, out / f.name)
    weights = head.mtp_state_dict()
    save_file(weights, str(out / MTP_SHARD), metadata={"format": "pt"})
    (out / MTP_SHARD).chmod(0o644)
    with safe_open(str(out / MAIN_SHARD), framework="pt") as f:
        main_names = list(f.keys())
    weight_map = {name: MAIN_SHARD for name in main_names} | {name: MTP_SHARD for name in weights}
    size = (out / MAIN_SHARD).stat().st_size + (out / MTP_SHARD).stat().st_size
    index = {"metadata": {"total_size": size}, "weight_map": dict(sorted(weight_map.items()))}
    (out / INDEX).write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
    config = json.loads((out / "config.json").read_text(encoding="utf-8"))
    config["text_config"]["mtp_num_hidden_layers"] = 1
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def _write_results(out: Path, results: dict) -> None:
    (out / "training_results.json").write_text(json.dumps(results, indent=1) + "\n", encoding="utf-8")
    write_model_card(out, results)


def run(src: Path, out: Path, recipe: MTPRecipe, log_every: int, measure_k: list[int],
        evaluate_only: bool = False) -> dict:
    """The stage (train, evaluate, write, measure in vlmrun); with evaluate_only, --from's MTP layer and
    training figures kept and only the held-out evaluation and the vlmrun measurement done again."""
    from transformers import Qwen3_5ForConditionalGeneration

    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    results = json.loads((src / "training_results.json").read_text(encoding="utf-8"))
    if "json_stage" not in results:
        raise ValueError(f"--from {src}: not a stage-two checkpoint (its training_results.json has no json_stage)")
    processor = Processor.from_pretrained(src)
    tok = processor.tokenizer
    pad, image = tok.convert_tokens_to_ids("<|endoftext|>"), tok.convert_tokens_to_ids("<|image_pad|>")
    model = Qwen3_5ForConditionalGeneration.from_pretrained(str(src), dtype=torch.float32)
    frozen_weights = {k: v.clone() for k, v in model.state_dict().items()}
    linear_patch_embed(model)
    frozen = FrozenModel(model)
    head = build_head(model, recipe)
    n_params = sum(p.numel() for p in head.parameters())
    print(f"MTP layer: {n_params / 1e6:.3f} M parameters; the model's {len(frozen_weights)} tensors frozen", flush=True)

    if evaluate_only:  # the layer and the training figures of --from's own MTP stage
        head, stage = load_mtp_head(src, model.config), results["mtp_stage"]
        history, minutes, recipe = stage["loss_history"], stage["minutes"], MTPRecipe(**stage["recipe"])
    else:
        start = time.time()
        history = train(frozen, head, recipe, src, pad, image, log_every)
        minutes = round((time.time() - start) / 60, 1)
    restore_patch_embed(model)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in frozen_weights.items()), "a main weight moved"
    head.eval()

    t0 = time.time()
    requests = eval_requests(eval_scenes(recipe.eval_scenes, EVAL_SEED))
    seqs = greedy_sequences(model, processor, requests)
    # every measured k is predicted: draft steps past the trained depth run the same layer once more
    hits, top1 = draft_hits(frozen, head, seqs, max(recipe.depth, *measure_k), pad, image)
    eval_minutes = round((time.time() - t0) / 60, 1)
    write_checkpoint(src, out, head)
    acceptance: dict[str, dict] = {}
    results["mtp_stage"] = {
        "recipe": asdict(recipe), "parameters": n_params, "minutes": minutes,
        "torch": results["mtp_stage"]["torch"] if evaluate_only else torch.__version__,
        "cpu": results["mtp_stage"]["cpu"] if evaluate_only else cpu_model_name(), "eval_minutes": eval_minutes, "vlmrun_minutes": None,
        "heldout": {"split_seed": EVAL_SEED, "scenes": recipe.eval_scenes, "requests": len(seqs),
                    "reference": "the model's own greedy answers (HF transformers)",
                    "top1": [round(right / max(1, counted), 4) for right, counted in top1],
                    "top1_counts": top1},
        "acceptance": acceptance,
        "loss_history": history,
    }
    _write_results(out, results)  # the training figures first: the measurement below runs vlmrun
    t0 = time.time()
    for k in measure_k:
        pred = predicted(seqs, hits, k)
        measured = measure_in_vlmrun(out, requests, seqs, k)
        acceptance[str(k)] = {kind: {"predicted": pred[kind].summary(), "measured": measured["counters"][kind].summary()}
                              for kind in pred}
        acceptance[str(k)]["same_tokens_as_hf"] = f"{measured['same_tokens_as_hf']} of {len(seqs)}"
        print(f"k={k}: {json.dumps(acceptance[str(k)])}", flush=True)
    results["mtp_stage"]["vlmrun_minutes"] = round((time.time() - t0) / 60, 1)
    _write_results(out, results)
    print(f"MTP stage: {minutes} min; held-out top-1 per draft step {results['mtp_stage']['heldout']['top1']}",
          flush=True)
    return results


def main(argv: list[str] | None = None) -> None:
    d = MTPRecipe()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--from", dest="start_from", type=Path, default=default_model_path(),
                        help="the stage-two checkpoint (default: the bundled one)")
    parser.add_argument("--out", type=Path, required=True, help="checkpoint directory to write (may be --from)")
    parser.add_argument("--steps", type=int, default=d.steps)
    parser.add_argument("--batch-size", type=int, default=d.batch_size)
    parser.add_argument("--lr", type=float, default=d.lr)
    parser.add_argument("--depth", type=int, default=d.depth)
    parser.add_argument("--eval-scenes", type=int, default=d.eval_scenes)
    parser.add_argument("--measure-k", type=int, nargs="+", default=[1, 2, 3, 4],
                        help="num_speculative_tokens values to measure in vlmrun")
    parser.add_argument("--log-every", type=int, default=50)
    parser.add_argument("--evaluate-only", action="store_true",
                        help="no training: evaluate and measure --from's MTP layer again (e.g. after a vlmrun change)")
    args = parser.parse_args(argv)
    recipe = MTPRecipe(steps=args.steps, batch_size=args.batch_size, lr=args.lr, depth=args.depth,
                       eval_scenes=args.eval_scenes, warmup=min(d.warmup, max(1, args.steps // 10)))
    run(args.start_from, args.out, recipe, args.log_every, args.measure_k, args.evaluate_only)


if __name__ == "__main__":
    main()
