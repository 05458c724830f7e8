"""Video input end to end, against HF transformers reading the same files (float32, CPU).

The reference is the model cards' way: a message {"type": "video", "path": FILE} through the HF
processor's `apply_chat_template(..., tokenize=True, return_dict=True)` and `generate`. Videos are
moving shapes written by the tests with torchcodec (several lengths, frame rates and sizes, odd
frame counts). Checked: pixel_values and grids, prompt ids (Qwen3-VL / Qwen3.5 timestamps
included), greedy tokens, logprobs within 1e-4; mixed image + video, batched, chunked (a video
straddling chunks) and prefix-cached runs; per-item options against the processor's kwargs; bad
files fail their request alone.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from vlmrun.processors import InputError, Processor, ProcessorLimits
from vlmrun.processors.video_io import video_decoder
from testing.hf_reference import HFReference
from testing.videos import moving_shapes, write_video
from tests.test_engine_parity import MAX_NEW, assert_matches, make_image, params
from vlmrun import LLM, SamplingParams

pytestmark = pytest.mark.skipif(video_decoder() != "torchcodec",
                                reason="needs torchcodec with the system FFmpeg libraries (apt-get install ffmpeg)")

ARCHS = ["qwen2_5_vl", "qwen3_vl", "qwen3_5"]
# (frames, height, width, fps): odd counts, fps whose Qwen2.5-VL time step is not a whole number
VIDEOS = {"a": (9, 48, 64, 3.0), "b": (14, 72, 40, 8.0), "c": (5, 30, 90, 5.0)}


@pytest.fixture(scope="session")
def video_files(tmp_path_factory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("videos")
    return {name: write_video(out / f"{name}.mp4", n, h, w, fps, seed=k)
            for k, (name, (n, h, w, fps)) in enumerate(VIDEOS.items())}


def video(path: Path, **options) -> dict:
    return {"type": "video", "path": str(path), **options}


def chat(*items) -> list[dict]:
    content = [it if isinstance(it, dict) else
               {"type": "text", "text": it} if isinstance(it, str) else {"type": "image", "image": it}
               for it in items]
    return [{"role": "user", "content": content}]


def cases(files: dict[str, Path]) -> dict[str, list[dict]]:
    return {
        "a": chat(video(files["a"]), "What happens in the video?"),
        "b": chat(video(files["b"]), "Describe it."),
        "mixed": chat(make_image(60, 44, 3), video(files["c"]), "Compare the picture and the clip."),
        "two": chat("First:", video(files["c"]), "then:", video(files["a"]), "Which moves faster?"),
    }


_SETUPS: dict[str, tuple] = {}


@pytest.fixture(scope="module", params=ARCHS)
def arch_setup(request, video_files):
    arch = request.param
    if arch not in _SETUPS:
        model_dir = request.getfixturevalue(f"{arch}_dir")
        hf = HFReference(model_dir)
        msgs = cases(video_files)
        _SETUPS[arch] = (model_dir, msgs, {name: hf.generate(m, MAX_NEW) for name, m in msgs.items()})
    return _SETUPS[arch]


def test_each_video_case_alone(arch_setup):
    model_dir, msgs, expected = arch_setup
    llm = LLM(str(model_dir), dtype="float32", device="cpu")
    for name, m in msgs.items():
        assert_matches(llm.chat(m, params(), use_tqdm=False)[0], expected[name], name)


def test_batched_chunked_and_prefix_cached_equal_single_runs(arch_setup):
    model_dir, msgs, expected = arch_setup
    # 7-token chunks cut every video span; page 4 lets the second pass hit the prefix cache
    llm = LLM(str(model_dir), dtype="float32", device="cpu", max_num_batched_tokens=7, page_size=4)
    names = list(msgs)
    for _ in range(2):
        for name, out in zip(names, llm.chat([msgs[n] for n in names], params(), use_tqdm=False)):
            assert_matches(out, expected[name], name)
    prompt = llm.engine.process(msgs["a"])
    assert any(it.offset % 7 + it.length > 7 for it in prompt.mm_items), "a video span must straddle a chunk"
    assert llm.engine.stats().prefix_hit_tokens > 0


# --------------------------------------------------------------------------------------------
# preprocessing against HF's processor (cheap: no generation)


@pytest.mark.parametrize("arch", ["qwen2_5_vl", "qwen3_vl"])
@pytest.mark.parametrize("options,hf_kwargs", [
    ({}, {}),
    ({"fps": 4.0}, {"fps": 4.0}),
    ({"nframes": 6}, {"num_frames": 6, "fps": None}),
    ({"min_pixels": 20_000, "max_pixels": 60_000}, {"size": {"shortest_edge": 20_000, "longest_edge": 60_000}}),
])
def test_pixels_and_prompt_ids_equal_hf(request, video_files, arch, options, hf_kwargs):
    model_dir = request.getfixturevalue(f"{arch}_dir")
    ours = Processor.from_pretrained(model_dir)
    hf = HFReference.processor_only(model_dir)
    for name in VIDEOS:
        msgs = chat(video(video_files[name], **options), "Hi")
        try:
            want = hf.apply_chat_template(msgs, tokenize=True, return_dict=True, add_generation_prompt=True,
                                          return_tensors="pt", processor_kwargs=hf_kwargs)
        except ValueError:  # e.g. more frames asked for than the video has: ours refuses it too
            with pytest.raises(InputError):
                ours.process_chat(msgs)
            continue
        got = ours.process_chat(msgs)
        assert got.token_ids == want["input_ids"][0].tolist(), name
        assert torch.equal(torch.cat([it.pixel_values for it in got.mm_items]), want["pixel_values_videos"]), name
        t, h, w = want["video_grid_thw"][0].tolist()
        assert sum(it.grid_thw[0] for it in got.mm_items) == t and got.mm_items[0].grid_thw[1:] == (h, w)
        if "second_per_grid_ts" in want:
            assert got.mm_items[0].second_per_grid_t == pytest.approx(want["second_per_grid_ts"][0].item())


def test_frames_as_array_and_list(qwen2_5_vl_dir, tmp_path):
    proc = Processor.from_pretrained(qwen2_5_vl_dir)
    frames = moving_shapes(6, 40, 52).permute(0, 2, 3, 1).numpy()  # [T, H, W, 3]
    from_array = proc.process_prompt("Hi", videos=[frames])
    from_list = proc.process_prompt("Hi", videos=[{"video": [f for f in frames]}])
    assert from_array.token_ids == from_list.token_ids
    assert torch.equal(from_array.mm_items[0].pixel_values, from_list.mm_items[0].pixel_values)
    assert from_array.mm_items[0].grid_thw[0] == 3


def test_video_options_change_the_sampling(qwen3_vl_dir, video_files):
    proc = Processor.from_pretrained(qwen3_vl_dir)
    base = proc.process_chat(chat(video(video_files["b"]), "Hi"))
    dense = proc.process_chat(chat(video(video_files["b"], fps=8.0), "Hi"))
    cut = proc.process_chat(chat(video(video_files["b"], fps=8.0, video_start=0.5, video_end=1.2), "Hi"))
    assert len(dense.mm_items) > len(base.mm_items) > 0
    assert len(cut.mm_items) < len(dense.mm_items)
    assert "<0.4 seconds>" not in cut.text  # frames before video_start are not sampled
    larger = proc.process_chat(chat(video(video_files["b"], min_pixels=4 * 32 * 32 * 16), "Hi"))
    assert larger.mm_items[0].length > base.mm_items[0].length


def _without_video_config(model_dir: Path, out: Path, image_class: str, processor_class: str | None) -> Path:
    """The checkpoint as some Qwen3-VL / Qwen3.5 repos ship it: `preprocessor_config.json` (naming
    `image_class`, with `processor_class` when given) and no video processor config."""
    shutil.copytree(model_dir, out)
    (out / "video_preprocessor_config.json").unlink()
    config = json.loads((out / "preprocessor_config.json").read_text())
    config["image_processor_type"] = image_class
    if processor_class:
        config["processor_class"] = processor_class
    (out / "preprocessor_config.json").write_text(json.dumps(config))
    return out


@pytest.mark.parametrize("arch", ["qwen3_vl", "qwen3_5"])
@pytest.mark.parametrize("image_class,processor_class,video_class", [
    ("Qwen2VLImageProcessor", "Qwen3VLProcessor", "Qwen2VLVideoProcessor"),
    ("Qwen2VLImageProcessor", None, "Qwen2VLVideoProcessor"),  # the processor class from the model type
    ("Qwen2VLImageProcessorFast", "Qwen3VLProcessor", "Qwen3VLVideoProcessor"),  # no video twin: model type
])
def test_checkpoint_without_video_config_prompts_as_hf(request, video_files, tmp_path, arch, image_class,
                                                       processor_class, video_class):
    """transformers pairs Qwen3VLProcessor's timestamped prompt with the video processor its image
    config's class implies (Qwen2VLVideoProcessor: every frame, per-frame sizing), else the model
    type's: prompt ids, pixels and (Qwen3-VL) greedy tokens equal HF's."""
    model_dir = _without_video_config(request.getfixturevalue(f"{arch}_dir"), tmp_path / arch, image_class,
                                      processor_class)
    hf = HFReference.processor_only(model_dir)
    assert (type(hf).__name__, type(hf.video_processor).__name__) == ("Qwen3VLProcessor", video_class)
    ours = Processor.from_pretrained(model_dir)
    for name in VIDEOS:
        msgs = chat(video(video_files[name]), "Hi")
        want = hf.apply_chat_template(msgs, tokenize=True, return_dict=True, add_generation_prompt=True,
                                      return_tensors="pt")
        got = ours.process_chat(msgs)
        assert got.token_ids == want["input_ids"][0].tolist(), name
        assert "seconds>" in got.text, name
        assert torch.equal(torch.cat([it.pixel_values for it in got.mm_items]), want["pixel_values_videos"]), name
    if arch == "qwen3_vl" and video_class == "Qwen2VLVideoProcessor" and processor_class:
        # the model side: groups of qwen2-sized frames through M-RoPE and the vision tower
        msgs = chat(video(video_files["b"]), "Describe it.")
        expected = HFReference(model_dir).generate(msgs, MAX_NEW)
        llm = LLM(str(model_dir), dtype="float32", device="cpu")
        assert_matches(llm.chat(msgs, params(), use_tqdm=False)[0], expected, "no video config")


# --------------------------------------------------------------------------------------------
# bad input: one request fails with a clear message, the others complete


def _bad_files(tmp_path: Path, good: Path) -> dict[str, tuple[object, str]]:
    data = good.read_bytes()
    (tmp_path / "truncated.mp4").write_bytes(data[: len(data) // 3])
    (tmp_path / "text.mp4").write_bytes(b"this is not a video at all\n" * 20)
    (tmp_path / "empty.mp4").write_bytes(b"")
    return {
        "truncated": (str(tmp_path / "truncated.mp4"), "video"),
        "not_a_video": (str(tmp_path / "text.mp4"), "cannot decode the video"),
        "empty_file": (str(tmp_path / "empty.mp4"), "empty"),
        "zero_frames": (np.zeros((0, 32, 32, 3), dtype=np.uint8), "no frames"),
        "missing": (str(tmp_path / "nope.mp4"), "not found"),
    }


def test_bad_videos_fail_alone(qwen3_vl_dir, video_files, tmp_path):
    llm = LLM(str(qwen3_vl_dir), dtype="float32", device="cpu", max_video_frames=6, max_video_frames_decoded=12)
    bad = _bad_files(tmp_path, video_files["b"])
    good = chat(video(video_files["a"]), "Hi")
    too_many_sampled = chat(video(video_files["a"], nframes=8), "Hi")  # 8 > max_video_frames
    too_long = chat(video(video_files["b"]), "Hi")  # 14 frames > max_video_frames_decoded
    requests = [good] + [chat({"type": "video", "video": src}, "Hi") for src, _ in bad.values()]
    requests += [too_many_sampled, too_long, good]
    outs = llm.chat(requests, params(), use_tqdm=False)
    assert outs[0].error is None and outs[-1].error is None and outs[0].token_ids == outs[-1].token_ids
    for out, (name, (_, words)) in zip(outs[1:], bad.items()):
        assert out.error is not None and words in out.error and "video 1" in out.error, (name, out.error)
    assert "more than the limit of 6" in outs[-3].error
    assert "more than the limit of 12" in outs[-2].error


def test_video_token_limit(qwen3_vl_dir, video_files):
    proc = Processor.from_pretrained(qwen3_vl_dir, ProcessorLimits(max_video_tokens=10))
    with pytest.raises(InputError, match="tokens, more than the limit of 10"):
        proc.process_chat(chat(video(video_files["a"]), video(video_files["c"]), "Hi"))


@pytest.mark.parametrize("arch", ["qwen2_5_vl", "qwen3_vl"])
@pytest.mark.parametrize("options", [{"min_pixels": 300_000_000, "max_pixels": 10**10},
                                     {"min_pixels": 10**9, "max_pixels": 10**10},
                                     {"total_pixels": 10**10, "min_pixels": 5 * 10**8, "max_pixels": 10**10},
                                     {"fps": 8.0, "min_pixels": 2 * 10**8, "max_pixels": 10**10}])
def test_sizes_a_request_asks_for_are_refused_before_any_frame_is_decoded(request, video_files, monkeypatch, arch,
                                                                          options):
    """A 9-frame 48x64 clip asked to be upscaled past the video token limit: refused from the container's
    metadata, naming the item and the limit, before a single frame is decoded or a pixel allocated."""
    from vlmrun.processors import video_io

    decoded = []
    monkeypatch.setattr(video_io._TorchcodecVideo, "frames_at", lambda self, indices: decoded.append(indices))
    proc = Processor.from_pretrained(request.getfixturevalue(f"{arch}_dir"))
    with pytest.raises(InputError, match=r"video 1 \(.*a\.mp4'\): .* tokens, more than the limit of 65,536 video "
                                         r"tokens per request"):
        proc.process_chat(chat(video(video_files["a"], **options), "Hi"))
    assert decoded == []


def test_frames_are_decoded_a_few_at_a_time_and_the_second_video_gets_what_is_left(qwen2_5_vl_dir, video_files,
                                                                                     monkeypatch):
    from vlmrun.processors import video_io
    from vlmrun.processors.video_processor import DECODE_BATCH

    batches = []
    real = video_io._TorchcodecVideo.frames_at
    monkeypatch.setattr(video_io._TorchcodecVideo, "frames_at",
                        lambda self, indices: batches.append(len(indices)) or real(self, indices))
    proc = Processor.from_pretrained(qwen2_5_vl_dir)
    one = proc.process_chat(chat(video(video_files["b"]), "Hi"))
    assert sum(batches) == 14 and max(batches) <= DECODE_BATCH  # all 14 frames (qwen2 style), in small batches
    tokens = sum(it.length for it in one.mm_items)
    limited = Processor.from_pretrained(qwen2_5_vl_dir, ProcessorLimits(max_video_tokens=tokens + 5))
    batches.clear()
    with pytest.raises(InputError, match=r"video 2 .* \(5 left after the request's earlier videos\)"):
        limited.process_chat(chat(video(video_files["b"]), video(video_files["b"]), "Hi"))
    assert sum(batches) == 14  # the second video was refused before its first frame


def test_text_only_model_refuses_videos(qwen3_dir, video_files):
    proc = Processor.from_pretrained(qwen3_dir)
    with pytest.raises(InputError, match="does not accept videos"):
        proc.process_chat(chat(video(video_files["a"]), "Hi"))


# --------------------------------------------------------------------------------------------
# the server: video_url under the image URL policy; bad videos are a 400 and the server keeps serving


def test_server_video_url(qwen3_vl_dir, video_files, tmp_path):
    import base64

    import httpx

    from tests.test_server import tiny_engine
    from vlmrun.server.launch import serve_in_thread
    from vlmrun.server.settings import ServerSettings

    clip = video_files["a"]
    (tmp_path / "clip.mp4").write_bytes(clip.read_bytes())
    (tmp_path / "bad.mp4").write_bytes(b"not a video" * 50)
    engine = tiny_engine(qwen3_vl_dir, max_model_len=512)
    srv = serve_in_thread(engine, ServerSettings(served_model_name="m", allowed_local_media_path=str(tmp_path)))
    try:
        def ask(url: str, **options) -> httpx.Response:
            content = [{"type": "video_url", "video_url": {"url": url}, **options}, {"type": "text", "text": "what?"}]
            return httpx.post(srv.base_url + "/v1/chat/completions", timeout=60, json={
                "model": "m", "max_tokens": 3, "temperature": 0, "messages": [{"role": "user", "content": content}]})

        data = "data:video/mp4;base64," + base64.b64encode(clip.read_bytes()).decode()
        by_path, by_data = ask("clip.mp4"), ask(data)
        assert by_path.status_code == 200 and by_data.status_code == 200, (by_path.text, by_data.text)
        assert by_path.json()["choices"][0]["message"] == by_data.json()["choices"][0]["message"]
        offline = LLM(str(qwen3_vl_dir), dtype="float32", device="cpu").chat(
            chat(video(clip), "what?"), params(), use_tqdm=False)[0]
        assert by_path.json()["usage"]["prompt_tokens"] == len(offline.prompt_token_ids)
        for url, words in (("bad.mp4", "cannot decode the video"), ("/etc/hostname", "outside the allowed"),
                           ("http://127.0.0.1:1/x.mp4", "video 1")):
            r = ask(url)
            assert r.status_code == 400 and words in r.json()["error"]["message"], r.text
        assert ask("clip.mp4", nframes=100_000).status_code == 400
        assert ask("clip.mp4").json()["choices"][0]["message"] == by_path.json()["choices"][0]["message"]
    finally:
        srv.stop()
        engine.shutdown()


def test_generate_videos_argument(qwen2_5_vl_dir, video_files):
    import vlmrun

    text = vlmrun.generate(prompt="What happens?", videos=str(video_files["a"]), model=str(qwen2_5_vl_dir),
                           dtype="float32", device="cpu", max_tokens=4)
    llm = LLM(str(qwen2_5_vl_dir), dtype="float32", device="cpu")
    want = llm.chat(chat(video(video_files["a"]), "What happens?"), params(), use_tqdm=False)[0]
    assert text == llm.engine.tokenizer.decode(want.token_ids[:4], skip_special_tokens=True)


# --------------------------------------------------------------------------------------------
# the decoders


def test_pyav_fallback_reads_the_same_frames(video_files, monkeypatch):
    pytest.importorskip("av")
    from vlmrun.processors import video_io

    limits = ProcessorLimits()
    by_torchcodec = video_io.open_video(str(video_files["b"]), limits)
    monkeypatch.setattr(video_io, "video_decoder", lambda: "pyav")
    by_pyav = video_io.open_video(str(video_files["b"]), limits)
    assert by_pyav.info.num_frames == by_torchcodec.info.num_frames
    assert by_pyav.info.fps == pytest.approx(by_torchcodec.info.fps)
    picks = [0, 5, 13]
    a, b = by_torchcodec.frames_at(picks).float(), by_pyav.frames_at(picks).float()
    assert a.shape == b.shape and (a - b).abs().mean() < 2.0  # both FFmpeg; colour conversion may differ slightly


def test_no_decoder_is_a_clear_error(video_files, monkeypatch):
    from vlmrun.processors import video_io

    monkeypatch.setattr(video_io, "video_decoder", lambda: None)
    with pytest.raises(InputError, match="no video decoder is available: install torchcodec"):
        video_io.open_video(str(video_files["a"]), ProcessorLimits())


# --------------------------------------------------------------------------------------------
# vlmrun caption over video files: one record per video


def test_caption_over_video_files(qwen2_5_vl_dir, video_files, tmp_path, capsys):
    import json

    from tests.test_caption_cli import write_images
    from vlmrun.cli import main

    folder = tmp_path / "clips"
    folder.mkdir()
    for name in ("a", "c"):
        (folder / f"{name}.mp4").write_bytes(video_files[name].read_bytes())
    (folder / "broken.mp4").write_bytes(b"no video here" * 10)
    image = write_images(folder, 1, size=(40, 40))[0]
    out = tmp_path / "out.jsonl"
    rc = main(["caption", str(folder), "--out", str(out), "--model", str(qwen2_5_vl_dir), "--prompt", "Describe.",
               "--max-tokens", "3", "--no-progress"])
    assert rc == 1  # the broken file is an error record
    records = {r["image"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert set(records) == {str(folder / n) for n in ("a.mp4", "c.mp4", "broken.mp4")} | {str(image)}
    assert "cannot decode the video" in records[str(folder / "broken.mp4")]["error"]
    assert {k: r["kind"] for k, r in records.items()} == {**{str(folder / f"{n}.mp4"): "video" for n in "acb"[:2]},
                                                           str(folder / "broken.mp4"): "video", str(image): "image"}
    assert "captioned 3/4 inputs (1 image, 3 videos)" in capsys.readouterr().err
    llm = LLM(str(qwen2_5_vl_dir), dtype="float32", device="cpu")
    for name in ("a", "c"):
        want = llm.generate({"prompt": "Describe.", "videos": [str(folder / f"{name}.mp4")]},
                            SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)[0]
        assert records[str(folder / f"{name}.mp4")]["caption"] == want.text


def test_torchcodec_without_ffmpeg_is_no_decoder(monkeypatch):
    """torchcodec imports without the FFmpeg libraries (its `ffmpeg_major_version` is then None): the
    video decoder is then PyAV where it imports, not a torchcodec that fails at the first frame."""
    torchcodec = pytest.importorskip("torchcodec")
    from vlmrun.processors.video_io import video_decoder

    monkeypatch.setattr(torchcodec, "ffmpeg_major_version", None)
    video_decoder.cache_clear()  # it is asked once per process
    try:
        import av  # noqa: F401
        expected = "pyav"
    except ImportError:
        expected = None
    try:
        assert video_decoder() == expected
    finally:
        video_decoder.cache_clear()  # the next caller asks the real torchcodec again
