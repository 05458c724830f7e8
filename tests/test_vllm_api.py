"""The Python API as vLLM users call it (issue 30): raw prompts, multi_modal_data, prompt_token_ids,
LLM.chat's options, get_tokenizer / get_default_sampling_params, generation_config,
limit_mm_per_prompt. Each test asserts the effect against the templated path or HF's template."""

from __future__ import annotations

import json
import shutil

import pytest

from testing.videos import moving_shapes
from tests.test_engine_parity import make_image
from vlmrun import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
STORY = [{"role": "user", "content": "Tell me a story."}]
IMAGE_PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"


@pytest.fixture(scope="module")
def llm(qwen3_vl_dir):
    return LLM(str(qwen3_vl_dir), dtype="float32", device="cpu")


def rendered(llm: LLM, messages: list, **options) -> str:
    """HF's own rendering of `messages` with the checkpoint's chat template."""
    return llm.get_tokenizer().apply_chat_template(messages, tokenize=False, **options)


def with_image(text: str) -> list:
    return [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}]


def test_a_string_is_the_raw_prompt_and_chat_applies_the_template(llm):
    raw = llm.generate("Tell me a story.", GREEDY, use_tqdm=False)[0]
    assert raw.prompt_token_ids == llm.get_tokenizer().encode("Tell me a story.")
    assert raw.prompt == "Tell me a story."
    chat = llm.chat(STORY, GREEDY, use_tqdm=False)[0]
    templated = llm.generate(rendered(llm, STORY, add_generation_prompt=True), GREEDY, use_tqdm=False)[0]
    assert templated.error is None and chat.error is None
    assert templated.prompt_token_ids == chat.prompt_token_ids != raw.prompt_token_ids
    assert templated.token_ids == chat.token_ids
    user_turn = llm.generate({"prompt": "Tell me a story.", "images": []}, GREEDY, use_tqdm=False)[0]
    assert user_turn.prompt_token_ids == chat.prompt_token_ids  # vlmrun's form stays templated


def test_multi_modal_data_expands_each_placeholder_to_its_image(llm):
    first, second = make_image(64, 48, 1), make_image(40, 72, 2)
    text = rendered(llm, with_image("Describe."), add_generation_prompt=True)
    assert text.count(IMAGE_PLACEHOLDER) == 1
    raw = llm.generate({"prompt": text, "multi_modal_data": {"image": first}}, GREEDY, use_tqdm=False)[0]
    chat = llm.chat([{"role": "user", "content": [{"type": "image", "image": first},
                                                  {"type": "text", "text": "Describe."}]}], GREEDY, use_tqdm=False)[0]
    assert raw.error is None
    assert raw.prompt_token_ids == chat.prompt_token_ids
    assert raw.token_ids == chat.token_ids
    two = f"{IMAGE_PLACEHOLDER}a{IMAGE_PLACEHOLDER}b"
    forward = llm.engine.process({"prompt": two, "multi_modal_data": {"image": [first, second]}}).mm_items
    backward = llm.engine.process({"prompt": two, "multi_modal_data": {"image": [second, first]}}).mm_items
    assert [(it.hash, it.length) for it in forward] == [(it.hash, it.length) for it in reversed(backward)]
    assert forward[0].length != forward[1].length  # in placeholder order, each image its own run
    missing = llm.generate({"prompt": two, "multi_modal_data": {"image": first}}, GREEDY, use_tqdm=False)[0]
    assert missing.error is not None and "2 <|image_pad|> placeholders for 1 images" in missing.error


def test_a_raw_video_placeholder_is_the_chat_video(llm):
    frames = moving_shapes(6, 40, 52).permute(0, 2, 3, 1).numpy()  # [T, H, W, 3]
    chat = [{"role": "user", "content": [{"type": "video", "video": frames}, "What moves?"]}]
    templated = llm.chat(chat, GREEDY, use_tqdm=False)[0]
    text = rendered(llm, [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "What moves?"}]}],
                    add_generation_prompt=True)
    raw = llm.generate({"prompt": text, "multi_modal_data": {"video": frames}}, GREEDY, use_tqdm=False)[0]
    assert raw.error is None and templated.error is None
    assert raw.prompt_token_ids == templated.prompt_token_ids  # "<t seconds>" groups written as the chat's
    assert raw.token_ids == templated.token_ids


def test_prompt_token_ids_equal_the_text_prompt(llm):
    image = make_image(56, 56, 3)
    text = rendered(llm, with_image("What is it?"), add_generation_prompt=True)
    ids = llm.get_tokenizer().encode(text)
    by_text, by_ids = llm.generate([{"prompt": text, "multi_modal_data": {"image": [image]}},
                                    {"prompt_token_ids": ids, "multi_modal_data": {"image": [image]}}],
                                   GREEDY, use_tqdm=False)
    assert by_ids.error is None
    assert by_ids.prompt_token_ids == by_text.prompt_token_ids
    assert by_ids.token_ids == by_text.token_ids
    plain = llm.generate({"prompt_token_ids": llm.get_tokenizer().encode("Hello there")}, GREEDY, use_tqdm=False)[0]
    assert plain.token_ids == llm.generate("Hello there", GREEDY, use_tqdm=False)[0].token_ids


@pytest.mark.parametrize("prompt, key", [
    ({"promt": "typo"}, "promt"),
    ({"prompt": "x", "multi_modal_data": {"audio": b""}}, "audio"),
    ({"prompt": "x", "images": [], "multi_modal_data": {}}, "multi_modal_data"),
    ({"multi_modal_data": {"image": []}}, "prompt_token_ids"),
    ({"prompt": 3}, "prompt"),
])
def test_a_prompt_of_no_form_is_a_value_error_naming_the_key(llm, prompt, key):
    with pytest.raises(ValueError, match=key):
        llm.generate(["fine", prompt], GREEDY, use_tqdm=False)


def test_chat_options_render_as_hf_apply_chat_template(llm):
    tokenizer = llm.get_tokenizer()

    def prompt_ids(messages: list, **options) -> list[int]:
        out = llm.chat(messages, SamplingParams(max_tokens=1), use_tqdm=False, **options)[0]
        assert out.error is None, out.error
        return out.prompt_token_ids

    assert prompt_ids(STORY, add_generation_prompt=False) == \
        tokenizer.encode(rendered(llm, STORY, add_generation_prompt=False))
    opened = STORY + [{"role": "assistant", "content": "Once upon"}]
    continued = prompt_ids(opened, add_generation_prompt=False, continue_final_message=True)
    assert continued == tokenizer.encode(rendered(llm, opened, continue_final_message=True))
    assert tokenizer.decode(continued).endswith("Once upon")
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                               "parameters": {"type": "object", "properties": {}}}}]
    with_tools = prompt_ids(STORY, tools=tools)
    assert with_tools == tokenizer.encode(rendered(llm, STORY, tools=tools, add_generation_prompt=True))
    assert prompt_ids(STORY, chat_template="{{ messages[0]['content'] }}!") == tokenizer.encode("Tell me a story.!")
    listing = "{% for tool in tools %}{{ tool.function.name }}: {% endfor %}{{ messages[0]['content'] }}"
    assert prompt_ids(STORY, tools=tools, chat_template=listing) == tokenizer.encode("get_weather: Tell me a story.")
    with pytest.raises(ValueError, match="continue_final_message"):
        llm.chat(opened, continue_final_message=True, use_tqdm=False)  # add_generation_prompt defaults to True


def test_mm_processor_kwargs_size_the_images_that_do_not_size_themselves(llm):
    image = make_image(280, 280, 4)
    part = {"type": "image", "image": image}
    sized = [{"role": "user", "content": [{**part, "max_pixels": 28 * 28 * 4}, "Describe."]}]
    plain = [{"role": "user", "content": [part, "Describe."]}]
    pad = llm.engine.processor.image_token_id
    full, by_item = (llm.chat(m, GREEDY, use_tqdm=False)[0] for m in (plain, sized))
    by_call = llm.chat(plain, GREEDY, use_tqdm=False, mm_processor_kwargs={"max_pixels": 28 * 28 * 4})[0]
    assert by_call.prompt_token_ids == by_item.prompt_token_ids
    assert by_call.prompt_token_ids.count(pad) < full.prompt_token_ids.count(pad)
    raw = llm.generate({"prompt": IMAGE_PLACEHOLDER + "Describe.", "multi_modal_data": {"image": image},
                        "mm_processor_kwargs": {"max_pixels": 28 * 28 * 4}}, GREEDY, use_tqdm=False)[0]
    assert raw.prompt_token_ids.count(pad) == by_item.prompt_token_ids.count(pad)
    with pytest.raises(ValueError, match="size"):
        llm.chat(plain, use_tqdm=False, mm_processor_kwargs={"size": {"longest_edge": 100}})


def test_image_pil_part_is_an_image_and_image_embeds_is_refused(llm):
    image = make_image(64, 64, 5)
    as_pil = llm.chat([{"role": "user", "content": [{"type": "image_pil", "image_pil": image}, "Hi"]}],
                      GREEDY, use_tqdm=False)[0]
    as_image = llm.chat([{"role": "user", "content": [{"type": "image", "image": image}, "Hi"]}],
                        GREEDY, use_tqdm=False)[0]
    assert as_pil.error is None and as_pil.prompt_token_ids == as_image.prompt_token_ids
    assert as_pil.token_ids == as_image.token_ids
    embeds = [{"role": "user", "content": [{"type": "image_embeds", "image_embeds": None}, "Hi"]}]
    assert "image_embeds" in llm.chat(embeds, GREEDY, use_tqdm=False)[0].error
    with pytest.raises(ValueError, match="image_embeds"):
        llm.engine.processor.process_chat(embeds)


SAMPLING = {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05, "max_new_tokens": 3}


def test_default_sampling_params_follow_the_generation_config(qwen3_dir, tmp_path):
    checkpoint = shutil.copytree(qwen3_dir, tmp_path / "model")
    config = json.loads((checkpoint / "generation_config.json").read_text())
    (checkpoint / "generation_config.json").write_text(json.dumps({**config, **SAMPLING}))
    folder = tmp_path / "settings"
    folder.mkdir()
    (folder / "generation_config.json").write_text(json.dumps({"temperature": 0.3, "max_new_tokens": 2}))

    auto = LLM(str(checkpoint), dtype="float32", device="cpu").get_default_sampling_params()
    assert (auto.temperature, auto.top_p, auto.top_k, auto.repetition_penalty, auto.max_tokens) == \
        (0.7, 0.8, 20, 1.05, 3)
    assert auto.min_p == SamplingParams().min_p  # what the file leaves out keeps SamplingParams' default
    own = LLM(str(checkpoint), dtype="float32", device="cpu", generation_config="vllm")
    assert own.get_default_sampling_params() == SamplingParams()
    elsewhere = LLM(str(checkpoint), dtype="float32", device="cpu", generation_config=str(folder))
    params = elsewhere.get_default_sampling_params()
    assert (params.temperature, params.max_tokens, params.top_k) == (0.3, 2, SamplingParams().top_k)
    out = elsewhere.generate("Tell me a story.", use_tqdm=False)[0]  # no params: the defaults apply
    assert len(out.token_ids) <= 2
    plain = LLM(str(qwen3_dir), dtype="float32", device="cpu")  # the tiny checkpoint sets no sampling field
    assert plain.get_default_sampling_params() == SamplingParams()
    with pytest.raises(ValueError, match="generation_config"):
        LLM(str(qwen3_dir), dtype="float32", device="cpu", generation_config=str(tmp_path / "none"))


def test_limit_mm_per_prompt_refuses_more_items_than_the_limit(qwen3_vl_dir):
    llm = LLM(str(qwen3_vl_dir), dtype="float32", device="cpu", limit_mm_per_prompt={"image": 1, "video": 0})
    images = [make_image(40, 40, 6), make_image(40, 40, 7)]
    one, two = llm.generate([{"prompt": "Describe.", "images": images[:1]},
                             {"prompt": "Describe.", "images": images}], GREEDY, use_tqdm=False)
    assert one.error is None
    assert two.error is not None and "the limit is 1" in two.error
    raw = llm.generate({"prompt": IMAGE_PLACEHOLDER * 2, "multi_modal_data": {"image": images}}, GREEDY,
                       use_tqdm=False)[0]
    assert "the limit is 1" in raw.error
    with pytest.raises(ValueError, match="audio"):
        LLM(str(qwen3_vl_dir), dtype="float32", device="cpu", limit_mm_per_prompt={"audio": 1})
