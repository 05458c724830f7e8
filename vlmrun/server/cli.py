"""`vlmrun serve`: the OpenAI-compatible server in the foreground.

Its flags follow `vllm serve` where vLLM has one (same name, meaning and default): the model as the
positional argument (or `--model`), `--revision`, `--seed`, `--enable-prefix-caching` /
`--no-enable-prefix-caching`, `--chat-template`, `--limit-mm-per-prompt`, `--enable-auto-tool-choice`,
`--tool-call-parser`, `--trust-request-chat-template`, `--mm-processor-kwargs`, and the further vLLM
flags of `vllm_flags.py` (`-tp`, `--kv-cache-dtype`, `--max-logprobs`, `--root-path`, `--ssl-*`, CORS, ...).
The engine flags are shared with `vlmrun web`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Optional

from vlmrun.cli_options import add_kernel_args, kernel_options
from vlmrun.default_model import resolve_model, served_name
from vlmrun.server.grammar_options import add_grammar_args, grammar_settings
from vlmrun.server.settings import TOOL_CALL_PARSERS, MiB
from vlmrun.server.vllm_flags import (add_vllm_engine_flags, add_vllm_http_flags, add_vllm_request_flags,
                                      announce_accepted, check_tokenizer, mm_limits, show_server_logs,
                                      vllm_engine_fields, vllm_server_fields)


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """Engine options shared by `serve` and `web` (in-process model)."""
    p.add_argument("--model", default=None,
                   help="HF checkpoint directory or hub id (default: the bundled shapes model, assets/model/)")
    p.add_argument("--revision", default=None, help="hub model version: a branch, tag or commit id")
    p.add_argument("--generation-config", default="auto",
                   help="sampling defaults for what a request leaves out: auto (the checkpoint's "
                        "generation_config.json), vllm (none: SamplingParams' own), or a folder holding one")
    p.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16", "float", "half"),
                   help="weights and activations (auto: float32 on the CPU; the checkpoint's bf16 / fp16 on CUDA)")
    p.add_argument("--device", default="auto", help="auto (CUDA when there is one, else the CPU), cpu, cuda or cuda:N")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="longest prompt + answer in tokens (default: the model's max_position_embeddings)")
    p.add_argument("--max-num-seqs", type=int, default=256, help="requests decoded together")
    p.add_argument("--max-num-batched-tokens", type=int, default=8192, help="tokens one engine step may run")
    p.add_argument("--kv-cache-memory-bytes", type=int, default=None,
                   help="KV cache budget in bytes (default: 2 GiB on the CPU; on CUDA from --gpu-memory-utilization)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9, help="share of GPU memory the engine may use")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the engine's sampling generator: unseeded sampled requests repeat from a fresh start")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse the KV of earlier prompts' shared prefixes (--no-enable-prefix-caching: off)")
    p.add_argument("--chat-template", default=None,
                   help="a chat template file, or the template itself, used instead of the checkpoint's")
    p.add_argument("--limit-mm-per-prompt", type=_json_object, default=None,
                   help='items of each modality one request may carry, as JSON: \'{"image": 2, "video": 1}\' '
                        "(default 32 each; 0 refuses the modality)")
    p.add_argument("--mm-processor-kwargs", type=_json_object, default=None,
                   help='image / video processor options for every item that sets none, as JSON: '
                        '\'{"max_pixels": 401408}\' (min_pixels, max_pixels, fps); a request\'s own override them')
    p.add_argument("--max-images-per-request", type=int, default=None,
                   help='images one request may carry (default 32; the same as --limit-mm-per-prompt \'{"image": N}\')')
    p.add_argument("--max-image-pixels", type=int, default=None, help="images with more pixels are refused")
    p.add_argument("--max-video-frames", type=int, default=None, help="frames sampled from one video (default 768)")
    p.add_argument("--max-video-tokens", type=int, default=None,
                   help="LLM tokens of all videos of one request (default 65536)")
    p.add_argument("--max-stop-strings", type=int, default=32, help="stop strings one request may give")
    p.add_argument("--max-stop-string-length", type=int, default=512, help="characters of one stop string")
    p.add_argument("--max-stop-token-ids", type=int, default=64, help="stop token ids one request may give")
    add_kernel_args(p)
    add_vllm_engine_flags(p)
    p.add_argument("-tp", "--tensor-parallel-size", type=int, default=1, help="ranks (devices) the model is split over")
    p.add_argument("--distributed-executor-backend", choices=("mp", "ray"), default="mp",
                   help="how the ranks are started: local processes (mp) or a Ray placement group (ray)")
    p.add_argument("--mm-encoder-tp-mode", choices=("weights", "data"), default="weights",
                   help="vision tower on every rank: each encodes every image (weights) or a share of them (data)")
    p.add_argument("--enable-expert-parallel", action="store_true",
                   help="MoE models under tensor parallelism: whole experts per rank instead of every expert sliced")
    p.add_argument("--enable-lora", action="store_true", help="serve LoRA adapters (PEFT folders; docs/lora.md)")
    p.add_argument("--max-loras", type=int, default=1, help="LoRA adapters one step may run (slots)")
    p.add_argument("--max-lora-rank", type=int, default=16, help="the largest LoRA rank served")
    p.add_argument("--max-cpu-loras", type=int, default=None, help="read LoRA adapters kept on the host")
    p.add_argument("--scheduling-policy", default="fcfs",
                   help="who runs first: arrival order (fcfs) or each request's `priority`, lower first (priority)")


def _json_object(text: str) -> Any:
    """argparse type of a JSON flag: the parsed value (its shape is checked where it is used)."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc.msg} ({text!r})") from None


def model_argument(args: argparse.Namespace) -> Optional[str]:
    """The model the command line names: `serve`'s positional MODEL or `--model` (ValueError for two
    different ones); None: the bundled default model."""
    positional = getattr(args, "model_tag", None)
    if positional is not None and args.model is not None and positional != args.model:
        raise ValueError(f"the model is named twice, {positional!r} and --model {args.model!r}: give it once")
    return positional if positional is not None else args.model


def media_limits(args: argparse.Namespace) -> dict[str, int]:
    """The EngineConfig per-request media counts of `--limit-mm-per-prompt` and `--max-images-per-request`
    (ValueError for a bad value, or for the two flags giving different image counts)."""
    from vlmrun.config import mm_limit_fields

    limits = mm_limits(args)
    fields = mm_limit_fields(limits) if limits is not None else {}
    images = args.max_images_per_request
    if images is not None:
        if fields.get("max_images_per_request", images) != images:
            raise ValueError(f"--max-images-per-request {images} and --limit-mm-per-prompt "
                             f"{{\"image\": {fields['max_images_per_request']}}} disagree: give one")
        fields["max_images_per_request"] = images
    return fields


def engine_config(args: argparse.Namespace):  # -> EngineConfig (imported lazily: torch)
    from vlmrun.config import EngineConfig

    return EngineConfig(model=model_argument(args), revision=args.revision, seed=args.seed,
                        generation_config=args.generation_config,
                        enable_prefix_caching=args.enable_prefix_caching, chat_template=args.chat_template,
                        dtype=args.dtype, device=args.device, max_model_len=args.max_model_len,
                        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                        kv_cache_memory_bytes=args.kv_cache_memory_bytes,
                        gpu_memory_utilization=args.gpu_memory_utilization, **media_limits(args),
                        max_image_pixels=args.max_image_pixels,
                        max_video_frames=args.max_video_frames, max_video_tokens=args.max_video_tokens,
                        max_stop_strings=args.max_stop_strings, max_stop_string_length=args.max_stop_string_length,
                        max_stop_token_ids=args.max_stop_token_ids, tensor_parallel_size=args.tensor_parallel_size,
                        distributed_executor_backend=args.distributed_executor_backend,
                        mm_encoder_tp_mode=args.mm_encoder_tp_mode,
                        enable_expert_parallel=args.enable_expert_parallel, enable_lora=args.enable_lora,
                        max_loras=args.max_loras, max_lora_rank=args.max_lora_rank, max_cpu_loras=args.max_cpu_loras,
                        mm_processor_kwargs=args.mm_processor_kwargs, scheduling_policy=args.scheduling_policy,
                        runner=getattr(args, "runner", "generate"), pooler_config=getattr(args, "pooler_config", None),
                        **kernel_options(args), **vllm_engine_fields(args))


def lora_modules(args: argparse.Namespace) -> dict[str, str]:
    """`--lora-modules name=path ...` (or vLLM's JSON form {"name": ..., "path": ...}) -> {name: path};
    ValueError for a bad item, a repeated name, adapters without --enable-lora, or a missing or broken adapter."""
    out: dict[str, str] = {}
    for item in args.lora_modules or []:
        if item.lstrip().startswith("{"):
            spec = _json_object(item)
            name, path = spec.get("name"), spec.get("path")
        else:
            name, _, path = item.partition("=")
        if not name or not path or name in out:
            raise ValueError(f"--lora-modules {item!r}: give name=path (or {{\"name\": ..., \"path\": ...}}), "
                             f"each name once")
        out[name] = path
    if out and not args.enable_lora:
        raise ValueError("--lora-modules needs --enable-lora")
    if out:  # a missing or broken adapter is refused at start-up (LoRAError, a ValueError), as vLLM does
        from vlmrun.lora.peft_files import check_served_adapters

        check_served_adapters(out, getattr(args, "max_lora_rank", None))
    return out


def server_settings(args: argparse.Namespace):  # -> ServerSettings
    from vlmrun.server.settings import ServerSettings

    names = args.served_model_name or [served_name(model_argument(args))]
    return ServerSettings(
        served_model_name=names[0], served_model_aliases=tuple(names[1:]),
        api_key=args.api_key or os.environ.get("VLMRUN_API_KEY") or None,
        max_request_bytes=args.max_request_mb * MiB, max_queued_requests=args.max_queued_requests,
        max_n=args.max_n, preprocess_workers=args.preprocess_workers,
        allow_remote_urls=not args.no_remote_urls, allow_private_urls=args.allow_private_urls,
        allowed_local_media_path=args.allowed_local_media_path, url_timeout_s=args.url_timeout,
        max_image_bytes=args.max_image_mb * MiB, max_video_bytes=args.max_video_mb * MiB,
        reasoning_parser=None if args.reasoning_parser == "none" else args.reasoning_parser,
        enable_auto_tool_choice=args.enable_auto_tool_choice, tool_call_parser=args.tool_call_parser,
        trust_request_chat_template=args.trust_request_chat_template, lora_modules=lora_modules(args),
        **vllm_server_fields(args), **grammar_settings(args))


def add_server_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--runner", choices=("generate", "pooling"), default="generate",
                   help="generate: text (/v1/chat/completions, /v1/completions); pooling: embeddings "
                        "(/v1/embeddings; docs/guide/embeddings.md)")
    p.add_argument("--pooler-config", type=_json_object, default=None,
                   help='with --runner pooling: override the checkpoint\'s pooling, e.g. {"pooling_type": "MEAN", '
                        '"normalize": false}')
    p.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                   help="LoRA adapters served by name: a request's model NAME runs the PEFT folder PATH")
    p.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="the model ids clients may use, the first reported in answers and metrics (default: "
                        "--model, or the bundled model's name)")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1 (or VLMRUN_API_KEY)")
    p.add_argument("--allowed-local-media-path", default=None,
                   help="directory whose images clients may name by path or file:// URI (default: none)")
    p.add_argument("--allow-private-urls", action="store_true",
                   help="let image URLs reach private, loopback and link-local addresses")
    p.add_argument("--no-remote-urls", action="store_true", help="refuse http(s) image URLs")
    p.add_argument("--url-timeout", type=float, default=10.0, help="seconds for one image download")
    p.add_argument("--max-image-mb", type=int, default=20, help="size cap of one image (MiB)")
    p.add_argument("--max-video-mb", type=int, default=200, help="size cap of one video (MiB)")
    p.add_argument("--max-request-mb", type=int, default=64, help="request body cap (MiB); larger: 413")
    p.add_argument("--max-queued-requests", type=int, default=1024,
                   help="requests that may wait beyond --max-num-seqs; more get 429")
    p.add_argument("--max-n", type=int, default=16, help="largest n (choices per request)")
    p.add_argument("--preprocess-workers", type=int, default=4, help="threads for parsing and images")
    p.add_argument("--reasoning-parser", choices=("qwen3", "none"), default="qwen3",
                   help="split <think>...</think> into reasoning_content (none: leave it in content)")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help='parse the tool calls of tool_choice "auto" answers (without it such a request is a 400); '
                        "needs --tool-call-parser")
    p.add_argument("--tool-call-parser", choices=TOOL_CALL_PARSERS, default=None,
                   help="the tool-call format: Qwen's JSON (hermes) or XML-style calls (qwen3_coder, qwen3_xml); "
                        "either is read whichever is named")
    p.add_argument("--trust-request-chat-template", action="store_true",
                   help="let a chat request carry its own 'chat_template' (without it such a request is a 400)")
    add_vllm_request_flags(p)
    add_grammar_args(p)


def serve(args: argparse.Namespace) -> int:
    from vlmrun.processors.processor_files import load_chat_template
    from vlmrun.server.memory import share_one_arena

    share_one_arena()  # before any thread starts: the memory of large bodies can go back (server/memory.py)

    try:  # what the command line got wrong, before any model is loaded
        settings = server_settings(args)
        config = engine_config(args)
        model = resolve_model(config.model, announce=False)
        check_tokenizer(args.tokenizer, config.model, model)
        from vlmrun.server.launch import HTTPOptions

        http = HTTPOptions.of(args)
        if config.chat_template is not None:
            load_chat_template(config.chat_template)
    except (FileNotFoundError, ValueError) as exc:
        print(f"vlmrun serve: {exc}", file=sys.stderr)
        return 2
    announce_accepted(args, "serve")
    from vlmrun.server.launch import PortInUse, bind_socket, build_engine, run_server

    try:  # the port before the model: a busy port fails at once, not after loading
        sock = bind_socket(args.host, args.port)
    except PortInUse as exc:
        print(f"vlmrun serve: {exc}", file=sys.stderr)
        return 2
    show_server_logs(settings.log_requests, settings.log_stats)
    try:
        engine = build_engine(config, model)
    except BaseException:
        sock.close()
        raise
    try:
        from vlmrun.server.app import create_app

        sock.listen(2048)  # from here connections wait in the backlog for uvicorn
        address = f"{http.scheme}://{args.host}:{sock.getsockname()[1]}{http.root_path}"
        print(f"vlmrun serve: serving {model} as {settings.served_model_name!r} on {address} "
              f"(OpenAI API at {address}/v1)", file=sys.stderr, flush=True)
        run_server(create_app(engine, settings, root_path=http.root_path), sock, http)
    finally:
        engine.shutdown()
        sock.close()
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    p.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                   help="HF checkpoint directory or hub id, as `vllm serve MODEL` takes it (or --model)")
    add_engine_args(p)
    add_server_args(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    p.add_argument("--port", type=int, default=8000, help="TCP port to listen on")
    add_vllm_http_flags(p)
    p.add_argument("--log-level", "--uvicorn-log-level", dest="log_level", default="info", choices=("critical", "error", "warning", "info", "debug", "trace"),
                   help="uvicorn's log level")
    p.set_defaults(func=serve)
