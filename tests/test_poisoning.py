"""One request's NaN / inf never reaches another request's answer (issue 45, item 1).

A request can fill its KV pages (and GDN state) with inf / NaN: here an adapter whose weights are
finite but huge (3e38), so its activations overflow. Such an adapter loads (its tensors are finite);
what it produces must stay its own. Two ways it used to leak, each checked on its own:

- attention that gathers whole KV pages and hides positions past a sequence's length by the mask
  alone: 0 x NaN is NaN, so a page tail (or a stale page-table entry) holding another request's
  NaN poisoned the reader. Checked on the torch and cpu backends, pure full-attention (qwen3) and
  hybrid (qwen3_5) models, a base request run after the bad one and one already decoding when the
  bad one joins;
- the mixed-adapter LoRA update, which multiplied every slot's update by a 0/1 one-hot: one slot
  with non-finite values (or a row whose x @ A of another slot overflows) reached every row.

A base request beside or after the bad one must equal its solo run: tokens and logprobs.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Optional

import pytest
import torch
from safetensors.torch import load_file, save_file

from testing.lora_adapters import build_peft_adapter
from vlmrun import LLM, LoRARequest, SamplingParams
from vlmrun.lora.layers import LoRABatch, low_rank_update

BASE_PROMPT = "Tell me about the sea."
BAD_PROMPT = "Name three colours and then describe each of them in a long sentence, please, slowly."


def huge_adapter(model_dir: Path, out: Path) -> Path:
    """An adapter on every attention / MLP projection whose finite weights overflow the activations."""
    folder = build_peft_adapter(model_dir, out, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "down_proj",
                                                                "in_proj_qkv", "out_proj"], r=4, lora_alpha=4, seed=7)
    path = folder / "adapter_model.safetensors"
    save_file({k: torch.full_like(v, 3e38) for k, v in load_file(str(path)).items()}, str(path))
    return folder


def params(max_tokens: int = 8) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=2)


def make_llm(model_dir: Path, backend: str) -> LLM:
    return LLM(str(model_dir), dtype="float32", device="cpu", attention_backend=backend, enable_lora=True,
               max_loras=2, max_lora_rank=4, page_size=8, max_num_seqs=4)


def run(llm: LLM, plan: list[tuple], bad_lora: Optional[LoRARequest] = None) -> dict[str, object]:
    """Requests added at given steps, (step, id, prompt, bad[, max_tokens]) (bad: runs `bad_lora`, 24 tokens
    by default; others 8); -> id -> result."""
    engine = llm.engine
    results, step = {}, 0
    pending = sorted(plan)
    while pending or engine.has_unfinished():
        while pending and pending[0][0] <= step:
            _, rid, prompt, bad, *max_tokens = pending.pop(0)
            engine.add_request(rid, engine.process({"prompt": prompt, "images": []}),
                               params(*max_tokens or [24 if bad else 8]), bad_lora if bad else None)
        results.update((u.request_id, u.result) for u in engine.step() if u.finished)
        step += 1
    return results


def assert_same(got, want, what: str) -> None:
    assert got.token_ids == want.token_ids, (what, got.token_ids, want.token_ids)
    for i, (g, w) in enumerate(zip(got.logprobs, want.logprobs)):
        assert g.keys() == w.keys(), (what, i, g, w)
        for t in w:
            assert math.isfinite(g[t]) and abs(g[t] - w[t]) < 1e-4, (what, i, g, w)


@pytest.fixture(scope="module")
def adapters(tmp_path_factory, qwen3_dir, qwen3_5_dir) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("poison")
    return {"qwen3": huge_adapter(qwen3_dir, root / "qwen3"), "qwen3_5": huge_adapter(qwen3_5_dir, root / "qwen3_5")}


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_5"])
@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_a_nan_request_leaves_other_requests_alone(request, adapters, arch, backend):
    model_dir = request.getfixturevalue(f"{arch}_dir")
    llm = make_llm(model_dir, backend)
    huge = LoRARequest("huge", 1, str(adapters[arch]))
    solo = run(llm, [(0, "solo", BASE_PROMPT, False)])["solo"]
    bad = run(llm, [(0, "bad", BAD_PROMPT, True)], huge)["bad"]
    assert any(not math.isfinite(v) for lp in bad.logprobs for v in lp.values()), "the adapter makes no NaN"
    # after the bad request: its freed pages (and GDN slot) are reused
    assert_same(run(llm, [(0, "after", BASE_PROMPT, False)])["after"], solo, "after")
    # a request with a long answer leaves its row and its answer's pages; a base request takes the row
    # and decodes, the bad one joins and takes those pages: the base row's stale page-table entries
    # past its length point at the bad request's pages, which its batch's longest sequence reaches
    run(llm, [(0, "warm", "Tell me a story.", False, 60)])
    got = run(llm, [(0, "running", BASE_PROMPT, False), (3, "bad2", BAD_PROMPT, True), (3, "beside", BASE_PROMPT, False)],
              huge)
    assert_same(got["running"], solo, "already running")
    assert_same(got["beside"], solo, "beside")
    assert_same(run(llm, [(0, "last", BASE_PROMPT, False)])["last"], solo, "last")


def test_a_non_finite_slot_reaches_only_its_own_rows():
    """The mixed-adapter update keeps each row's own slot: slot 1 all NaN, slot 2 so large that x @ A
    overflows; the rows of slot 0 and of no adapter are exactly their own update (the forward's rows, and
    an expert's routed tokens)."""
    gen = torch.Generator().manual_seed(0)
    n_in, n_out, k, slots = 8, 6, 4, 3
    a = torch.randn(slots, k, n_in, generator=gen)
    b = torch.randn(n_out, slots, k, generator=gen)
    a[1], b[:, 1] = float("nan"), float("nan")
    a[2], b[:, 2] = 3e38, 3e38
    x, y = torch.randn(5, n_in, generator=gen), torch.randn(5, n_out, generator=gen)
    batch = LoRABatch.of_spans([0, 1, -1, 2, 0], [1, 1, 1, 1, 1], slots, torch.device("cpu"), torch.float32)
    out = low_rank_update(x, y, a, b, batch)
    own = y + (x @ a[0].T) @ b[:, 0].T
    torch.testing.assert_close(out[[0, 4]], own[[0, 4]], rtol=0, atol=0)
    torch.testing.assert_close(out[2], y[2], rtol=0, atol=0)
    assert out[1].isnan().all()
    # an experts block's routed tokens (slots known on the device only): rows 4, 1, 2, 3 of the forward
    tokens = torch.tensor([4, 1, 2, 3])
    routed = low_rank_update(x[tokens], y[tokens], a, b, batch.select(tokens))
    torch.testing.assert_close(routed[0], own[4], rtol=0, atol=0)
    torch.testing.assert_close(routed[2], y[2], rtol=0, atol=0)
    assert routed[1].isnan().all()
