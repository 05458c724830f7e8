"""How well the MTP layer drafts on held-out scenes: predicted from teacher forcing, then measured in vlmrun.

`greedy_sequences`: the model's own greedy answers (HF transformers, `training.evaluate.hf_greedy`) to
the caption, JSON and question prompts of held-out scenes, each closed with `<|im_end|>`: greedy
speculative decoding verifies drafts against exactly these tokens. `draft_hits` runs the layer over
them (teacher-forced, all draft steps at once: `MTPHead.unrolled`) and counts, per anchor position, how
many leading drafts are right; `top1` is each draft step's accuracy. `simulate` replays vlmrun's greedy
verify loop over those counts (k drafts a step, fewer near max_tokens, the accepted ones and one more
token kept) and so predicts the engine's speculation counters for each request; `measure_in_vlmrun`
runs the written checkpoint with `{"method": "mtp"}` on the same prompts and reads the counters back.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from testing.scene_drawing import render_scene
from training.data import IGNORE
from training.evaluate import MAX_NEW_TOKENS, EvalRequest, hf_greedy
from training.mtp_head import FrozenModel, MTPHead
from vlmrun.processors import Processor


@dataclass
class Sequence:
    """One held-out request as greedy decoding answers it."""

    kind: str  # "caption", "json" or "question"
    prompt_ids: list[int]
    answer_ids: list[int]  # the greedy answer, `<|im_end|>` last (unless it ran to MAX_NEW_TOKENS)
    pixel_values: torch.Tensor
    grid_thw: tuple[int, int, int]


@dataclass
class Counters:
    """What vlmrun's `SpecDecodeStats` counts, for one request or summed."""

    num_drafts: int = 0  # verify steps with drafts
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    def add(self, other: "Counters") -> "Counters":
        return Counters(self.num_drafts + other.num_drafts, self.num_draft_tokens + other.num_draft_tokens,
                        self.num_accepted_tokens + other.num_accepted_tokens)

    def summary(self) -> dict[str, float]:
        return {"verify_steps": self.num_drafts, "draft_tokens": self.num_draft_tokens,
                "accepted_tokens": self.num_accepted_tokens,
                "acceptance_rate": round(self.num_accepted_tokens / max(1, self.num_draft_tokens), 4),
                "mean_accepted_length": round(1 + self.num_accepted_tokens / max(1, self.num_drafts), 4)}


def greedy_sequences(model, processor: Processor, requests: list[EvalRequest]) -> list[Sequence]:
    end = processor.tokenizer.convert_tokens_to_ids("<|im_end|>")
    answers = hf_greedy(model, processor, requests)
    out = []
    for r, answer in zip(requests, answers):
        prompt = processor.process_prompt(r.prompt, [render_scene(r.scene)])
        (item,) = prompt.mm_items
        closed = answer + [end] if len(answer) < MAX_NEW_TOKENS else answer
        kind = r.kind if r.kind in ("caption", "json") else "question"
        out.append(Sequence(kind, list(prompt.token_ids), closed, item.pixel_values, tuple(item.grid_thw)))
    return out


def _batch(seqs: list[Sequence], pad: int, image: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Right-padded model inputs and the targets of the layer at each position p (token p + 2 where it is
    an answer token, else IGNORE) [B, L-1]."""
    length = max(len(s.prompt_ids) + len(s.answer_ids) for s in seqs)
    ids = torch.full((len(seqs), length), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    targets = torch.full((len(seqs), length - 1), IGNORE, dtype=torch.long)
    for row, s in enumerate(seqs):
        n_prompt, n = len(s.prompt_ids), len(s.prompt_ids) + len(s.answer_ids)
        ids[row, :n] = torch.tensor(s.prompt_ids + s.answer_ids)
        mask[row, :n] = 1
        targets[row, n_prompt - 2 : n - 2] = ids[row, n_prompt:n]  # position p predicts token p + 2
    batch = {"input_ids": ids, "attention_mask": mask, "pixel_values": torch.cat([s.pixel_values for s in seqs]),
             "image_grid_thw": torch.tensor([s.grid_thw for s in seqs], dtype=torch.long),
             "mm_token_type_ids": (ids == image).to(torch.int32)}
    return batch, targets


@torch.no_grad()
def draft_hits(frozen: FrozenModel, head: MTPHead, seqs: list[Sequence], depth: int, pad: int, image: int,
               batch_size: int = 32) -> tuple[list[list[int]], list[list[int]]]:
    """Per sequence and answer anchor q (q = n_prompt - 1 + i for its i-th answer token) the number of
    leading drafts 1 .. depth that are right; and per draft step [right, counted] over all anchors."""
    hits: list[list[int]] = []
    top1 = [[0, 0] for _ in range(depth)]
    for start in range(0, len(seqs), batch_size):
        chunk = seqs[start : start + batch_size]
        batch, targets = _batch(chunk, pad, image)
        logits = frozen.draft_logits(head, batch, depth)
        right = [(lg.argmax(-1) == targets) & (targets != IGNORE) for lg in logits]  # per step [B, L-1]
        for row, s in enumerate(chunk):
            n_prompt, m = len(s.prompt_ids), len(s.answer_ids)
            leading = []
            for q in range(n_prompt - 1, n_prompt - 1 + m):
                count = 0
                for step in range(depth):  # draft step + 1 runs at position q + step, predicting token q + step + 2
                    p = q + step
                    if p >= n_prompt + m - 2:  # its target lies past the answer
                        break
                    top1[step][1] += int(count == step)
                    if not bool(right[step][row, p]):
                        break
                    count += 1
                    top1[step][0] += 1
                leading.append(count)
            hits.append(leading)
    return hits, top1


def simulate(leading: list[int], k: int, max_tokens: int = MAX_NEW_TOKENS) -> Counters:
    """vlmrun's greedy verify loop over one answer: after the prefill's token, each step at the last kept
    token's anchor gets min(k, max_tokens - outputs - 1) drafts, keeps the leading right ones and one more."""
    m = len(leading)  # answer tokens; leading[i]: right drafts from the anchor before answer token i + 1
    out = Counters()
    kept = 1
    while kept < m:
        drafts = min(k, max_tokens - kept - 1)
        if drafts <= 0:
            kept += 1
            continue
        accepted = min(leading[kept - 1], drafts)
        out = out.add(Counters(1, drafts, accepted))
        kept += accepted + 1
    return out


def predicted(seqs: list[Sequence], hits: list[list[int]], k: int) -> dict[str, Counters]:
    """Simulated counters per kind and over all ("all")."""
    totals: dict[str, Counters] = {}
    for s, leading in zip(seqs, hits):
        c = simulate(leading, k)
        for key in (s.kind, "all"):
            totals[key] = totals.get(key, Counters()).add(c)
    return totals


def measure_in_vlmrun(model_dir: Path, requests: list[EvalRequest], seqs: list[Sequence], k: int) -> dict:
    """The checkpoint in vlmrun (float32, CPU) with MTP drafts on the same prompts: its counters per kind,
    and how many answers equal the greedy sequences (speculation must not change a token)."""
    from vlmrun import LLM, SamplingParams

    llm = LLM(str(model_dir), dtype="float32", device="cpu",
              speculative_config={"method": "mtp", "num_speculative_tokens": k})
    try:
        prompts = [{"prompt": r.prompt, "images": [render_scene(r.scene)]} for r in requests]
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS), use_tqdm=False)
    finally:
        llm.engine.shutdown()
    totals: dict[str, Counters] = {}
    same = 0
    for s, o in zip(seqs, outs):
        st = o.metrics.spec_decode
        c = Counters(st.num_drafts, st.num_draft_tokens, st.num_accepted_tokens)
        for key in (s.kind, "all"):
            totals[key] = totals.get(key, Counters()).add(c)
        same += int(list(o.token_ids) == s.answer_ids)
    return {"counters": totals, "same_tokens_as_hf": same}
