"""LoRA adapters made by `peft` on the tiny checkpoints of every architecture, against HF + PEFT.

Per architecture three adapters: every text linear (and, on MoE models, the experts' fused tensors
through `target_parameters`), rank 4; a regex target list with rsLoRA, rank 8; and (VL models) one on
the vision tower and merger plus the text q_proj. Each runs alone through `LLM.chat(...,
lora_request=...)` and must equal HF + PEFT in float32 (greedy tokens, logprobs within 1e-4), on a
text prompt and (VL models) an image prompt; then all of them and the base model in one batch, with
fewer slots than adapters (LRU eviction, admission held back by `max_loras`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from torch import nn

from testing.hf_reference import HFReference, HFResult
from testing.lora_adapters import (EXPERT_PARAMETERS, TEXT_LINEARS, TEXT_ONLY_REGEX, VISION_REGEX, build_peft_adapter,
                                   peft_reference)
from tests.test_engine_parity import TOPK, assert_matches, make_image, user
from vlmrun import LLM, LoRARequest, SamplingParams
from vlmrun.lora.layers import NO_ADAPTER, LoRABatch
from vlmrun.lora.manager import LoRAManager

ARCHS = ["qwen3", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe", "qwen3_next"]
MOE = {"qwen3_vl_moe", "qwen3_5_moe", "qwen3_next"}
MAX_NEW = 6  # greedy tokens compared per request (fewer than the parity tests' 10: HF + PEFT runs 2-3x per arch)


def params() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_NEW, logprobs=TOPK)


@dataclass
class LoRASetup:
    model_dir: Path
    adapters: dict[str, Path]  # adapter name -> PEFT folder
    cases: dict[str, list[dict]]  # case name -> messages
    expected: dict[tuple[str, str], HFResult]  # (adapter name or "base", case) -> HF (+ PEFT)

    def request(self, name: str) -> LoRARequest:
        return LoRARequest(name, list(self.adapters).index(name) + 1, str(self.adapters[name]))


def adapter_specs(arch: str, is_vl: bool) -> dict[str, dict]:
    specs = {
        "all": dict(target_modules=TEXT_LINEARS, target_parameters=EXPERT_PARAMETERS if arch in MOE else None,
                    r=4, lora_alpha=8, seed=1),
        "rs_regex": dict(target_modules=TEXT_ONLY_REGEX, r=8, lora_alpha=8, use_rslora=True, seed=2),
    }
    if is_vl:
        specs["vision"] = dict(target_modules=VISION_REGEX + r"|.*language_model.*\.q_proj", r=4, lora_alpha=8,
                               seed=3, b_gain=1.0)
    else:
        specs["qv"] = dict(target_modules=["q_proj", "v_proj"], r=2, lora_alpha=4, seed=3)
    return specs


_SETUPS: dict[str, LoRASetup] = {}


def lora_setup(request, arch: str) -> LoRASetup:
    if arch not in _SETUPS:
        model_dir = request.getfixturevalue(f"{arch}_dir")
        folder = request.getfixturevalue("tmp_path_factory").mktemp(f"lora_{arch}")
        base = HFReference(model_dir)
        cases = {"text": [user("Tell me about the sea and the sky.")]}
        if base.is_vl:
            cases["image"] = [user(make_image(120, 90, 1), "Describe the image.")]
        expected = {("base", case): base.generate(msgs, MAX_NEW) for case, msgs in cases.items()}
        adapters = {}
        for name, spec in adapter_specs(arch, base.is_vl).items():
            adapters[name] = build_peft_adapter(model_dir, folder / name, **spec)
            ref = peft_reference(model_dir, adapters[name])
            for case, msgs in cases.items():
                expected[(name, case)] = ref.generate(msgs, MAX_NEW)
                assert expected[(name, case)].token_ids != expected[("base", case)].token_ids, \
                    f"{arch} {name} {case}: the adapter should change the greedy tokens"
        _SETUPS[arch] = LoRASetup(model_dir, adapters, cases, expected)
    return _SETUPS[arch]


@pytest.fixture(scope="module", params=ARCHS)
def setup(request) -> LoRASetup:
    return lora_setup(request, request.param)


def test_adapters_alone_and_mixed_equal_peft(setup):
    """Each adapter alone (its own call), then the base and every adapter in one call through two slots:
    at most two adapters run in a step, the others wait for a slot (LRU eviction), and every row gets its
    own adapter's tokens, which are HF + PEFT's."""
    llm = LLM(str(setup.model_dir), dtype="float32", device="cpu", enable_lora=True, max_loras=2, max_lora_rank=8)
    cases = list(setup.cases)
    for name in setup.adapters:
        outs = llm.chat([setup.cases[c] for c in cases], params(), use_tqdm=False, lora_request=setup.request(name))
        for case, out in zip(cases, outs):
            assert_matches(out, setup.expected[(name, case)], f"{name}/{case} alone")
    jobs = [(name, case) for name in ["base", *setup.adapters] for case in cases]
    outs = llm.chat([setup.cases[case] for _, case in jobs], params(), use_tqdm=False,
                    lora_request=[None if name == "base" else setup.request(name) for name, _ in jobs])
    for (name, case), out in zip(jobs, outs):
        assert_matches(out, setup.expected[(name, case)], f"{name}/{case} in a mixed batch")


def test_all_slots_in_one_step(request, monkeypatch):
    """Four slots: base and three adapters decode together in the same steps (one forward, each slot's update
    on its own rows), decode padded to batch-size buckets as on CUDA: seven sequences run as eight rows,
    the padding row gets no adapter (the bound rows are padded as the model starts)."""
    setup = lora_setup(request, "qwen3_vl_moe")
    llm = LLM(str(setup.model_dir), dtype="float32", device="cpu", enable_lora=True, max_loras=4, max_lora_rank=8,
              enforce_eager=False)
    padded: list[int] = []  # the row counts the bound batches were padded to
    pad = LoRABatch.padded_to

    def counted(batch: LoRABatch, num_rows: int) -> LoRABatch:
        out = pad(batch, num_rows)
        if out is not batch:
            padded.append(num_rows)
        return out

    monkeypatch.setattr(LoRABatch, "padded_to", counted)
    jobs = [(name, case) for name in ["base", *setup.adapters] for case in setup.cases][:7]
    outs = llm.chat([setup.cases[case] for _, case in jobs], params(), use_tqdm=False,
                    lora_request=[None if name == "base" else setup.request(name) for name, _ in jobs])
    for (name, case), out in zip(jobs, outs):
        assert_matches(out, setup.expected[(name, case)], f"{name}/{case}")
    assert len(llm.engine.executor.lora.slot_of) == len(setup.adapters)
    assert llm.engine.executor.bucketed_steps is not None and 8 in padded, padded


def test_prefix_cache_keys_include_the_adapter(request):
    """The same prompt with an adapter, then the base model, then the adapter again: the base run must
    not reuse the adapter's KV pages (nor the adapter the base's), while a repeat with the same adapter hits."""
    setup = lora_setup(request, "qwen3")
    llm = LLM(str(setup.model_dir), dtype="float32", device="cpu", enable_lora=True, page_size=4)
    msgs = setup.cases["text"]
    for name in ["all", "base", "all", "base"]:
        lora = None if name == "base" else setup.request(name)
        assert_matches(llm.chat(msgs, params(), use_tqdm=False, lora_request=lora)[0],
                       setup.expected[(name, "text")], name)
    stats = llm.engine.prefix_cache_stats()
    assert stats.queries == 4 and stats.hits == 2, stats


def test_vision_adapter_keys_the_encoder_cache(request):
    """An image encoded with a vision-tower adapter is cached apart from the base tower's embedding."""
    setup = lora_setup(request, "qwen2_5_vl")
    llm = LLM(str(setup.model_dir), dtype="float32", device="cpu", enable_lora=True, enable_prefix_caching=False)
    msgs = setup.cases["image"]
    for name in ["vision", "base", "rs_regex", "vision"]:
        lora = None if name == "base" else setup.request(name)
        assert_matches(llm.chat(msgs, params(), use_tqdm=False, lora_request=lora)[0],
                       setup.expected[(name, "image")], name)
    cache = llm.engine.executor.vision.cache
    assert cache.misses == 2, "one encoding with the vision adapter, one base encoding shared by the text-only adapter"


def test_the_bound_rows_are_padded_once_as_the_model_starts():
    """A padded decode picks its bucket after `bind` (inside the runner's forward): as the model's forward
    starts, the manager pads the bound rows once to the forward's rows (the extra rows run no adapter), and
    every layer of that forward reads the padded batch."""

    class Probe(nn.Module):
        def forward(self, input_ids: torch.Tensor, positions: object, fb: object) -> object:
            return manager.context.batch

    probe = Probe()
    manager = LoRAManager(probe, 3, 4, torch.device("cpu"), torch.float32)
    manager.bind([1, NO_ADAPTER, 0], [2, 1, 2])  # 5 rows
    seen = probe(torch.zeros(8, dtype=torch.int64), None, None)
    want = torch.zeros(2, 8, 1, dtype=torch.bool)  # slots 0 and 1
    want[1, 0:2] = want[0, 3:5] = True
    assert seen.slots == (0, 1) and torch.equal(seen.owns, want)
    assert probe(torch.zeros(8, dtype=torch.int64), None, None) is seen  # already covers 8 rows: kept
    manager.bind([2], [1])  # one adapter: no rows to pad
    assert probe(torch.zeros(8, dtype=torch.int64), None, None).single == 2
