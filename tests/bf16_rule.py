"""vLLM's rule for low precision, against HF transformers in bfloat16 on the same device.

Greedy tokens equal up to the first divergence, and there each side's token is among the other
side's top-`TOPK`; and vlmrun's bf16 logprobs no farther from the float32 reference (HF on the
CPU) than HF's own bf16 ones, on average over an architecture's cases (x1.5 + 0.02). The tiny random
models' logits spread wide, so bf16 moves logprobs by 0.1-1.5 on either side (more where an MoE
router flips an expert); one case alone is too noisy to compare, the mean over the cases is not.
A part of the model computed in too low a precision shows as a multiple.
Used by tests/test_gpu_engine.py (CUDA) and tests/test_cpu_bf16.py (CPU).
"""

from __future__ import annotations

from typing import Callable

import torch

from testing.hf_reference import HFReference, HFResult
from tests.test_engine_parity import HYBRID, MAX_NEW, TOPK, cases_for
from vlmrun import LLM, SamplingParams


def first_divergence_ok(ours_tokens: list[int], ours_lps: list[dict[int, float]], ref: HFResult) -> tuple[bool, str]:
    """vLLM's check_logprobs_close: equal until the first differing token, where each side's
    token is in the other's top-TOPK. Returns (ok, what happened)."""
    for step, (a, b) in enumerate(zip(ours_tokens, ref.token_ids)):
        if a == b:
            continue
        ref_top = set(torch.topk(ref.logprobs[step], TOPK).indices.tolist())
        ok = a in ref_top and b in ours_lps[step]
        return ok, f"diverged at step {step}: vlmrun {a}, HF {b} (each in the other's top-{TOPK}: {ok})"
    if len(ours_tokens) != len(ref.token_ids):
        return False, f"lengths differ with equal tokens: {len(ours_tokens)} vs {len(ref.token_ids)}"
    return True, "identical"


def common_prefix(*sequences: list[int]) -> int:
    n = 0
    while all(n < len(s) for s in sequences) and len({s[n] for s in sequences}) == 1:
        n += 1
    return n


def bf16_error(lps: list, ref32: HFResult, token_sets: list[set[int]], steps: int) -> float:
    """Largest |logprob - float32 reference| over the given tokens of the first `steps` steps."""
    def value(step_lps, tok):
        return step_lps[tok] if isinstance(step_lps, dict) else step_lps[tok].item()
    return max((abs(value(lps[s], t) - ref32.logprobs[s][t].item()) for s in range(steps) for t in token_sets[s]),
               default=0.0)


def check_bf16_follows_hf(model_dir, arch: str, make_llm: Callable[[], LLM], device: str, label: str = "") -> None:
    """Every case of the parity suite, one request at a time on HF's side, batched on vlmrun's."""
    hf32 = HFReference(model_dir)
    cases = cases_for(hf32.is_vl, arch in HYBRID)
    reference = {name: hf32.generate(msgs, MAX_NEW) for name, msgs in cases.items()}
    del hf32
    hf = HFReference(model_dir, dtype=torch.bfloat16, device=device, attn_implementation="sdpa")
    expected = {name: hf.generate(msgs, MAX_NEW) for name, msgs in cases.items()}
    del hf
    llm = make_llm()
    assert llm.engine.model_config.dtype == torch.bfloat16
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, logprobs=TOPK)
    outs = llm.chat(list(cases.values()), params, use_tqdm=False)
    failures, ours_errors, hf_errors = [], [], []
    for (name, ref), out in zip(expected.items(), outs):
        assert out.error is None, out.error
        assert out.prompt_token_ids == ref.prompt_ids, f"{arch}/{name}: prompt ids differ"
        ok, what = first_divergence_ok(out.token_ids, out.logprobs, ref)
        ref32 = reference[name]
        steps = min(common_prefix(out.token_ids, ref.token_ids, ref32.token_ids) + 1, len(out.token_ids),
                    len(ref.token_ids), len(ref32.token_ids))
        tokens = [set(lp) for lp in out.logprobs[:steps]]
        ours, theirs = bf16_error(out.logprobs, ref32, tokens, steps), bf16_error(ref.logprobs, ref32, tokens, steps)
        ours_errors.append(ours)
        hf_errors.append(theirs)
        print(f"{arch}/{name}: bf16 vs HF bf16: {what}; |bf16 - fp32| over {steps} steps: "
              f"vlmrun {ours:.3f}, HF {theirs:.3f}")
        if not ok:
            failures.append(f"{name}: {what}")
    ours, theirs = sum(ours_errors) / len(ours_errors), sum(hf_errors) / len(hf_errors)
    print(f"{arch} ({label or device}): mean |bf16 - fp32| vlmrun {ours:.3f}, HF {theirs:.3f}")
    if ours > 1.5 * theirs + 0.02:
        failures.append(f"mean bf16 error vlmrun {ours:.3f} vs HF {theirs:.3f}")
    assert not failures, f"{arch}: " + "; ".join(failures)
