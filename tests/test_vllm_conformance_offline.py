"""Issue 50's offline API, driven as a vLLM user's script drives `vllm.LLM`: one test per item.

`LLM(...)` with vLLM's keywords, `Logprob` objects in `logprobs` / `prompt_logprobs`, Qwen3-VL's
`(frames, metadata)` video, `RequestOutput`'s other fields (`num_cached_tokens`, ...),
`reset_prefix_cache`, `get_metrics`, `SamplingParams.clone`, `generate(mm_processor_kwargs=...)`, the
warning for a failed input and `beam_search`. The search's own checks (HF parity, scoring) are in
tests/test_beam_search.py and tests/test_server_beam_search.py.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from transformers import AutoModelForImageTextToText

from testing.hf_reference import HFReference
from tests.test_engine_parity import make_image
from tests.test_vllm_api import llm  # noqa: F401 (fixture)
from vlmrun import LLM, SamplingParams
from vlmrun.beam_search import BeamSearchOutput, BeamSearchParams
from vlmrun.llm_metrics import Counter, Gauge, Histogram, find_metric
from vlmrun.logprobs import Logprob
from vlmrun.processors import InputError, Processor

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
VIDEO_PROMPT = "<|vision_start|><|video_pad|><|vision_end|>Describe the video."
IMAGE_PROMPT = "<|vision_start|><|image_pad|><|vision_end|>Describe."
LONG = "Describe every colour of the sea and the sky at dawn, slowly and in detail. " * 4


def test_llm_takes_vllms_keywords(qwen3_vl_dir, caplog):
    """trust_remote_code and the like are accepted with a log line; a value vlmrun cannot honour is a
    ValueError saying why; an unknown keyword stays a TypeError."""
    path = str(qwen3_vl_dir)
    with caplog.at_level(logging.WARNING, logger="vlmrun.llm_options"):
        llm = LLM(path, trust_remote_code=True, tokenizer=path, tokenizer_mode="auto", seed=None, dtype="float32",
                  device="cpu", gpu_memory_utilization=0.5, max_model_len=1024, enforce_eager=True,
                  limit_mm_per_prompt={"image": 2}, mm_processor_kwargs={"max_pixels": 28 * 28 * 16},
                  disable_log_stats=False, swap_space=0, block_size=16, max_logprobs=20)
    assert "trust_remote_code" in caplog.text and "only its own model code" in caplog.text
    assert llm.engine.config.max_model_len == 1024 and llm.engine.config.seed == 0
    assert llm.generate("Hello", GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    for bad, why in ((dict(tokenizer="/elsewhere"), "checkpoint's processor"), (dict(tokenizer_mode="slow"), "fast"),
                     (dict(cpu_offload_gb=4), "quantization"), (dict(max_logprobs=50), "at most 20")):
        with pytest.raises(ValueError, match=why):
            LLM(path, dtype="float32", device="cpu", **bad)
    with pytest.raises(TypeError):
        LLM(path, dtype="float32", device="cpu", no_such_option=1)


def test_logprobs_are_logprob_objects(llm):
    """outputs[i].logprobs and prompt_logprobs: per position {token id: Logprob(logprob, rank, decoded_token)};
    cumulative_logprob their sum over the sampled tokens."""
    tokenizer = llm.get_tokenizer()
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=3, prompt_logprobs=2)
    out = llm.generate("The sky is", params, use_tqdm=False)[0]
    completion = out.outputs[0]
    assert len(completion.logprobs) == 4
    for token, position in zip(completion.token_ids, completion.logprobs):
        assert len(position) == 3  # greedy: the sampled token is the top one
        assert all(isinstance(lp, Logprob) for lp in position.values())
        assert position[token].rank == 1 and position[token].decoded_token == tokenizer.decode([token])
        assert sorted(lp.rank for lp in position.values()) == [1, 2, 3]
        best = sorted(position.values(), key=lambda lp: -lp.logprob)
        assert [lp.rank for lp in best] == [1, 2, 3]
    chosen = [position[t].logprob for t, position in zip(completion.token_ids, completion.logprobs)]
    assert completion.cumulative_logprob == pytest.approx(sum(chosen))
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(out.prompt_token_ids)
    for token, position in zip(out.prompt_token_ids[1:], out.prompt_logprobs[1:]):
        assert token in position and isinstance(position[token].logprob, float)
        assert sorted(lp.rank for t, lp in position.items() if t != token)[:2] == [1, 2][:len(position) - 1]


def test_rank_is_the_rank_in_the_vocabulary(llm, qwen3_vl_dir):
    """vLLM's rank of the chosen token (sampled or prompt), in the top-k or not: how many tokens are at
    least as likely, here against HF's logits of the prompt."""
    params = SamplingParams(temperature=1.0, seed=7, max_tokens=8, logprobs=1, prompt_logprobs=0)
    out = llm.generate("The sky over the sea is", params, use_tqdm=False)[0]
    hf = AutoModelForImageTextToText.from_pretrained(qwen3_vl_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        ids = out.prompt_token_ids + out.outputs[0].token_ids
        logprobs = torch.log_softmax(hf(input_ids=torch.tensor([ids])).logits[0].float(), dim=-1)
    want = [int((logprobs[i - 1] >= logprobs[i - 1, t]).sum()) for i, t in enumerate(ids) if i > 0]
    prompt = [position[t].rank for t, position in zip(out.prompt_token_ids[1:], out.prompt_logprobs[1:])]
    sampled = [position[t].rank for t, position in zip(out.outputs[0].token_ids, out.outputs[0].logprobs)]
    assert prompt + sampled == want
    assert max(sampled) > 1  # a sampled token outside the top 1, ranked in the vocabulary


def test_qwen3_vl_video_frames_with_metadata(llm):
    """vLLM's form: frames sampled already plus their metadata; the timestamps come from the metadata."""
    frames = np.random.default_rng(0).integers(0, 255, (4, 64, 64, 3), dtype=np.uint8)
    meta = {"fps": 30.0, "frames_indices": [0, 30, 60, 90], "total_num_frames": 120, "duration": 4.0,
            "video_backend": "opencv"}
    tagged, listed, as_2fps, bare = llm.generate([
        {"prompt": VIDEO_PROMPT, "multi_modal_data": {"video": (frames, meta)}},
        {"prompt": VIDEO_PROMPT, "multi_modal_data": {"video": [(frames, meta)]}},
        {"prompt": VIDEO_PROMPT, "multi_modal_data": {"video": (frames, {"fps": 2.0})}},
        {"prompt": VIDEO_PROMPT, "multi_modal_data": {"video": frames}}], GREEDY, use_tqdm=False)
    assert tagged.error is None and tagged.outputs[0].token_ids == listed.outputs[0].token_ids
    text = llm.get_tokenizer().decode(tagged.prompt_token_ids)
    assert "<0.5 seconds>" in text and "<2.5 seconds>" in text  # frames 0, 30 | 60, 90 at 30 fps
    assert as_2fps.prompt_token_ids == bare.prompt_token_ids  # metadata saying what the defaults say
    bad = llm.generate({"prompt": VIDEO_PROMPT, "multi_modal_data": {"video": (frames, {"frames_indices": [0]})}},
                       GREEDY, use_tqdm=False)[0]
    assert bad.outputs == [] and "frames_indices" in bad.error


def test_frames_with_metadata_equal_hf_processor(qwen3_vl_dir):
    """Token ids (timestamps included) and pixels equal HF's Qwen3-VL processor given the same frames and
    `video_metadata` with do_sample_frames=False (what vLLM hands it)."""
    hf = HFReference.processor_only(qwen3_vl_dir)
    ours = Processor.from_pretrained(qwen3_vl_dir)
    frames = np.random.default_rng(0).integers(0, 255, (5, 64, 96, 3), dtype=np.uint8)
    meta = {"fps": 24.0, "frames_indices": [0, 12, 30, 48, 70], "total_num_frames": 80}
    text = "<|vision_start|><|video_pad|><|vision_end|>Describe."
    want = hf(text=[text], videos=[torch.from_numpy(frames).permute(0, 3, 1, 2)], video_metadata=[meta],
              do_sample_frames=False, return_tensors="pt")
    got = ours.process_raw(text, videos=[(frames, meta)])
    assert got.token_ids == want["input_ids"][0].tolist()
    assert torch.equal(torch.cat([it.pixel_values for it in got.mm_items]), want["pixel_values_videos"])
    # qwen-vl-utils' frames: [T, 3, H, W] floats, with vLLM's mm_processor_kwargs {"do_sample_frames": False}
    as_utils = torch.from_numpy(frames).permute(0, 3, 1, 2).float()
    again = ours.process_raw(text, videos=[(as_utils, meta)], mm_processor_kwargs={"do_sample_frames": False})
    assert again.token_ids == got.token_ids
    with pytest.raises(InputError, match="do_sample_frames"):
        ours.process_raw(text, videos=[(frames, meta)], mm_processor_kwargs={"do_sample_frames": True})


def test_request_output_fields(llm):
    """num_cached_tokens counts the prefix-cache hit; vLLM's other fields are there."""
    first, again = (llm.generate(LONG, GREEDY, use_tqdm=False)[0] for _ in range(2))
    assert first.num_cached_tokens == 0 and again.num_cached_tokens > 0
    assert again.num_cached_tokens % llm.engine.caches.plan.page_size == 0
    assert (again.encoder_prompt, again.encoder_prompt_token_ids, again.lora_request,
            again.kv_transfer_params) == (None, None, None, None)
    assert again.outputs[0].finished() and again.metrics.finished_time >= again.metrics.arrival_time


def test_reset_prefix_cache(llm):
    llm.generate(LONG + "!", GREEDY, use_tqdm=False)
    assert llm.reset_prefix_cache() is True
    assert llm.generate(LONG + "!", GREEDY, use_tqdm=False)[0].num_cached_tokens == 0
    assert llm.generate(LONG + "!", GREEDY, use_tqdm=False)[0].num_cached_tokens > 0


def test_get_metrics(llm):
    """vLLM's metric objects: the vllm:* series a dashboard reads, counting this LLM's requests."""
    before = llm.get_metrics()
    out = llm.generate(["One", "Two"], GREEDY, use_tqdm=False)
    after = llm.get_metrics()

    def value(metrics, name, **labels):
        return find_metric(metrics, name, labels).value

    assert value(after, "vllm:generation_tokens") - value(before, "vllm:generation_tokens") == 12
    prompt = sum(len(o.prompt_token_ids) for o in out)
    assert value(after, "vllm:prompt_tokens") - value(before, "vllm:prompt_tokens") == prompt
    assert value(after, "vllm:request_success", finished_reason="length") - \
        value(before, "vllm:request_success", finished_reason="length") == 2
    assert isinstance(find_metric(after, "vllm:num_requests_running"), Gauge)
    assert isinstance(find_metric(after, "vllm:prefix_cache_queries"), Counter)
    ttft = find_metric(after, "vllm:time_to_first_token_seconds")
    assert isinstance(ttft, Histogram) and ttft.count == ttft.buckets["+Inf"] >= 2
    assert all(m.labels["model_name"] and m.labels["engine"] == "0" for m in after)


def test_sampling_params_clone():
    params = SamplingParams(temperature=0.5, stop=["x"], logit_bias={1: 2.0})
    copy = params.clone()
    copy.stop.append("y")
    copy.logit_bias[3] = 1.0
    assert params.stop == ["x"] and params.logit_bias == {1: 2.0} and copy.temperature == 0.5


def test_generate_takes_mm_processor_kwargs(llm):
    """generate(mm_processor_kwargs=...) sizes every image as chat's does; a prompt's own options win."""
    image = make_image(320, 240, 3)
    small = {"max_pixels": 28 * 28 * 4}
    pad = llm.engine.processor.image_token_id
    plain, sized = (llm.generate({"prompt": IMAGE_PROMPT, "multi_modal_data": {"image": image}}, GREEDY,
                                 use_tqdm=False, mm_processor_kwargs=kwargs)[0] for kwargs in (None, small))
    by_chat = llm.chat([{"role": "user", "content": [{"type": "image", "image": image}, "Describe."]}], GREEDY,
                       use_tqdm=False, mm_processor_kwargs=small)[0]
    assert sized.prompt_token_ids.count(pad) == by_chat.prompt_token_ids.count(pad) < plain.prompt_token_ids.count(pad)
    own = llm.generate({"prompt": IMAGE_PROMPT, "multi_modal_data": {"image": image},
                        "mm_processor_kwargs": {"max_pixels": 28 * 28 * 16}}, GREEDY, use_tqdm=False,
                       mm_processor_kwargs=small)[0]
    assert sized.prompt_token_ids.count(pad) < own.prompt_token_ids.count(pad)
    turn = llm.generate({"prompt": "Describe.", "images": [image]}, GREEDY, use_tqdm=False, mm_processor_kwargs=small)
    assert turn[0].prompt_token_ids.count(pad) == sized.prompt_token_ids.count(pad)
    with pytest.raises(ValueError, match="max_pixels"):
        llm.generate("Hi", GREEDY, use_tqdm=False, mm_processor_kwargs={"max_pixels": -1})


def test_failed_input_is_named_in_one_warning(llm, caplog):
    """vLLM raises; vlmrun keeps the others and says which failed, once per call with a count."""
    bad = {"prompt": "No placeholder.", "multi_modal_data": {"image": make_image(32, 32, 1)}}
    with caplog.at_level(logging.WARNING, logger="vlmrun.api"):
        outs = llm.generate(["Fine", bad, "Fine too", bad], GREEDY, use_tqdm=False)
    assert [o.error is None for o in outs] == [True, False, True, False]
    warnings = [r for r in caplog.records if r.name == "vlmrun.api"]
    assert len(warnings) == 1 and warnings[0].levelno == logging.WARNING
    assert "2 input(s) failed" in caplog.text and "input 1: " in caplog.text and "input 3: " in caplog.text
    caplog.clear()
    llm.generate(["Fine"], GREEDY, use_tqdm=False)
    assert not [r for r in caplog.records if r.name == "vlmrun.api"]


def test_beam_search_as_vllm_scripts_call_it(llm):
    outs = llm.beam_search([{"prompt": "The sea is"}, {"prompt_token_ids": llm.get_tokenizer().encode("A cat")}],
                           BeamSearchParams(beam_width=2, max_tokens=4))
    assert len(outs) == 2 and all(isinstance(o, BeamSearchOutput) for o in outs)
    for out in outs:
        assert len(out.sequences) == 2
        best, second = out.sequences
        assert best.text == llm.get_tokenizer().decode(best.tokens) and isinstance(best.cum_logprob, float)
        score = [s.cum_logprob / len(s.tokens) for s in out.sequences]  # no EOS here: length is the token count
        assert score[0] >= score[1]
