"""Speculative decoding with the checkpoint's MTP layer (`{"method": "mtp"}`) on the hybrid families.

The tiny Qwen3.5, Qwen3.5-MoE and Qwen3-Next checkpoints get a random MTP layer named as the released
checkpoints name it (`testing.tiny_mtp.add_mtp_layer`). The drafts the engine makes equal those of
the same layer run with transformers' own modules (`MTPReference`), step after step, rejections
included; and the n-gram scenario of tests/test_spec_decode.py (images, chunked prompts, preemption,
prefix hits with GDN snapshots, greedy and seeded rows, n > 1) gives plain decode's tokens with MTP
drafts. (A random MTP layer's drafts are rejected: what happens after accepted drafts is checked on
`MTPStep.remember`, which picks the output a request drafts from next.)
The bundled model's trained layer, whose drafts are accepted in part, runs the snapshot-boundary scenario
of tests/test_spec_decode.py (images, prompts ending on and one past a GDN snapshot point, prefix hits).
"""

from __future__ import annotations

import shutil
import types

import pytest
import torch
from transformers import AutoConfig

from testing.scene_drawing import render_scene
from testing.tiny_models import HYBRID_ARCHS
from testing.tiny_mtp import MTPReference, add_mtp_layer
from tests.test_async_scheduling import (KV_TOKENS, MAX_NUM_SEQS, SNAPSHOTS, assert_pools_empty, assert_same,
                                         engine_options)
from tests.test_spec_decode import VL_ARCHS, run, spec_scenario
from vlmrun import LLM, SamplingParams
from vlmrun.cache.plan import gdn_bytes_per_request, kv_bytes_per_token
from vlmrun.config import CacheShape
from vlmrun.default_model import default_model_path
from vlmrun.executor.mtp_steps import MTPStep
from vlmrun.executor.step_input import ChunkInput
from vlmrun.layers.cpu_kernels import cpu_features
from vlmrun.shape_scenes import DESCRIBE_PROMPT, make_scene
from vlmrun.executor.mtp_drafter import with_mtp_layer

MTP = {"method": "mtp", "num_speculative_tokens": 3}


@pytest.fixture(scope="session")
def mtp_dirs(request, tmp_path_factory) -> dict:
    """arch -> a copy of the tiny hybrid checkpoint with an MTP layer."""
    dirs = {}
    for arch in HYBRID_ARCHS:
        out = tmp_path_factory.mktemp(f"mtp_{arch}") / "model"
        shutil.copytree(request.getfixturevalue(f"{arch}_dir"), out)
        dirs[arch] = add_mtp_layer(out)
    return dirs


def mtp_options(model_dir, **overrides) -> dict:
    """tests/test_async_scheduling.py's small pools, the KV budget counted with the MTP layer's KV."""
    shape = with_mtp_layer(CacheShape.from_hf_config(AutoConfig.from_pretrained(str(model_dir))))
    per_request = gdn_bytes_per_request(shape, torch.float32, torch.float32)
    budget = (KV_TOKENS + 15) * kv_bytes_per_token(shape, torch.float32) + (MAX_NUM_SEQS + 1 + SNAPSHOTS) * per_request
    return engine_options(model_dir, **{"kv_cache_memory_bytes": budget, **overrides})


def generate(model_dir, prompts: list, params: list, speculative_config, **overrides) -> tuple[list, object]:
    return run(model_dir, prompts, params, speculative_config, **mtp_options(model_dir, **overrides))


@pytest.mark.parametrize("arch", HYBRID_ARCHS)
def test_mtp_speculation_equals_plain_decode(arch, mtp_dirs):
    model_dir = mtp_dirs[arch]
    prompts, params = spec_scenario(arch in VL_ARCHS)
    plain, _ = generate(model_dir, prompts, params, None)
    spec, stats = generate(model_dir, prompts, params, MTP)
    assert_same(plain, spec)
    drafted = [out.metrics.spec_decode for out in spec]
    assert sum(s.num_draft_tokens for s in drafted) > 3 * len(prompts)
    assert stats.num_preemptions > 0 and stats.prefix_hit_tokens > 0
    penalised = params.index(next(p for p in params if p.reads_output_tokens))
    assert drafted[penalised].num_drafts == 0  # its penalties would read drafts made on the device


def test_mtp_with_the_padded_decode_path(mtp_dirs):
    """Plain decode steps run padded (enforce_eager=False); the MTP layer catches up over their real rows."""
    model_dir = mtp_dirs["qwen3_next"]
    prompts, params = spec_scenario(False)
    plain, _ = generate(model_dir, prompts, params, None, enforce_eager=False)
    spec, _ = generate(model_dir, prompts, params, MTP, enforce_eager=False)
    assert_same(plain, spec)


@pytest.mark.parametrize("arch", HYBRID_ARCHS)
def test_mtp_drafts_equal_the_layer_run_by_transformers(arch, mtp_dirs):
    """Every verify step's drafts, for two requests decoding side by side, equal the drafts transformers'
    modules make after the same tokens (the MTP KV of rejected positions left no trace)."""
    model_dir = mtp_dirs[arch]
    llm = LLM(str(model_dir), **mtp_options(model_dir, speculative_config=MTP))
    drafter = llm.engine.executor.drafter
    made: list[tuple[int, int, list[int]]] = []  # (row, first fed token, drafts) per speculating chunk
    draft = drafter.draft

    def recording_draft(chunks, backend, device):
        drafts = draft(chunks, backend, device)
        made.extend((c.row, c.start, d[:c.num_drafts]) for c, d in zip(chunks, drafts.tolist()))
        return drafts

    drafter.draft = recording_draft
    prompts = ["one two three four one two three four", "Tell me a story about the sea."]
    outputs = llm.generate(prompts, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True), use_tqdm=False)
    assert_pools_empty(llm.engine)
    reference = MTPReference(model_dir)
    sequences = [o.prompt_token_ids + o.token_ids for o in outputs]
    assert len(made) >= 2 * 6
    for row, start, drafts in made:  # (each chunk's request: whichever of the two its drafts match)
        expected = [reference.drafts(seq[:start + 1], len(drafts)) for seq in sequences if start + 1 < len(seq)]
        assert drafts in expected, (row, start, drafts, expected)


def test_mtp_layer_packed_by_the_models_rule(mtp_dirs):
    """linear_backend="onednn" packs the MTP layer's linears as it packs the model's; the packed layer
    drafts what the unpacked one drafts, and the tokens stay plain decode's."""
    missing = cpu_features().cannot_pack(torch.float32)
    if missing:
        pytest.skip(missing)
    model_dir = mtp_dirs["qwen3_5"]
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    seen = {}
    for backend in ("torch", "onednn"):
        llm = LLM(str(model_dir), **mtp_options(model_dir, speculative_config=MTP, linear_backend=backend))
        drafter = llm.engine.executor.drafter
        assert drafter.mtp.fc.weight.is_mkldnn == (backend == "onednn")
        made: list[torch.Tensor] = []  # each verify step's drafts
        draft = drafter.draft

        def recording_draft(*args, draft=draft, made=made):
            made.append(draft(*args))
            return made[-1]

        drafter.draft = recording_draft
        outputs = llm.generate(["one two three four one two three four"], params, use_tqdm=False)
        seen[backend] = ([o.token_ids for o in outputs], [d.tolist() for d in made])
        llm.engine.shutdown()
    assert seen["onednn"] == seen["torch"] and len(seen["torch"][1]) >= 3


@pytest.mark.parametrize("mode", [{}, {"enforce_eager": False}, {"async_scheduling": True}])
def test_trained_mtp_drafts_partly_rejected_after_a_snapshot_boundary(mode):
    """The bundled model's trained MTP layer (drafts accepted and rejected, not only rejected as a random
    layer's are) on requests with an image whose prompts end on a GDN snapshot point and one token past
    it; each runs twice, the second from the first's snapshot and MTP KV (a prefix hit). Every answer
    equals plain decode's, with its logprobs; eagerly, padded (as on CUDA) and with async scheduling."""
    model_dir = default_model_path()
    scenes = [render_scene(make_scene(11, i)) for i in range(2)]
    options = dict(prefix_snapshot_interval=16, max_num_batched_tokens=64, **mode)
    llm = LLM(str(model_dir), **mtp_options(model_dir, **options))
    candidates = [[{"prompt": DESCRIBE_PROMPT + " " + "." * n, "images": [scene]} for n in range(16)]
                  for scene in scenes]  # per scene, prompts of 16 successive lengths
    prompts = [next(p for p in candidates[r] if len(llm.engine.process(p).token_ids) % 16 == r) for r in (0, 1)]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, logprobs=2)
    plain = [llm.generate([p], params, use_tqdm=False)[0] for p in prompts for _ in range(2)]
    llm.engine.shutdown()

    llm = LLM(str(model_dir), **mtp_options(model_dir, speculative_config=MTP, **options))
    spec = [llm.generate([p], params, use_tqdm=False)[0] for p in prompts for _ in range(2)]
    hits = llm.engine.stats().prefix_hit_tokens
    assert hits == len(plain[2].prompt_token_ids) - 1  # the second prompt's full pages, from their snapshot
    assert_pools_empty(llm.engine)
    assert_same(plain, spec)
    for out in spec:
        stats = out.metrics.spec_decode
        assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens, stats


def test_remember_picks_the_last_kept_position():
    """After a step, each sampling row drafts next from the MTP output at its last kept position: a
    prefill chunk's last token, a decode's token, a verify chunk's last known token plus its accepted drafts."""

    class Recorder:
        def remember(self, rows, outputs):
            self.rows, self.outputs = rows.tolist(), outputs[:, 0].tolist()

    def chunk(row: int, n: int, drafts: int, samples: bool) -> ChunkInput:
        return ChunkInput(row=row, start=10, token_ids=[1] * n, positions=torch.zeros(3, n, dtype=torch.int64),
                          kv_slots=torch.zeros(n, dtype=torch.int64), mm_items=(),
                          sampling=object() if samples else None, num_drafts=drafts)

    chunks = [chunk(5, 4, 0, False), chunk(1, 6, 0, True), chunk(2, 1, 0, True), chunk(3, 4, 3, True),
              chunk(4, 3, 2, True)]
    recorder = Recorder()
    step = MTPStep(recorder, chunks, backend=None, device=torch.device("cpu"))
    step.outputs = torch.arange(18, dtype=torch.float32)[:, None].expand(18, 4)  # row i holds i
    step.remember([0, 0, 0, 2, 2])
    # stream rows: chunk 0 0-3 (no sample), 1 4-9, 2 10, 3 11-14 (2 of 3 drafts kept), 4 15-17 (both kept)
    assert recorder.rows == [1, 2, 3, 4] and recorder.outputs == [9.0, 10.0, 13.0, 17.0]


def test_refused_without_an_mtp_layer(qwen3_5_dir, qwen3_dir):
    for model_dir in (qwen3_5_dir, qwen3_dir):
        with pytest.raises(ValueError, match="MTP weights"):
            LLM(str(model_dir), **mtp_options(model_dir, speculative_config=MTP))
    with pytest.raises(ValueError, match="prompt_lookup"):
        LLM(str(qwen3_5_dir), speculative_config={**MTP, "prompt_lookup_max": 3})


def drafting_step(device: torch.device) -> tuple[MTPStep, torch.Tensor]:
    """An MTPStep over a plain decode chunk and two speculating chunks whose drafter returns fixed drafts;
    drafted, and its input ids [1 + 1 + 3 + 1 + 2] with the drafts written in."""

    class FixedDrafter:
        def draft(self, chunks, backend, device):
            return torch.tensor([[7, 8, 9], [5, 6, 0]], dtype=torch.int64, device=device)

    def chunk(row: int, drafts: int) -> ChunkInput:
        n = 1 + drafts
        return ChunkInput(row=row, start=4, token_ids=[1] + [-1] * drafts, positions=torch.zeros(3, n, dtype=torch.int64),
                          kv_slots=torch.arange(n, dtype=torch.int64), mm_items=(), sampling=object(), num_drafts=drafts)

    step = MTPStep(FixedDrafter(), [chunk(1, 0), chunk(2, 3), chunk(3, 2)], backend=None, device=device)
    fb = types.SimpleNamespace(input_ids=torch.ones(1 + 4 + 3, dtype=torch.int64, device=device))
    step.draft(fb)
    return step, fb.input_ids


def test_drafts_reach_the_host_once():
    """`drafts_on_host` (read at launch for grammar masks, again at collect) reads the drafts once and keeps them."""
    step, input_ids = drafting_step(torch.device("cpu"))
    assert input_ids.tolist() == [1, 1, 7, 8, 9, 1, 5, 6]
    first = step.drafts_on_host()
    assert first == [[], [7, 8, 9], [5, 6]]
    assert step.drafts_on_host() is first


@pytest.mark.gpu
def test_drafts_copy_to_the_host_when_drafted():
    """On CUDA the copy is queued right after drafting: a later write to the device tensor does not reach it."""
    step, _ = drafting_step(torch.device("cuda"))
    step.drafted.fill_(3)  # queued after the copy
    assert step.drafts_on_host() == [[], [7, 8, 9], [5, 6]]
