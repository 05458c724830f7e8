"""Engine behaviour beyond parity: bad inputs fail alone, clear load errors, stops, seeds, n."""

from __future__ import annotations

import io
import json
import shutil

import pytest
from PIL import Image

from tests.test_engine_parity import make_image
from vlmrun import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(qwen3_vl_dir):
    return LLM(str(qwen3_vl_dir), dtype="float32", device="cpu", max_image_pixels=4_000_000)


def jpeg_bytes(img: Image.Image) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="JPEG")
    return buf.getvalue()


def test_bad_images_fail_alone_and_engine_keeps_serving(llm, tmp_path):
    good = make_image(80, 60, 7)
    zero = tmp_path / "zero.jpg"
    zero.write_bytes(b"")
    text_file = tmp_path / "notes.jpg"
    text_file.write_text("this is not an image")
    truncated = tmp_path / "truncated.jpg"
    truncated.write_bytes(jpeg_bytes(make_image(300, 200, 8))[:500])
    bomb = Image.new("RGB", (3000, 2000))  # 6e6 pixels > max_image_pixels=4e6
    bomb_path = tmp_path / "bomb.png"
    bomb.save(bomb_path)
    params = SamplingParams(temperature=0, max_tokens=4)
    prompts = [
        {"prompt": "Describe.", "images": [good]},
        {"prompt": "Describe.", "images": [b"\x00\x01garbage"]},
        {"prompt": "Describe.", "images": [str(zero)]},
        {"prompt": "Describe.", "images": [str(text_file)]},
        {"prompt": "Describe.", "images": [str(truncated)]},
        {"prompt": "Describe.", "images": [str(bomb_path)]},
        {"prompt": "Describe.", "images": [str(tmp_path / "missing.png")]},
        "just text",
    ]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert outs[0].error is None and len(outs[0].token_ids) == 4
    assert outs[-1].error is None and len(outs[-1].token_ids) == 4
    for out in outs[1:-1]:
        assert out.error, "a bad image must give an error"
        assert out.finish_reason == "error" and out.text == ""
    assert "pixel" in outs[5].error.lower()
    again = llm.generate([{"prompt": "Describe.", "images": [good]}], params, use_tqdm=False)[0]
    assert again.token_ids == outs[0].token_ids
    assert llm.engine.caches.allocator.num_free_pages() == llm.engine.caches.allocator.num_usable_pages()


def test_too_many_images_and_too_long_prompt(qwen3_vl_dir):
    small = LLM(str(qwen3_vl_dir), dtype="float32", device="cpu", max_images_per_request=2, max_model_len=64)
    imgs = [make_image(40, 40, i) for i in range(3)]
    outs = small.generate([{"prompt": "x", "images": imgs}, "word " * 200, "fine"],
                          SamplingParams(max_tokens=2), use_tqdm=False)
    assert "image" in outs[0].error.lower()
    assert "token" in outs[1].error.lower()
    assert outs[2].error is None


def test_unknown_architecture_missing_weights_and_shape_mismatch(qwen3_dir, tmp_path):
    unknown = tmp_path / "unknown"
    shutil.copytree(qwen3_dir, unknown)
    cfg = json.loads((unknown / "config.json").read_text())
    cfg["architectures"] = ["FancyNewForCausalLM"]
    (unknown / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="FancyNewForCausalLM"):
        LLM(str(unknown), device="cpu")

    no_weights = tmp_path / "no_weights"
    shutil.copytree(qwen3_dir, no_weights)
    for f in no_weights.glob("*.safetensors"):
        f.unlink()
    with pytest.raises(FileNotFoundError, match="safetensors"):
        LLM(str(no_weights), device="cpu")

    wrong = tmp_path / "wrong_shape"
    shutil.copytree(qwen3_dir, wrong)
    cfg = json.loads((wrong / "config.json").read_text())
    cfg["intermediate_size"] = cfg["intermediate_size"] * 2
    (wrong / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="shape"):
        LLM(str(wrong), device="cpu")

    with pytest.raises(FileNotFoundError):
        LLM(str(tmp_path / "does_not_exist_dir"), device="cpu")


def test_stop_strings_cut_exactly(llm):
    base = llm.generate(["Tell me a story."], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
                        use_tqdm=False)[0]
    text = base.text
    assert len(text) > 6
    stop = text[3:6]
    cut = llm.generate(["Tell me a story."], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True,
                                                            stop=[stop]), use_tqdm=False)[0]
    assert cut.text == text[: text.index(stop)]
    assert cut.finish_reason == "stop"
    kept = llm.generate(["Tell me a story."], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop],
                                                             include_stop_str_in_output=True), use_tqdm=False)[0]
    assert kept.text == text[: text.index(stop) + len(stop)]


def test_stop_token_ids_max_tokens_and_min_tokens(llm):
    base = llm.generate(["Tell me a story."], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                        use_tqdm=False)[0]
    assert base.finish_reason == "length" and len(base.token_ids) == 12
    stop_id = base.token_ids[4]
    first = base.token_ids.index(stop_id)
    out = llm.generate(["Tell me a story."], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                                            stop_token_ids=[stop_id]), use_tqdm=False)[0]
    assert out.token_ids == base.token_ids[: first + 1] and out.finish_reason == "stop"


def test_seeded_sampling_repeats_in_any_batch(llm):
    params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=8, seed=1234)
    alone = llm.generate(["Tell me a story."], params, use_tqdm=False)[0].token_ids
    batch = llm.generate(["Other prompt", "Tell me a story.", {"prompt": "x", "images": [make_image(50, 50, 1)]}],
                         [params][0], use_tqdm=False)
    assert batch[1].token_ids == alone
    unseeded = SamplingParams(temperature=1.0, max_tokens=8)
    mixed = llm.generate(["Filler one", "Tell me a story.", "Filler two"], unseeded, use_tqdm=False)
    again = llm.generate(["Tell me a story."], params, use_tqdm=False)[0].token_ids
    assert again == alone and len(mixed) == 3


def test_n_samples(llm):
    outs = llm.generate(["Tell me a story."], SamplingParams(n=3, temperature=1.0, max_tokens=6, seed=5),
                        use_tqdm=False)
    assert len(outs) == 1 and len(outs[0].outputs) == 3
    assert [o.index for o in outs[0].outputs] == [0, 1, 2]
    assert len({tuple(o.token_ids) for o in outs[0].outputs}) > 1


def test_generate_convenience(qwen3_vl_dir):
    import vlmrun

    text = vlmrun.generate(images=[make_image(64, 64, 3)], prompt="Describe.", model=str(qwen3_vl_dir),
                           device="cpu", max_tokens=5)
    assert isinstance(text, str)


def test_one_image_in_a_prompt_dict_is_one_image(llm):
    """`{"images": img}` (not in a list) is that one image, not a sequence of whatever it iterates to."""
    img = make_image(60, 40, 11)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    one, listed = llm.generate([{"prompt": "Describe.", "images": img}, {"prompt": "Describe.", "images": [img]}],
                               params, use_tqdm=False)
    assert one.error is None and one.token_ids == listed.token_ids
    assert one.prompt_token_ids == listed.prompt_token_ids


def test_engine_refuses_stop_strings_past_the_limit_at_add_request(llm):
    """The engine itself enforces the stop limits, whatever front door a request came through."""
    engine = llm.engine
    prompt = engine.process("Hello.")
    too_many = SamplingParams(max_tokens=2, stop=[f"s{i}" for i in range(engine.config.max_stop_strings + 1)])
    with pytest.raises(ValueError, match="stop"):
        engine.add_request("too-many-stops", prompt, too_many)
    assert "too-many-stops" not in engine.requests
