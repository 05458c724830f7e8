"""Issue 45, offline: `LLM.generate` / `LLM.chat` refuse a video whose tokens can never fit the model's
context from its container's metadata, before a frame is decoded, and that input fails alone."""

from __future__ import annotations

import pytest

from vlmrun import LLM, SamplingParams
from vlmrun.processors import ProcessorLimits
from vlmrun.processors.video_io import video_decoder

pytestmark = pytest.mark.skipif(video_decoder() != "torchcodec",
                                reason="needs torchcodec with the system FFmpeg libraries (apt-get install ffmpeg)")


def test_the_budget_is_the_smaller_of_the_video_limit_and_the_context():
    assert ProcessorLimits(max_video_tokens=100).video_token_budget == 100
    assert ProcessorLimits(max_video_tokens=100, max_prompt_tokens=40).video_token_budget == 40
    assert ProcessorLimits(max_video_tokens=100, max_prompt_tokens=400).video_token_budget == 100


def test_a_video_past_the_context_fails_alone_before_any_frame_is_decoded(qwen2_5_vl_dir, tmp_path, monkeypatch):
    from testing.videos import write_video
    from vlmrun.processors import video_io

    llm = LLM(str(qwen2_5_vl_dir), dtype="float32", device="cpu", max_model_len=256)
    path = write_video(tmp_path / "clip.mp4", 40, 320, 320, 10.0, seed=1)
    decoded = []
    monkeypatch.setattr(video_io._TorchcodecVideo, "frames_at", lambda self, indices: decoded.append(indices))
    # 32 frames at full size: far within the video limit (65,536 tokens), far past the context (256)
    too_long = [{"role": "user", "content": [
        {"type": "video", "path": str(path), "fps": 8.0, "max_pixels": 10**7}, {"type": "text", "text": "What?"}]}]
    fine = [{"role": "user", "content": [{"type": "text", "text": "Hello"}]}]
    bad, good = llm.chat([too_long, fine], SamplingParams(max_tokens=3), use_tqdm=False)
    assert decoded == [], "frames were decoded for a video that can never fit the context"
    assert bad.error is not None and "video" in bad.error and "context" in bad.error
    assert good.error is None and len(good.token_ids) == 3
