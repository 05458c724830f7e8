"""No device->host sync between a step's launch and its one collect, on every architecture.

Each engine here runs as on CUDA where the CPU allows: the torch attention and GDN backends (the
ones CUDA runs when FlashInfer / FLA are absent), decode padded to batch-size buckets
(`enforce_eager=False`), async scheduling (placeholder tokens read on the device). Every
`ModelRunner.launch` runs under `LaunchSyncGuard` (tests/launch_sync_guard.py: which tensors would
be on the device, and what would make the host wait for them); the steps cover prefill with images
(VL models), plain decode with greedy + logprobs and seeded top-p / top-k sampling with penalties,
n-gram and MTP speculative decoding, and LoRA. On a GPU, `test_no_sync_on_cuda` runs the same steps under
`torch.cuda.set_sync_debug_mode("error")`.
"""

from __future__ import annotations

import collections
import importlib.util
import shutil
from typing import Any

import pytest
import torch

from tests.launch_sync_guard import LaunchSyncGuard
from tests.test_engine_parity import make_image, user
from vlmrun import LLM, LoRARequest, SamplingParams
from vlmrun.executor.model_runner import ModelRunner

ARCHS = ["qwen3", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe", "qwen3_next"]
VL = {"qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe"}
MOE = {"qwen3_vl_moe", "qwen3_5_moe", "qwen3_next"}
HYBRID = ["qwen3_5", "qwen3_5_moe", "qwen3_next"]  # the architectures with an MTP layer
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
MTP = {"method": "mtp", "num_speculative_tokens": 3}
AS_ON_CUDA = dict(attention_backend="torch", gdn_backend="torch", enforce_eager=False)


class GuardedLaunches:
    """Wraps `ModelRunner.launch` so each launch runs under a recording `LaunchSyncGuard`."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch):
        self.syncs: collections.Counter = collections.Counter()
        self.launches = 0
        launch = ModelRunner.launch

        def guarded(runner: ModelRunner, chunks: list, decodes: Any = None) -> Any:
            # the runner's per-row M-RoPE deltas live on the host (made without a device), like the chunks
            guard = LaunchSyncGuard([chunks, decodes, runner.row_mrope_deltas], raise_on_sync=False)
            with guard:
                step = launch(runner, chunks, decodes)
            self.syncs.update(guard.syncs)
            self.launches += 1
            return step

        monkeypatch.setattr(ModelRunner, "launch", guarded)

    def report(self) -> str:
        return "\n".join(f"{n} x {s}" for s, n in self.syncs.most_common())


def conversations(arch: str) -> list[list[dict]]:
    chats = [[user("Tell me about the sea and the sea and the sea and the sky.")]]
    if arch in VL:
        chats.append([user(make_image(120, 90, 1), "Describe the image."),
                      {"role": "assistant", "content": "Noise."}, user(make_image(33, 77, 2), "And this?")])
    return chats


def sampling() -> list[SamplingParams]:
    return [SamplingParams(temperature=0.0, max_tokens=8, logprobs=3),
            SamplingParams(temperature=0.8, top_p=0.9, top_k=20, seed=7, max_tokens=8, repetition_penalty=1.2,
                           presence_penalty=0.3)]


def run_guarded(monkeypatch: pytest.MonkeyPatch, model_dir: Any, arch: str, lora: Any = None,
                **options: Any) -> GuardedLaunches:
    guarded = GuardedLaunches(monkeypatch)
    llm = LLM(str(model_dir), dtype="float32", device="cpu", **AS_ON_CUDA, **options)
    chats = conversations(arch)
    jobs = [(chat, params) for chat in chats for params in sampling()]
    outs = llm.chat([c for c, _ in jobs], [p for _, p in jobs], use_tqdm=False, lora_request=lora)
    assert all(o.error is None and o.token_ids for o in outs), [o.error for o in outs]
    assert guarded.launches > len(jobs)  # prefill and decode steps ran under the guard
    return guarded


@pytest.mark.parametrize("arch", ARCHS)
def test_no_sync_in_launch(request, monkeypatch, arch):
    """Prefill (with images) and decode, async scheduling: the launch never waits for the device."""
    guarded = run_guarded(monkeypatch, request.getfixturevalue(f"{arch}_dir"), arch, async_scheduling=True)
    assert not guarded.syncs, f"{arch}: syncs inside launch:\n{guarded.report()}"


@pytest.mark.parametrize("arch", ARCHS)
def test_no_sync_in_launch_speculative(request, monkeypatch, arch):
    """n-gram drafts verified in the launch: acceptance settles on the device."""
    guarded = run_guarded(monkeypatch, request.getfixturevalue(f"{arch}_dir"), arch, speculative_config=NGRAM)
    assert not guarded.syncs, f"{arch}: syncs inside launch:\n{guarded.report()}"


@pytest.mark.parametrize("arch", HYBRID)
def test_no_sync_in_launch_mtp(request, monkeypatch, tmp_path, arch):
    """The MTP layer drafts on the device inside the launch (async scheduling)."""
    from testing.tiny_mtp import add_mtp_layer

    model_dir = add_mtp_layer(shutil.copytree(request.getfixturevalue(f"{arch}_dir"), tmp_path / "model"))
    guarded = run_guarded(monkeypatch, model_dir, arch, speculative_config=MTP, async_scheduling=True)
    assert not guarded.syncs, f"{arch}: syncs inside launch:\n{guarded.report()}"


@pytest.mark.parametrize("arch", ARCHS)
def test_no_sync_in_launch_lora(request, monkeypatch, tmp_path, arch):
    """A PEFT adapter on every text linear (and the experts of MoE models: `ExpertsLoRA.add_grouped`, the
    update grouped on the device like the experts' rows) in a slot."""
    from testing.lora_adapters import EXPERT_PARAMETERS, TEXT_LINEARS, build_peft_adapter

    model_dir = request.getfixturevalue(f"{arch}_dir")
    adapter = build_peft_adapter(model_dir, tmp_path / "adapter", target_modules=TEXT_LINEARS,
                                 target_parameters=EXPERT_PARAMETERS if arch in MOE else None, r=4, seed=1)
    guarded = run_guarded(monkeypatch, model_dir, arch, lora=LoRARequest("all", 1, str(adapter)),
                          enable_lora=True, max_loras=1, max_lora_rank=8)  # PEFT: rank 2r on some fused gate_up_proj
    assert not guarded.syncs, f"{arch}: syncs inside launch:\n{guarded.report()}"


def strict_launches(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Every `ModelRunner.launch` under `torch.cuda.set_sync_debug_mode("error")` (a synchronizing CUDA call
    raises); returns the list each launch appends its chunk count to."""
    launch = ModelRunner.launch
    launches: list[int] = []

    def strict(runner: ModelRunner, chunks: list) -> Any:
        torch.cuda.set_sync_debug_mode("error")
        try:
            return launch(runner, chunks)
        finally:
            torch.cuda.set_sync_debug_mode("default")
            launches.append(len(chunks))

    monkeypatch.setattr(ModelRunner, "launch", strict)
    return launches


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ARCHS)
def test_no_sync_on_cuda(request, monkeypatch, arch):
    """On CUDA (bfloat16, the default backends): every launch under `torch.cuda.set_sync_debug_mode("error")`,
    which raises on a synchronizing CUDA call."""
    launches = strict_launches(monkeypatch)
    llm = LLM(str(request.getfixturevalue(f"{arch}_dir")), dtype="bfloat16", device="cuda")
    chats = conversations(arch)
    outs = llm.chat([c for c in chats for _ in sampling()], sampling() * len(chats), use_tqdm=False)
    assert all(o.error is None and o.token_ids for o in outs), [o.error for o in outs]
    assert len(launches) > len(outs)


def test_the_guard_rule():
    """What the guard counts as device-resident and as a sync, on plain tensors."""
    state = torch.arange(6.0)  # made before: runner state, on the device
    chunk = {"positions": torch.arange(4)}  # came in through the chunks: host metadata
    device = torch.device("cpu")
    cases = {
        "host reads of host data": (lambda: (chunk["positions"].tolist(), torch.tensor([1, 2]).sum().item()), 0),
        "read of state": (lambda: state.sum().item(), 1),
        "bool of a value computed from state": (lambda: bool((state > 2).any()), 1),
        "non-blocking upload": (lambda: torch.tensor([1, 2]).to(device, non_blocking=True), 0),
        "blocking upload": (lambda: torch.tensor([1, 2]).to(device), 1),
        "factory on the device, then read": (lambda: torch.zeros(2, device=device).tolist(), 1),
        "boolean mask of state": (lambda: state[state > 2], 1),
        "host index into state": (lambda: state[torch.tensor([0, 1])], 1),
        "uploaded index into state": (lambda: state[torch.tensor([0, 1]).to(device, non_blocking=True)], 0),
        "copy to host, blocking": (lambda: torch.empty(6).copy_(state), 1),
        "state down, non-blocking": (lambda: state.to("cpu", non_blocking=True), 0),
        "bincount of state": (lambda: torch.bincount(state.long()), 1),
    }
    for name, (fn, expected) in cases.items():
        guard = LaunchSyncGuard(chunk, raise_on_sync=False)
        with guard:
            fn()
        assert len(guard.syncs) == expected, f"{name}: {guard.syncs}"


@pytest.mark.gpu
@pytest.mark.skipif(importlib.util.find_spec("flashinfer") is None, reason="flashinfer not installed")
def test_moe_decode_captured_on_cuda(monkeypatch, tmp_path):
    """MoE decode is captured in CUDA graphs like dense decode (bfloat16 on sm90 / sm100: torch's grouped GEMM,
    no host read), in Qwen3.5-35B-A3B's shapes (head_dim 256: a FlashInfer module the kernel wheel has; the
    tiny checkpoints' head dims are not built ahead); the captured steps launch with no sync and start with
    eager decode's tokens."""
    from tests.real_shapes import build_real_shape_checkpoint

    model_dir = build_real_shape_checkpoint("qwen3_5_35b_a3b", tmp_path / "moe")
    llm = LLM(str(model_dir), dtype="bfloat16", device="cuda", attention_backend="flashinfer")
    assert llm.engine.executor.bucketed_steps.graphs, "MoE decode graphs were captured"
    eager = LLM(str(model_dir), dtype="bfloat16", device="cuda", attention_backend="flashinfer", enforce_eager=True)
    assert eager.engine.executor.bucketed_steps is None
    prompts = [f"Tell me about the sea, number {i}." for i in range(5)]  # 5 sequences: bucket 8
    greedy = SamplingParams(temperature=0.0, max_tokens=8)
    launches = strict_launches(monkeypatch)
    for graphed, plain in zip(llm.generate(prompts, greedy, use_tqdm=False), eager.generate(prompts, greedy, use_tqdm=False)):
        assert graphed.error is None and graphed.token_ids[:1] == plain.token_ids[:1]
    assert len(launches) > len(prompts)
