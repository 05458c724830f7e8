"""Accuracy of a checkpoint on held-out scenes, decoding greedily with HF transformers.

`eval_requests` lists what is asked: for each scene its caption prompt, its JSON prompt (the
reference is `vlmrun.shape_scenes.scene_json`) and one question (`testing.scene_splits.eval_question`). `hf_greedy` batches prompts (left-padded) through HF's
`generate`; `score` compares the answers with the references (exact string match after strip).
The test `tests/test_default_model.py` asks the same through vlmrun.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from testing.scene_drawing import render_scene
from testing.scene_splits import eval_question
from vlmrun.processors import Processor
from vlmrun.shape_scenes import DESCRIBE_JSON_PROMPT, DESCRIBE_PROMPT, Scene, scene_json

MAX_NEW_TOKENS = 160  # a three-shape JSON answer is about 140 tokens of this tokenizer (a caption about 20)


@dataclass(frozen=True)
class EvalRequest:
    scene: Scene
    prompt: str
    reference: str
    kind: str  # "caption", "json" or a question kind (count, colour, ...)


def eval_requests(scenes: list[Scene]) -> list[EvalRequest]:
    """Per scene: the caption request, the JSON request, then its one question."""
    out = []
    for scene in scenes:
        out.append(EvalRequest(scene, DESCRIBE_PROMPT, scene.caption, "caption"))
        out.append(EvalRequest(scene, DESCRIBE_JSON_PROMPT, scene_json(scene), "json"))
        qa = eval_question(scene)
        out.append(EvalRequest(scene, qa.question, qa.answer, qa.kind))
    return out


@torch.no_grad()
def hf_greedy(model, processor: Processor, requests: list[EvalRequest], batch_size: int = 32,
              max_new_tokens: int = MAX_NEW_TOKENS) -> list[list[int]]:
    """Greedy token ids (up to and without the stop token) for each request, via HF generate; batches
    hold requests of one kind (so caption and question batches stop long before JSON ones)."""
    tok = processor.tokenizer
    pad = tok.convert_tokens_to_ids("<|endoftext|>")
    image_id = tok.convert_tokens_to_ids("<|image_pad|>")
    stops = {tok.convert_tokens_to_ids("<|im_end|>"), pad}
    order = sorted(range(len(requests)), key=lambda i: requests[i].kind == "json")  # stable: JSON last
    results: list[list[int]] = [[] for _ in requests]
    for start in range(0, len(order), batch_size):
        rows = order[start : start + batch_size]
        prompts = [processor.process_prompt(requests[i].prompt, [render_scene(requests[i].scene)]) for i in rows]
        length = max(len(p.token_ids) for p in prompts)
        ids = torch.full((len(rows), length), pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, p in enumerate(prompts):
            ids[row, length - len(p.token_ids) :] = torch.tensor(p.token_ids)
            mask[row, length - len(p.token_ids) :] = 1
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            pixel_values=torch.cat([p.mm_items[0].pixel_values for p in prompts]),
            image_grid_thw=torch.tensor([p.mm_items[0].grid_thw for p in prompts]),
            mm_token_type_ids=(ids == image_id).to(torch.int32),
            max_new_tokens=max_new_tokens,
            do_sample=False,
        )
        for i, generated in zip(rows, out[:, length:].tolist()):
            for t in generated:
                if t in stops:
                    break
                results[i].append(t)
    return results


def score(requests: list[EvalRequest], answers: list[str]) -> dict[str, float]:
    """caption / json / question exact-match accuracy, plus per question kind."""
    totals: dict[str, list[int]] = {}
    for r, a in zip(requests, answers):
        group = r.kind if r.kind in ("caption", "json") else "question"
        for key in (group, f"question/{r.kind}" if group == "question" else None):
            if key is not None:
                hit = totals.setdefault(key, [0, 0])
                hit[0] += int(a.strip() == r.reference)
                hit[1] += 1
    return {k: v[0] / v[1] for k, v in sorted(totals.items())}
