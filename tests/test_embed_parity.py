"""Embeddings equal HF transformers' final hidden states pooled the same way (float32, CPU).

For each family (Qwen3-VL, Qwen3.5 hybrid, Qwen2.5-VL, and the MoE Qwen3-VL / Qwen3.5) text, one-image
and two-image chats run through `LLM.embed` together (continuous batching), once in one chunk each and
once chunked at a few tokens per step (chunks of several prompts share steps; image spans are split
across chunks), and are compared
with HF's `model.model(...).last_hidden_state` (after the final norm) pooled as the engine pools it.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AutoConfig

from testing.hf_reference import HFReference
from testing.videos import write_video
from vlmrun import LLM
from vlmrun.cache.plan import kv_bytes_per_token
from vlmrun.config import CacheShape
from vlmrun.pooling import PoolingParams
from vlmrun.processors.video_io import video_decoder

ATOL = 1e-5
FAMILIES = ["qwen3_vl", "qwen3_5", "qwen2_5_vl", "qwen3_vl_moe", "qwen3_5_moe"]


def image(w: int, h: int, seed: int) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 255, size=(h, w, 3), dtype=np.uint8))


def chat(*items) -> list[dict]:
    content = [{"type": "image", "image": it} if isinstance(it, Image.Image) else {"type": "text", "text": it}
               for it in items]
    return [{"role": "user", "content": content}]


CHATS = {
    "text": chat("Tell me about the sea and the sky."),
    "one_image": chat(image(60, 44, 1), "Describe the image."),
    "two_images": chat(image(33, 77, 2), image(90, 30, 3), "Compare these pictures."),
}


def hf_hidden(model_dir, chats: dict[str, list[dict]]) -> dict[str, tuple[list[int], torch.Tensor]]:
    """Per chat: HF's prompt ids and final hidden states [L, hidden] (after the final norm)."""
    hf = HFReference(model_dir)
    out = {}
    with torch.no_grad():
        for name, messages in chats.items():
            inputs = hf.inputs(messages)
            out[name] = (inputs["input_ids"][0].tolist(), hf.model.model(**inputs).last_hidden_state[0])
    return out


def pooled(hidden: torch.Tensor, pooling_type: str) -> torch.Tensor:
    return {"MEAN": hidden.mean(0), "LAST": hidden[-1], "CLS": hidden[0]}[pooling_type]


def check(llm: LLM, reference, pooling_type: str, normalize: bool = False) -> None:
    outs = llm.embed(list(CHATS.values()), PoolingParams(normalize=normalize), use_tqdm=False)
    for name, out in zip(CHATS, outs):
        ids, hidden = reference[name]
        assert out.error is None and out.finished
        assert out.prompt_token_ids == ids, name
        want = pooled(hidden, pooling_type)
        if normalize:
            want = torch.nn.functional.normalize(want, dim=-1)
        got = torch.tensor(out.outputs.embedding)
        assert got.shape == want.shape
        assert torch.allclose(got, want, atol=ATOL, rtol=0), (name, (got - want).abs().max())


@pytest.fixture(scope="module", params=FAMILIES)
def family(request):
    model_dir = request.getfixturevalue(f"{request.param}_dir")
    return model_dir, hf_hidden(model_dir, CHATS)


@pytest.mark.parametrize("max_num_batched_tokens", [8192, 7])
def test_mean_pooling_equals_hf(family, max_num_batched_tokens):
    model_dir, reference = family
    llm = LLM(str(model_dir), runner="pooling", pooler_config={"pooling_type": "MEAN"},
              max_num_batched_tokens=max_num_batched_tokens)
    check(llm, reference, "MEAN")
    if max_num_batched_tokens == 7:  # the chunks really were shared and split
        assert llm.engine.stats().kv_pages_used == 0  # prefill-only: no pages held after the last chunk


@pytest.mark.parametrize("arch,pooling_type", [("qwen3_vl", "LAST"), ("qwen3_vl", "CLS"), ("qwen3_5", "LAST")])
def test_last_and_cls_pooling_equal_hf(request, arch, pooling_type):
    """Hybrid Qwen3.5's prefix hits restore GDN snapshots (prefix_snapshot_interval 16: a few per prompt)."""
    model_dir = request.getfixturevalue(f"{arch}_dir")
    reference = hf_hidden(model_dir, CHATS)
    llm = LLM(str(model_dir), runner="pooling", pooler_config={"pooling_type": pooling_type},
              max_num_batched_tokens=9, prefix_snapshot_interval=16, gdn_prefix_snapshots=16)
    check(llm, reference, pooling_type, normalize=True)
    check(llm, reference, pooling_type, normalize=True)  # again: LAST hits the prefix cache, CLS must not use it
    hits = llm.engine.prefix_cache_stats().hit_tokens
    assert hits > 0 if pooling_type == "LAST" else hits == 0


def test_async_scheduling_pools_right(qwen3_vl_dir):
    """Under async scheduling a pooling request's result comes a step after its last chunk is launched (it
    is not scheduled again meanwhile) and its pages stay held until then."""
    reference = hf_hidden(qwen3_vl_dir, CHATS)
    llm = LLM(str(qwen3_vl_dir), runner="pooling", pooler_config={"pooling_type": "MEAN"},
              max_num_batched_tokens=7, async_scheduling=True)
    check(llm, reference, "MEAN")
    assert llm.engine.stats().kv_pages_used == 0


def test_preempted_request_starts_its_sum_over(qwen3_vl_dir):
    """A pooling request preempted mid-prompt recomputes from position 0: its MEAN sum starts over."""
    reference = hf_hidden(qwen3_vl_dir, {"one_image": CHATS["one_image"]})
    llm = LLM(str(qwen3_vl_dir), runner="pooling", pooler_config={"pooling_type": "MEAN"}, max_num_batched_tokens=7)
    engine = llm.engine
    engine.add_request("a", engine.process(CHATS["one_image"]), PoolingParams(normalize=False))
    engine.step()
    engine.step()  # two chunks (14 tokens) pooled, then preempted as the scheduler does when out of pages
    engine.scheduler._preempt(engine.requests["a"])
    results = []
    while engine.has_unfinished():
        results += [u.result for u in engine.step() if u.finished]
    ids, hidden = reference["one_image"]
    assert engine.stats().num_preemptions == 1 and results[0].prompt_token_ids == ids
    assert torch.allclose(results[0].pooled, hidden.mean(0), atol=ATOL, rtol=0)


def _bytes_for_pages(model_dir, pages: int, page_size: int = 16) -> int:
    """A cache budget of `pages` KV pages (and the dummy page)."""
    shape = CacheShape.from_hf_config(AutoConfig.from_pretrained(str(model_dir)))
    return (pages + 1) * page_size * kv_bytes_per_token(shape, torch.float32)


@pytest.mark.skipif(video_decoder() != "torchcodec", reason="needs torchcodec with the system FFmpeg libraries")
def test_video_chat_pools_as_hf(qwen3_vl_dir, tmp_path):
    """A chat with a video and an image, chunked so that the video's spans are cut, pools HF's hidden states."""
    clip = write_video(tmp_path / "clip.mp4", 9, 48, 64, 3.0)
    chats = {"video": chat(image(40, 30, 5), "and", "the clip:")}
    chats["video"][0]["content"].insert(2, {"type": "video", "path": str(clip)})
    reference = hf_hidden(qwen3_vl_dir, chats)
    llm = LLM(str(qwen3_vl_dir), runner="pooling", pooler_config={"pooling_type": "MEAN"}, max_num_batched_tokens=7)
    out = llm.embed(list(chats.values()), PoolingParams(normalize=False), use_tqdm=False)[0]
    ids, hidden = reference["video"]
    assert out.error is None and out.prompt_token_ids == ids
    assert torch.allclose(torch.tensor(out.outputs.embedding), hidden.mean(0), atol=ATOL, rtol=0)


def test_lora_adapter_pools_as_peft(qwen3_vl_dir, tmp_path):
    """A pooling request with a LoRA adapter: HF + PEFT's hidden states pooled (the base model's differ)."""
    from testing.lora_adapters import build_peft_adapter, peft_reference
    from vlmrun import LoRARequest

    adapter = build_peft_adapter(qwen3_vl_dir, tmp_path / "adapter", target_modules=["q_proj", "v_proj", "down_proj"])
    ref = peft_reference(qwen3_vl_dir, adapter)
    messages = CHATS["one_image"]
    with torch.no_grad():
        inputs = ref.inputs(messages)
        want = ref.model.get_base_model().model(**inputs).last_hidden_state[0].mean(0)
    llm = LLM(str(qwen3_vl_dir), runner="pooling", pooler_config={"pooling_type": "MEAN"}, enable_lora=True,
              max_lora_rank=4, max_num_batched_tokens=7)
    params = PoolingParams(normalize=False)
    lora, base = llm.embed([messages, messages], params, lora_request=[LoRARequest("a", 1, str(adapter)), None],
                           use_tqdm=False)
    assert torch.allclose(torch.tensor(lora.outputs.embedding), want, atol=ATOL, rtol=0)
    assert not torch.allclose(torch.tensor(base.outputs.embedding), want, atol=ATOL, rtol=0)
