"""`vllm serve`'s start-up flags that vlmrun's `serve` (and `run-batch`, `web`) takes beside its own.

Each flag has vLLM's name and meaning, or is refused at start-up with a message saying why and what
to use instead (never accepted and silently different):

- engine: `-tp` (`--tensor-parallel-size`), `-pp` / `-dp` (1 only: one engine), `--load-format` (auto /
  safetensors), `--kv-cache-dtype`, `--block-size` (`--scheduling-policy` is `cli.add_engine_args`' own),
  `--enable-chunked-prefill` (vlmrun always prefills in chunks: `--no-enable-chunked-prefill` is
  refused), `--tokenizer` / `--tokenizer-mode` (only the checkpoint's own), `--trust-remote-code`
  (accepted with a log line: vlmrun runs only its own model code), `--swap-space` (accepted with a
  log line: preempted requests are recomputed, never swapped), `--limit-mm-per-prompt.image N` /
  `.video N` (the dotted form of `--limit-mm-per-prompt`);
- requests: `--max-logprobs`, `--trust-request-mm-kwargs`, `--override-generation-config`,
  `--return-tokens-as-token-ids`, `--enable-log-requests` (`--disable-log-requests`, vLLM's older
  name, keeps them off) with `--max-log-len`, `--disable-log-stats`, `--chat-template-content-format`
  (auto / openai: message contents reach the template as OpenAI's lists of parts), `--response-role`,
  `--enable-force-include-usage`;
- HTTP (`serve` only): `--root-path`, `--ssl-keyfile` / `--ssl-certfile` / `--ssl-ca-certs` /
  `--ssl-cert-reqs`, `--allowed-origins` / `--allowed-methods` / `--allowed-headers` /
  `--allow-credentials` (CORS, vLLM's defaults: every origin, method and header, no credentials),
  `--disable-uvicorn-access-log`, `--disable-fastapi-docs` (there are none to disable).

Kept free of torch: parsing a command line stays fast.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from typing import Any, Optional

# vLLM's default --max-logprobs; the engine returns at most this many (vlmrun.sampling_params.MAX_LOGPROBS,
# repeated here to keep torch out of parsing; tests/test_vllm_flags.py checks they agree).
ENGINE_MAX_LOGPROBS = 20


def add_vllm_engine_flags(p: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """vLLM's engine flags beyond `add_engine_args`' own (which hold `-tp` on --tensor-parallel-size)."""
    p.add_argument("--kv-cache-dtype", default="auto",
                   help="the KV cache's dtype (vLLM's name): auto, the model's dtype; fp8 / fp8_e4m3 / fp8_e5m2, "
                        "float8 with the checkpoint's k/v scales (else 1.0), half a 16-bit cache's bytes "
                        "(docs/kv_cache_dtype.md)")
    p.add_argument("--block-size", type=int, default=None,
                   help="tokens per KV cache page (vLLM's name; default 16)")
    p.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=None,
                   help="prefill long prompts in chunks of --max-num-batched-tokens (always on here: "
                        "--no-enable-chunked-prefill is refused)")
    p.add_argument("--tokenizer", default=None,
                   help="the tokenizer: only the checkpoint's own is used (another one is refused)")
    p.add_argument("--tokenizer-mode", default="auto", help="auto only: the checkpoint's (fast) tokenizer")
    p.add_argument("--trust-remote-code", action="store_true",
                   help="accepted for vLLM's scripts: vlmrun runs only its own model code, never a checkpoint's")
    p.add_argument("--swap-space", type=float, default=None,
                   help="accepted for vLLM's scripts: preempted requests are recomputed, never swapped to the host")
    p.add_argument("-pp", "--pipeline-parallel-size", type=int, default=1,
                   help="1 only: split a model over devices with --tensor-parallel-size")
    p.add_argument("-dp", "--data-parallel-size", type=int, default=1,
                   help="1 only: for more replicas run one server per device group behind a load balancer")
    p.add_argument("--load-format", default="auto", help="auto or safetensors: the checkpoint's safetensors files")
    p.add_argument("--limit-mm-per-prompt.image", dest="limit_mm_image", type=int, default=None, metavar="N",
                   help="images one request may carry (the dotted form of --limit-mm-per-prompt)")
    p.add_argument("--limit-mm-per-prompt.video", dest="limit_mm_video", type=int, default=None, metavar="N",
                   help="videos one request may carry (the dotted form of --limit-mm-per-prompt)")


def add_vllm_request_flags(p: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """vLLM's flags about what a request may ask for and what is logged of it."""
    p.add_argument("--max-logprobs", type=int, default=ENGINE_MAX_LOGPROBS,
                   help="the most logprobs (and prompt_logprobs) a request may ask for per token; more is a "
                        f"400 (vLLM's; at most {ENGINE_MAX_LOGPROBS}, -1: {ENGINE_MAX_LOGPROBS})")
    p.add_argument("--trust-request-mm-kwargs", action="store_true",
                   help="let a request carry its own 'mm_processor_kwargs' (without it such a request is a 400)")
    p.add_argument("--override-generation-config", type=_json_dict, default=None, metavar="JSON",
                   help='sampling defaults over the generation config\'s, as JSON: \'{"temperature": 0.5}\' '
                        "(generation_config.json names: temperature, top_p, top_k, min_p, repetition_penalty, "
                        "max_new_tokens)")
    p.add_argument("--return-tokens-as-token-ids", action="store_true",
                   help='logprobs name their tokens "token_id:<id>" unless a request says otherwise')
    logs = p.add_mutually_exclusive_group()
    logs.add_argument("--enable-log-requests", action="store_true",
                      help="log each request's id, prompt size and sampling parameters")
    logs.add_argument("--disable-log-requests", action="store_true",
                      help="vLLM's older flag: requests are not logged (the default)")
    p.add_argument("--max-log-len", type=int, default=None,
                   help="with --enable-log-requests: characters of the prompt text logged (default: all)")
    p.add_argument("--chat-template-content-format", default="auto", choices=("auto", "openai", "string"),
                   help="how message contents reach the chat template: auto / openai (lists of parts, the "
                        "Qwen templates' form); string is refused")
    p.add_argument("--response-role", default="assistant",
                   help="the role of a chat answer (when add_generation_prompt opens one)")
    p.add_argument("--enable-force-include-usage", action="store_true",
                   help="every streamed answer ends with its usage chunk, asked for or not")
    p.add_argument("--disable-log-stats", action="store_true",
                   help="no periodic engine statistics line in the log (running / waiting requests, KV use, "
                        "token throughput)")


def add_vllm_http_flags(p: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """vLLM's HTTP flags of `serve`."""
    p.add_argument("--root-path", default=None,
                   help="the path prefix a proxy serves this server under (FastAPI / uvicorn root_path)")
    p.add_argument("--ssl-keyfile", default=None, help="serve HTTPS: the private key file")
    p.add_argument("--ssl-certfile", default=None, help="serve HTTPS: the certificate file")
    p.add_argument("--ssl-ca-certs", default=None, help="CA certificates to check client certificates against")
    p.add_argument("--ssl-cert-reqs", type=int, default=0,
                   help="whether client certificates are required (Python's ssl.CERT_*: 0 none, 1 optional, 2 required)")
    p.add_argument("--allowed-origins", type=_json_list, default=["*"], metavar="JSON",
                   help='CORS: origins allowed, as JSON (default ["*"])')
    p.add_argument("--allowed-methods", type=_json_list, default=["*"], metavar="JSON",
                   help='CORS: methods allowed, as JSON (default ["*"])')
    p.add_argument("--allowed-headers", type=_json_list, default=["*"], metavar="JSON",
                   help='CORS: headers allowed, as JSON (default ["*"])')
    p.add_argument("--allow-credentials", action="store_true", help="CORS: allow credentials")
    p.add_argument("--disable-uvicorn-access-log", action="store_true", help="no access log line per request")
    p.add_argument("--disable-fastapi-docs", action="store_true",
                   help="accepted for vLLM's scripts: this server has no /docs or /redoc pages")


def vllm_engine_fields(args: argparse.Namespace) -> dict[str, Any]:
    """The EngineConfig fields the vLLM engine flags set; ValueError for a flag refused here."""
    if args.enable_chunked_prefill is False:
        raise ValueError("--no-enable-chunked-prefill: vlmrun always prefills long prompts in chunks of "
                         "--max-num-batched-tokens; to prefill a prompt in one step, raise "
                         "--max-num-batched-tokens to --max-model-len instead")
    if args.pipeline_parallel_size != 1:
        raise ValueError(f"--pipeline-parallel-size {args.pipeline_parallel_size}: vlmrun has no pipeline "
                         "parallelism; split the model over devices with --tensor-parallel-size instead")
    if args.data_parallel_size != 1:
        raise ValueError(f"--data-parallel-size {args.data_parallel_size}: one server runs one engine; run one "
                         "server per device group behind a load balancer instead")
    if args.load_format not in ("auto", "safetensors"):
        raise ValueError(f"--load-format {args.load_format}: vlmrun reads the checkpoint's safetensors files "
                         "(auto or safetensors)")
    if args.tokenizer_mode != "auto":
        raise ValueError(f"--tokenizer-mode {args.tokenizer_mode}: only 'auto' (the checkpoint's own tokenizer) "
                         "is supported")
    fields: dict[str, Any] = {"kv_cache_dtype": args.kv_cache_dtype}
    if args.block_size is not None:
        fields["page_size"] = args.block_size
    return fields


def check_tokenizer(tokenizer: Optional[str], model: Optional[str], model_path: Optional[str] = None) -> None:
    """`--tokenizer` may only name the model itself (its name or its folder); ValueError otherwise."""
    if tokenizer is None or tokenizer in (model, model_path):
        return
    raise ValueError(f"--tokenizer {tokenizer}: vlmrun reads the tokenizer from the checkpoint it loads "
                     f"({model or 'the bundled model'}); leave --tokenizer out, or put the tokenizer's files "
                     "in the checkpoint folder")


def mm_limits(args: argparse.Namespace) -> Optional[dict[str, Any]]:
    """`--limit-mm-per-prompt` with its dotted flags (`--limit-mm-per-prompt.image N`) merged in; ValueError
    when both forms give a modality different counts."""
    limits = dict(args.limit_mm_per_prompt) if isinstance(args.limit_mm_per_prompt, dict) else args.limit_mm_per_prompt
    dotted = {k: v for k, v in (("image", args.limit_mm_image), ("video", args.limit_mm_video)) if v is not None}
    if not dotted:
        return limits
    if limits is None:
        return dotted
    if not isinstance(limits, dict):
        return limits  # mm_limit_fields says what is wrong with it
    for modality, count in dotted.items():
        if limits.setdefault(modality, count) != count:
            raise ValueError(f"--limit-mm-per-prompt.{modality} {count} and --limit-mm-per-prompt "
                             f"{{\"{modality}\": {limits[modality]}}} disagree: give one")
    return limits


def max_logprobs(value: int) -> int:
    """`--max-logprobs` as the server applies it (-1: the engine's most); ValueError beyond the engine's most."""
    if value == -1:
        return ENGINE_MAX_LOGPROBS
    if not 0 <= value <= ENGINE_MAX_LOGPROBS:
        raise ValueError(f"--max-logprobs {value}: this engine returns at most {ENGINE_MAX_LOGPROBS} logprobs per "
                         f"token; give 0 to {ENGINE_MAX_LOGPROBS} (or -1 for {ENGINE_MAX_LOGPROBS})")
    return value


def vllm_server_fields(args: argparse.Namespace) -> dict[str, Any]:
    """The ServerSettings fields the vLLM request (and, for `serve`, HTTP) flags set."""
    if args.chat_template_content_format == "string":
        raise ValueError("--chat-template-content-format string: message contents reach the chat template as "
                         "OpenAI's lists of parts (the form the Qwen templates read); use auto or openai")
    if args.max_log_len is not None and args.max_log_len < 0:
        raise ValueError(f"--max-log-len must be >= 0, got {args.max_log_len}")
    fields: dict[str, Any] = dict(
        max_logprobs=max_logprobs(args.max_logprobs), max_log_len=args.max_log_len, trust_request_mm_kwargs=args.trust_request_mm_kwargs,
        override_generation_config=args.override_generation_config or {},
        return_tokens_as_token_ids=args.return_tokens_as_token_ids, log_requests=args.enable_log_requests,
        log_stats=not args.disable_log_stats, response_role=args.response_role,
        enable_force_include_usage=args.enable_force_include_usage)
    if hasattr(args, "allowed_origins"):  # serve's HTTP flags
        fields.update(allowed_origins=tuple(args.allowed_origins), allowed_methods=tuple(args.allowed_methods),
                      allowed_headers=tuple(args.allowed_headers), allow_credentials=args.allow_credentials)
    return fields


def announce_accepted(args: argparse.Namespace, command: str) -> None:
    """The log lines of flags accepted for vLLM's scripts that mean nothing here."""
    notes = []
    if args.trust_remote_code:
        notes.append("--trust-remote-code: accepted; vlmrun runs only its own model code, never code from a "
                     "checkpoint, so there is nothing to trust")
    if args.swap_space is not None:
        notes.append("--swap-space: accepted; vlmrun recomputes preempted requests and never swaps KV to the host")
    if getattr(args, "disable_fastapi_docs", False):
        notes.append("--disable-fastapi-docs: accepted; this server has no /docs or /redoc pages")
    for note in notes:
        print(f"vlmrun {command}: {note}", file=sys.stderr, flush=True)


def show_server_logs(log_requests: bool, log_stats: bool) -> None:
    """Print the request lines (--enable-log-requests) and the statistics line (unless --disable-log-stats) on
    stderr, as vLLM does; once per process (the loggers `vlmrun.server.requests`, `vlmrun.server.stats`)."""
    for name, on in (("vlmrun.server.requests", log_requests), ("vlmrun.server.stats", log_stats)):
        log = logging.getLogger(name)
        if on and not log.handlers:
            handler = logging.StreamHandler(sys.stderr)
            handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s %(name)s: %(message)s"))
            log.addHandler(handler)
            log.setLevel(logging.INFO)


def _json_dict(text: str) -> dict[str, Any]:
    value = _json(text)
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


def _json_list(text: str) -> list[str]:
    value = _json(text)
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise argparse.ArgumentTypeError(f'expected a JSON list of strings such as ["*"], got {text!r}')
    return value


def _json(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc.msg} ({text!r})") from None
