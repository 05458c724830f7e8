"""`vlmrun web`: the Gradio demo, against a running server (`--server URL`) or a model loaded in
this process (`--model M`, or the bundled default model when neither is given), served by an
in-process OpenAI-compatible server on a free loopback port, so both modes run the same client code.
With the model in this process the sampling sliders start from its generation config.
"""

from __future__ import annotations

import argparse
import sys

from vlmrun.default_model import resolve_model, served_name


def web(args: argparse.Namespace) -> int:
    if args.model and args.server:
        print("vlmrun web: give --model M or --server URL, not both", file=sys.stderr)
        return 2
    config = None
    if not args.server:
        from vlmrun.server.cli import engine_config

        try:
            resolve_model(args.model, announce=False)
            config = engine_config(args)
        except (FileNotFoundError, ValueError) as exc:  # no model; a bad option value (--limit-mm-per-prompt, ...)
            print(f"vlmrun web: {exc}", file=sys.stderr)
            return 2
    from vlmrun.web.app import ASSETS, build_demo, checkpoint_sampling_defaults, theme
    from vlmrun.web.client import ChatClient

    engine = server = None
    defaults = None  # the sliders' start: the checkpoint's generation config when the model runs here
    try:
        if config is not None:
            from vlmrun.server.launch import build_engine, serve_in_thread
            from vlmrun.server.settings import ServerSettings

            engine = build_engine(config, resolve_model(args.model, announce=False))
            model_config = engine.engine.model_config
            defaults = checkpoint_sampling_defaults(model_config.path, model_config.sampling_defaults)
            server = serve_in_thread(engine, ServerSettings(served_model_name=served_name(args.model)))
            client = ChatClient(server.base_url)
        else:
            client = ChatClient(args.server, api_key=args.api_key)
        demo = build_demo(client, sampling_defaults=defaults)
        demo.queue(default_concurrency_limit=args.concurrency)
        demo.launch(server_name=args.host, server_port=args.port, theme=theme(), ssr_mode=False,
                    allowed_paths=[str(ASSETS)], share=False)
    finally:
        if server is not None:
            server.stop()
        if engine is not None:
            engine.shutdown()
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    from vlmrun.server.cli import add_engine_args

    p = sub.add_parser("web", help="Gradio web demo (chat about images)")
    add_engine_args(p)
    p.add_argument("--server", default=None, help="URL of a running OpenAI-compatible server, e.g. http://127.0.0.1:8000")
    p.add_argument("--api-key", default=None, help="API key for --server")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=7860)
    p.add_argument("--concurrency", type=int, default=8, help="answers streamed at once")
    p.set_defaults(func=web)
