"""The Gradio demo: chat about images and videos with a vlmrun (or any OpenAI-compatible) server.

Upload one or more images or video clips and type a question; the answer streams in. Turns accumulate into a
multi-turn chat (earlier images stay in the conversation). Sampling controls sit beside the chat, starting
from the checkpoint's generation config where the demo runs the model itself (`sampling_defaults`);
Stop, shown only while an answer streams, cancels it (the connection closes and the server aborts the
request); the status line shows the model and the speed in tokens/s. A request the server refuses (a bad
upload, a prompt too long) shows its error in the conversation, naming the user's file. With the bundled
shapes model the page says what that model can and cannot do. Example images come from `assets/images/`:
for the bundled shapes model the generator scenes, each with its caption prompt or a question that scene
answers; else the photos.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, AsyncIterator, Optional

import gradio as gr

from vlmrun.default_model import MODEL_DIR_NAME, REAL_MODEL_EXAMPLE, is_bundled
from vlmrun.shape_scenes import DESCRIBE_PROMPT, QA_KINDS, Scene, scene_from_file
from vlmrun.web.client import ChatClient, ServerError, Speed
from vlmrun.web.conversation import Turn, explain_error, is_video_file, to_chatbot, to_openai, user_turn, without_files

ASSETS = Path(__file__).resolve().parent.parent / "assets" / "images"
IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif")
EXAMPLE_PROMPTS = ("Describe this image.", "What is in the picture?", "What colours dominate this image?")
# The sliders' values where the checkpoint's generation config sets none (or the server's is not known).
FALLBACK_SAMPLING = {"temperature": 0.7, "top_p": 0.9, "top_k": 50, "max_tokens": 256, "repetition_penalty": 1.05}
BUNDLED_MODEL_NOTE = (
    "**This is the bundled 3M-parameter shapes model.** It only knows coloured circles, squares and triangles "
    "(try the examples below); any other picture gets a confident, wrong shape caption. For real images start "
    f"the demo with a Qwen VL checkpoint: `vlmrun web --model {REAL_MODEL_EXAMPLE}`.")


def examples(model: str, directory: Path = ASSETS, limit: int = 6) -> list[dict[str, Any]]:
    """Example messages (text + one image file) suited to the model."""
    if not directory.is_dir():
        return []
    images = [p for p in sorted(directory.iterdir()) if p.suffix.lower() in IMAGE_SUFFIXES]
    if model != MODEL_DIR_NAME:
        photos = [p for p in images if scene_from_file(p) is None][:limit]
        return [{"text": EXAMPLE_PROMPTS[i % len(EXAMPLE_PROMPTS)], "files": [str(p)]} for i, p in enumerate(photos)]
    scenes = [(p, scene) for p in images if (scene := scene_from_file(p)) is not None][:limit]
    return [{"text": _scene_prompt(scene, i), "files": [str(p)]} for i, (p, scene) in enumerate(scenes)]


def _scene_prompt(scene: Scene, i: int) -> str:
    """The i-th example's prompt: the caption prompt, then one question of each kind in turn (that the scene answers)."""
    kind = ("caption", *QA_KINDS)[i % (1 + len(QA_KINDS))]
    questions = [qa.question for qa in scene.qa_pairs() if qa.kind == kind]
    return questions[0] if questions else DESCRIBE_PROMPT


def sampling_params(temperature: float, top_p: float, top_k: int, max_tokens: int, repetition_penalty: float,
                    seed: Optional[float]) -> dict[str, Any]:
    params: dict[str, Any] = {"temperature": float(temperature), "top_p": float(top_p), "top_k": int(top_k),
                              "max_tokens": int(max_tokens), "repetition_penalty": float(repetition_penalty)}
    if seed is not None and int(seed) >= 0:
        params["seed"] = int(seed)
    return params


def slider_defaults(sampling_defaults: Optional[dict[str, Any]]) -> dict[str, Any]:
    """The sliders' starting values: the checkpoint's sampling defaults (SamplingParams field names, as
    `vlmrun.generation_config.read_sampling_defaults` gives them), else `FALLBACK_SAMPLING`."""
    given = sampling_defaults or {}
    return {name: given.get(name, value) for name, value in FALLBACK_SAMPLING.items()}


def checkpoint_sampling_defaults(model_path: Path, sampling_defaults: dict[str, Any]) -> dict[str, Any]:
    """The sliders' defaults for a checkpoint: its sampling defaults (`ModelConfig.sampling_defaults`), and
    temperature 0 (greedy) where its generation_config.json says `do_sample: false` and sets no temperature
    (the bundled shapes model: its captions are exact greedy)."""
    defaults = dict(sampling_defaults)
    config = Path(model_path) / "generation_config.json"
    if "temperature" not in defaults and config.is_file():
        try:
            greedy = json.loads(config.read_text(encoding="utf-8")).get("do_sample") is False
        except (OSError, ValueError):
            greedy = False
        if greedy:
            defaults["temperature"] = 0.0
    return defaults


def build_demo(client: ChatClient, model: Optional[str] = None, examples_dir: Path = ASSETS,
               sampling_defaults: Optional[dict[str, Any]] = None) -> gr.Blocks:
    model = model or client.model_name()
    start = slider_defaults(sampling_defaults)
    running, idle = gr.Button(visible=True), gr.Button(visible=False)

    async def respond(message: Any, turns: list[Turn], system_prompt: str, temperature: float, top_p: float,
                      top_k: int, max_tokens: int, repetition_penalty: float,
                      seed: Optional[float]) -> AsyncIterator[tuple]:
        turn = user_turn(message)
        if not turn.text and not turn.images:
            yield (to_chatbot(turns), turns, gr.MultimodalTextbox(), _status(model, "type a question or add an image"),
                   idle)
            return
        if not turn.text:
            videos = sum(is_video_file(p) for p in turn.images)
            what = "video" if videos == len(turn.images) else "image" if not videos else "media"
            plural = len(turn.images) > 1 and what != "media"
            turn.text = f"Describe the {what}s." if plural else f"Describe the {what}."
        turns = [*turns, turn]
        cleared = gr.MultimodalTextbox(value=None)
        speed = Speed()
        label = f"answer {len(turns)}"
        yield to_chatbot(turns), turns, cleared, _status(model, f"{label}: generating…"), running
        params = sampling_params(temperature, top_p, top_k, max_tokens, repetition_penalty, seed)
        try:
            async for event in client.stream_chat(model, to_openai(turns, system_prompt), params):
                speed.observe(event)
                turn.answer += event.text
                if event.text or event.completion_tokens is not None:
                    yield to_chatbot(turns), turns, cleared, _status(model, f"{label}: {speed.describe()}"), running
        except ServerError as exc:
            error, bad_files = explain_error(_HTTP_STATUS.sub("", str(exc)), turns)
            turn.error = f"not answered: {error}"
            yield (to_chatbot(turns), turns, gr.MultimodalTextbox(value=without_files(message, bad_files)),
                   _status(model, f"{label}: error (see the conversation)"), idle)
            return
        yield to_chatbot(turns), turns, cleared, _status(model, f"{label}: {speed.describe()}"), idle

    with gr.Blocks(title=f"vlmrun · {model}", analytics_enabled=False) as demo:
        gr.Markdown(f"## vlmrun web demo\nChat about images and videos with **{model}**.")
        if is_bundled(model):
            gr.Markdown(BUNDLED_MODEL_NOTE, elem_id="model-note")
        turns_state = gr.State([])
        with gr.Row():
            with gr.Column(scale=3):
                chatbot = gr.Chatbot(label=model, height=480, elem_id="chat")
                textbox = gr.MultimodalTextbox(file_types=["image", "video"], file_count="multiple",
                                               sources=["upload"], show_label=False,
                                               placeholder="Add images or videos and ask about them…",
                                               elem_id="prompt")
                with gr.Row():
                    stop = gr.Button("Stop", variant="stop", elem_id="stop", visible=False)
                    clear = gr.Button("Clear chat", elem_id="clear")
                status = gr.Markdown(_status(model, "ready"), elem_id="status")
            with gr.Column(scale=1):
                system_prompt = gr.Textbox(label="System prompt", lines=2, value="")
                temperature = gr.Slider(0.0, 2.0, value=start["temperature"], step=0.05, label="Temperature",
                                        elem_id="temperature")
                top_p = gr.Slider(0.05, 1.0, value=start["top_p"], step=0.05, label="Top-p", elem_id="top-p")
                top_k = gr.Slider(0, 200, value=start["top_k"], step=1, label="Top-k (0: off)", elem_id="top-k")
                max_tokens = gr.Slider(1, max(2048, start["max_tokens"]), value=start["max_tokens"], step=1,
                                       label="Max new tokens", elem_id="max-tokens")
                repetition_penalty = gr.Slider(0.8, 2.0, value=start["repetition_penalty"], step=0.01,
                                               label="Repetition penalty", elem_id="repetition-penalty")
                seed = gr.Number(value=-1, precision=0, label="Seed (-1: random)")
        shown = examples(model, examples_dir)
        if shown:
            gr.Examples(examples=shown, inputs=[textbox], label="Examples")

        inputs = [textbox, turns_state, system_prompt, temperature, top_p, top_k, max_tokens, repetition_penalty,
                  seed]
        outputs = [chatbot, turns_state, textbox, status, stop]
        answering = textbox.submit(respond, inputs, outputs)
        stop.click(lambda: idle, None, [stop], cancels=[answering])
        clear.click(lambda: ([], [], _status(model, "ready"), idle), None, [chatbot, turns_state, status, stop],
                    cancels=[answering])
    return demo


_HTTP_STATUS = re.compile(r"^HTTP \d+: ")  # the client's prefix: the user needs the message, not the status


def _status(model: str, text: str) -> str:
    return f"Model: `{model}` · {text}"


def theme() -> gr.themes.Base:
    """The default look with system fonts: the page loads nothing from outside the server."""
    return gr.themes.Default(font=["ui-sans-serif", "system-ui", "sans-serif"],
                             font_mono=["ui-monospace", "monospace"])
