"""HF parity at the per-layer shapes of published models (tests/real_shapes.py), float32 on CPU.

Qwen2.5-VL-3B, Qwen3-VL-2B, Qwen3.5-35B-A3B and Qwen3-Next-80B-A3B widths (few layers and experts,
small vocabulary and images) against HF `generate` with HF's default processor: prompt ids equal,
greedy tokens equal, top-5 logprobs within 1e-4 at every step, on a text prompt and (VL models) an
image prompt with two images of odd sizes. vlmrun runs with its default image backend, which is the
one HF's default processor uses.
"""

from __future__ import annotations

import gc

import pytest

from testing.hf_reference import HFReference
from tests.real_shapes import REAL_SHAPES, build_real_shape_checkpoint
from tests.test_engine_parity import assert_matches, make_image, user
from vlmrun import LLM, SamplingParams

MAX_NEW = 4
TOPK = 5


def cases_for(is_vl: bool) -> dict[str, list[dict]]:
    cases = {"text": [{"role": "system", "content": "You are brief."}, user("Tell me about the sea.")]}
    if is_vl:
        cases["images"] = [user(make_image(90, 61, 1), make_image(37, 120, 2), "Compare these pictures.")]
    return cases


@pytest.mark.parametrize("name", list(REAL_SHAPES))
def test_real_shape_parity_with_hf(name: str, tmp_path_factory: pytest.TempPathFactory) -> None:
    model_dir = build_real_shape_checkpoint(name, tmp_path_factory.mktemp(f"real_{name}"))
    hf = HFReference(model_dir)
    cases = cases_for(hf.is_vl)
    expected = {case: hf.generate(msgs, MAX_NEW) for case, msgs in cases.items()}
    del hf
    gc.collect()
    llm = LLM(str(model_dir), dtype="float32", device="cpu", max_num_seqs=4)
    outs = llm.chat(list(cases.values()), SamplingParams(temperature=0.0, max_tokens=MAX_NEW, logprobs=TOPK),
                    use_tqdm=False)
    for (case, exp), out in zip(expected.items(), outs):
        assert_matches(out, exp, f"{name}/{case}")
