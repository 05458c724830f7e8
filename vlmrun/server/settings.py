"""`ServerSettings`: the knobs of the HTTP layer (the engine's own live in `EngineConfig`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from vlmrun.generation_config import SAMPLING_FIELDS
from vlmrun.lora.request import LoRARequest

MiB = 1 << 20
# vLLM's --tool-call-parser names for the Qwen formats this server reads (`tool_calls.read_call` reads
# both bodies whichever is named): hermes (Qwen2.5 / Qwen3 JSON calls), qwen3_coder and qwen3_xml
# (Qwen3-Coder / Qwen3.5 XML-style calls).
TOOL_CALL_PARSERS = ("hermes", "qwen3_coder", "qwen3_xml")


@dataclass
class ServerSettings:
    """served_model_name: the id clients put in `model` (and /v1/models lists), reported in answers and
        in the metrics' `model_name` label; served_model_aliases: further ids that name the same model
        (vLLM's `--served-model-name a b c`: all accepted, the first reported).
    api_key: when set, every /v1 route needs `Authorization: Bearer <api_key>` (/health and
        /metrics stay open).
    max_request_bytes: request bodies above this get 413 (base64 images make bodies large).
    max_queued_requests: engine requests that may wait beyond the `max_num_seqs` that run;
        more get 429. Counted from admission (before preprocessing) to the end of the request.
    max_n: the largest `n` (choices per request) accepted.
    preprocess_workers: threads that parse bodies, fetch and preprocess images.
    allow_remote_urls / allow_private_urls: http(s) image URLs are fetched by the server; by
        default only to public addresses (private, loopback, link-local and reserved ones are
        refused unless allow_private_urls).
    allowed_local_media_path: a directory whose image files clients may name by path or
        file:// URI; None refuses all local paths.
    url_timeout_s / max_image_bytes / max_url_redirects: bounds on one image fetch.
    reasoning_parser: "qwen3" splits a chat answer's `<think>…</think>` into `reasoning_content`
        (only answers that start thinking, or whose prompt ends in `<think>`), and lets a constrained
        chat answer think before its constraint holds (`after_reasoning`); None leaves it in `content`
        and constrains from the first token.
    max_video_bytes: the byte bound of one video (same URL and path policy as images).
    enable_auto_tool_choice / tool_call_parser: vLLM's flags. A chat request with `tools` whose
        `tool_choice` is "auto" (the default with tools) is a 400 unless enable_auto_tool_choice is on;
        then the answer's tool calls are parsed into `tool_calls`. enable_auto_tool_choice needs a
        tool_call_parser, one of TOOL_CALL_PARSERS. "required", a named function and "none" need neither.
    lora_modules: LoRA adapters by name (vLLM's --lora-modules): a request's `model` naming one runs it;
        /v1/models lists them with the served model as parent.
    max_grammar_chars / max_grammar_choices: the largest output constraint a request may send (its text;
        a `choice`'s strings), refused with a 400 before it compiles (`vlmrun.structured.GrammarLimits`).
    grammar_workers / max_pending_grammars / grammar_timeout_s: the threads compiling constraints (their
        own: never the pools that parse and tokenize), how many compiles may be queued or running (one
        more is a 429), how long a client waits for its compile (then a 400) (`grammar_pool.py`).
    vLLM's flags (`vllm_flags.py`): max_logprobs (a request's logprobs / top_logprobs / prompt_logprobs
        above it: 400), trust_request_mm_kwargs (without it a request's own `mm_processor_kwargs` is a 400),
        override_generation_config (generation_config.json names over the checkpoint's sampling
        defaults), return_tokens_as_token_ids (the default of the request field), log_requests (a log line
        per request), log_stats (a periodic engine statistics line), enable_force_include_usage (streams end
        with a usage chunk even without stream_options), response_role (vLLM's --response-role), and the CORS lists
        (allowed_origins / allowed_methods / allowed_headers, allow_credentials; vLLM's defaults).
    grammar_cache_bytes: the compiled grammars the engine's cache keeps (xgrammar's own size count;
        least recently used first out), set on the engine's `GrammarCompiler` when the server starts.
    """

    served_model_name: str
    api_key: Optional[str] = None
    max_request_bytes: int = 64 * MiB
    max_queued_requests: int = 1024
    max_n: int = 16
    preprocess_workers: int = 4
    allow_remote_urls: bool = True
    allow_private_urls: bool = False
    allowed_local_media_path: Optional[str] = None
    url_timeout_s: float = 10.0
    max_image_bytes: int = 20 * MiB
    max_url_redirects: int = 3
    reasoning_parser: Optional[str] = "qwen3"
    max_video_bytes: int = 200 * MiB
    enable_auto_tool_choice: bool = False
    tool_call_parser: Optional[str] = None
    trust_request_chat_template: bool = False
    lora_modules: dict[str, str] = field(default_factory=dict)  # --lora-modules: adapter name -> PEFT folder
    max_grammar_chars: int = 64 * 1024
    max_grammar_choices: int = 1024
    grammar_workers: int = 2
    max_pending_grammars: int = 8
    grammar_timeout_s: float = 30.0
    served_model_aliases: tuple[str, ...] = ()
    max_logprobs: int = 20
    trust_request_mm_kwargs: bool = False
    override_generation_config: dict[str, Any] = field(default_factory=dict)
    return_tokens_as_token_ids: bool = False
    log_requests: bool = False
    enable_force_include_usage: bool = False  # every streamed answer ends with its usage chunk
    response_role: str = "assistant"  # the role of a chat answer that a generation prompt opens
    max_log_len: Optional[int] = None  # characters of a logged request's prompt text (None: all)
    log_stats: bool = True
    log_stats_interval_s: float = 10.0
    allowed_origins: tuple[str, ...] = ("*",)
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False

    @property
    def served_model_names(self) -> tuple[str, ...]:
        """Every id of the base model, the reported one first."""
        return (self.served_model_name, *self.served_model_aliases)

    def sampling_overrides(self) -> dict[str, Any]:
        """`override_generation_config` as SamplingParams fields (max_new_tokens -> max_tokens)."""
        return {SAMPLING_FIELDS[name]: value for name, value in self.override_generation_config.items()}
    grammar_cache_bytes: int = 256 * MiB

    def lora_request(self, name: str) -> LoRARequest:
        """The `LoRARequest` of a `--lora-modules` adapter (ids 1, 2, ... in the order given)."""
        return LoRARequest(name, list(self.lora_modules).index(name) + 1, self.lora_modules[name],
                           base_model_name=self.served_model_name)

    def __post_init__(self) -> None:
        for name in ("max_request_bytes", "max_n", "preprocess_workers", "max_image_bytes", "max_video_bytes",
                     "max_grammar_chars", "max_grammar_choices", "grammar_workers", "max_pending_grammars",
                     "grammar_cache_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"ServerSettings.{name} must be >= 1")
        unknown = sorted(set(self.override_generation_config) - set(SAMPLING_FIELDS))
        if unknown:
            raise ValueError(f"override_generation_config (--override-generation-config): unknown key(s) "
                             f"{', '.join(unknown)}; the sampling defaults it can set are {', '.join(SAMPLING_FIELDS)}")
        if self.max_logprobs < 0:
            raise ValueError("ServerSettings.max_logprobs must be >= 0")
        if self.log_stats_interval_s <= 0:
            raise ValueError("ServerSettings.log_stats_interval_s must be > 0")
        if self.max_queued_requests < 0:
            raise ValueError("ServerSettings.max_queued_requests must be >= 0")
        if self.reasoning_parser not in (None, "qwen3"):
            raise ValueError("ServerSettings.reasoning_parser must be 'qwen3' or None")
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ValueError(f"unknown tool call parser {self.tool_call_parser!r}; this server implements "
                             f"{', '.join(TOOL_CALL_PARSERS)}")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("enable_auto_tool_choice (--enable-auto-tool-choice) needs a tool_call_parser "
                             f"(--tool-call-parser {' | '.join(TOOL_CALL_PARSERS)})")
        if self.grammar_timeout_s <= 0:
            raise ValueError("ServerSettings.grammar_timeout_s must be > 0")
        if self.url_timeout_s <= 0:
            raise ValueError("ServerSettings.url_timeout_s must be > 0")
        if self.api_key is not None and not (self.api_key.isascii() and self.api_key.isprintable()
                                             and self.api_key.strip() == self.api_key and self.api_key):
            # HTTP headers carry latin-1 at most and clients send ASCII: any other key could never match
            raise ValueError("ServerSettings.api_key must be printable ASCII without surrounding spaces")
