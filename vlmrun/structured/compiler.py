"""Compile structured-output specs with xgrammar, once each, and track one request's matcher.

`GrammarCompiler` is built per engine from its tokenizer, the width of the model's logits (which
may exceed the tokenizer's vocabulary: padded embeddings; the extra ids are never allowed) and the
EOS ids that end a grammar. `compile(spec)` returns the compiled grammar for the spec's text,
compiling it on first use; an LRU keyed by (kind, text, whitespace flag) keeps it, bounded by
`cache_size` entries and by `cache_bytes` of compiled grammars (xgrammar's own size count: a
100k-choice enum compiles to hundreds of MB, so a count alone bounds nothing). The grammar is also
pinned to the spec object it was compiled for (while that object lives: a weak reference), so the
engine thread never compiles again a grammar the server compiled, however soon the cache evicts it. `compile` is safe to call from any thread (the server compiles in its thread pool, so
the engine thread finds the grammar cached): the lock guards only the cache, a grammar compiles
outside it, once, and a thread asking for a grammar still compiling waits for that one.

JSON schemas pass through `strict_json_strings` first: xgrammar (0.2.8) writes a string with
`minLength` / `maxLength` as "any characters but quote, backslash, CR, LF", which lets raw control
characters into the JSON (which `json.loads` then refuses); such strings get an equivalent
`pattern` instead (found by the property tests).

`GrammarState` is one request's position in its grammar: `fill_bitmask` writes the allowed next
tokens into a row of an int32 bitmask `[batch, ceil(vocab / 32)]` (bit j of word w allows token
`32 w + j`), `accept` advances by a sampled token, `is_terminated` is true once the grammar ended
with an EOS token, `checkpoint` / `restore` undo the steps taken in between (xgrammar's rollback: the
verify pass of speculative decoding advances the request's own matcher over the drafts, then back).
Only the engine thread touches a state.
"""

from __future__ import annotations

import json
import re
import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import torch

from vlmrun.structured.params import StructuredOutputError, StructuredOutputsParams

DEFAULT_CACHE_BYTES = 256 * 1024 * 1024  # compiled grammars the cache may hold
_CPP_PREFIX = re.compile(r"^\[[\d:]+\]\s+\S+:\d+:\s*")  # "[07:00:00] /project/cpp/x.cc:83: " in xgrammar errors
ANY_JSON_OBJECT = '{"type": "object"}'


def bitmask_words(vocab_size: int) -> int:
    """int32 words per bitmask row for `vocab_size` tokens."""
    return (vocab_size + 31) // 32


class GrammarState:
    """One request's grammar matcher (see the module docstring)."""

    def __init__(self, matcher: Any, vocab_size: int):
        self._matcher = matcher
        self.vocab_size = vocab_size
        self._num_steps = 0  # tokens and strings accepted: what `restore` rolls back to a checkpoint

    def filled(self) -> "FilledBitmask":
        """The tokens allowed next, as a plain bitmask row (what a tensor-parallel rank samples with:
        the matcher itself stays with the engine)."""
        words = torch.full((1, bitmask_words(self.vocab_size)), -1, dtype=torch.int32)
        self.fill_bitmask(words, 0)
        return FilledBitmask(words[0])

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the tokens allowed next into `bitmask[row]` (int32, CPU)."""
        self._matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, token_id: int) -> bool:
        """Advance by `token_id`; False (state unchanged) when the grammar does not allow it."""
        return self._stepped(self._matcher.accept_token(token_id))

    def accept_string(self, text: str) -> bool:
        """Advance by `text` (not a token: what a reasoning-closing token carried past `</think>`; one step)."""
        return self._stepped(self._matcher.accept_string(text))

    def checkpoint(self) -> int:
        """This state, for `restore` (speculative decoding walks the request's own matcher over drafts)."""
        return self._num_steps

    def restore(self, checkpoint: int) -> None:
        """Back to the state at `checkpoint`: the steps accepted since are rolled back."""
        if self._num_steps > checkpoint:
            self._matcher.rollback(self._num_steps - checkpoint)
            self._num_steps = checkpoint

    def _stepped(self, accepted: bool) -> bool:
        self._num_steps += bool(accepted)
        return bool(accepted)

    @property
    def constraining(self) -> bool:
        """Always: a bare grammar masks every step (a `ReasoningGate` may not)."""
        return True

    @property
    def is_terminated(self) -> bool:
        return bool(self._matcher.is_terminated())


@dataclass(frozen=True)
class FilledBitmask:
    """A next-token bitmask filled from a `GrammarState`; it fills a sampler row as the state would."""

    words: torch.Tensor  # [ceil(vocab / 32)] int32

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        n = min(bitmask.shape[1], self.words.shape[0])
        bitmask[row].zero_()  # words past the grammar's vocabulary (padded logits): nothing allowed
        bitmask[row, :n] = self.words[:n]


@dataclass
class _Entry:
    """A cache slot: the compiled grammar once `done` is set (or the error, which is not kept)."""

    done: threading.Event = field(default_factory=threading.Event)
    grammar: Any = None
    error: Optional[StructuredOutputError] = None
    size: int = 0  # bytes, counted in the cache's total once compiled


class GrammarCompiler:
    """Specs -> compiled grammars for one tokenizer (see the module docstring)."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int], cache_size: int = 256,
                 cache_bytes: int = DEFAULT_CACHE_BYTES):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = list(stop_token_ids)
        self.cache_size = cache_size
        self.cache_bytes = cache_bytes
        self._bytes = 0  # of the compiled grammars in the cache
        self._lock = threading.Lock()
        self._compiler: Any = None  # xgrammar.GrammarCompiler, made on first use
        self._cache: OrderedDict[tuple, _Entry] = OrderedDict()
        # id(spec) -> (a weak reference to it, its cache key when compiled, the grammar): `_pin`
        self._pins: dict[int, tuple[Any, tuple, Any]] = {}

    def compile(self, spec: StructuredOutputsParams) -> Any:
        """The compiled grammar of `spec` (cached); StructuredOutputError when it does not compile."""
        key = spec.cache_key
        pinned = self._pinned(spec, key)
        if pinned is not None:
            return pinned
        with self._lock:
            entry = self._cache.get(key)
            owner = entry is None
            if owner:
                entry = self._cache[key] = _Entry()
                self._evict()
                if self._compiler is None:
                    self._compiler = self._xgrammar_compiler()
            else:
                self._cache.move_to_end(key)
        if owner:
            try:
                entry.grammar = self._compile(spec)
                with self._lock:
                    if self._cache.get(key) is entry:
                        entry.size = _grammar_bytes(entry.grammar)
                        self._bytes += entry.size
                        self._evict()
            except StructuredOutputError as exc:
                entry.error = exc
                with self._lock:
                    if self._cache.get(key) is entry:
                        del self._cache[key]
            finally:
                entry.done.set()
        entry.done.wait()
        if entry.error is not None:
            raise entry.error
        self._pin(spec, key, entry.grammar)
        return entry.grammar

    def is_cached(self, spec: StructuredOutputsParams) -> bool:
        """Whether `compile(spec)` returns at once (pinned, or compiled and cached)."""
        key = spec.cache_key
        if self._pinned(spec, key) is not None:
            return True
        with self._lock:
            entry = self._cache.get(key)
        return entry is not None and entry.done.is_set() and entry.error is None

    def _pinned(self, spec: StructuredOutputsParams, key: tuple) -> Any:
        """The grammar pinned to this very spec object, unless its constraint changed since."""
        pin = self._pins.get(id(spec))
        if pin is None or pin[0]() is not spec or pin[1] != key:
            return None
        return pin[2]

    def _pin(self, spec: StructuredOutputsParams, key: tuple, grammar: Any) -> None:
        """Keep `grammar` for `spec` while the spec object lives (the request holding it uses it)."""
        ident = id(spec)
        if ident not in self._pins:
            weakref.finalize(spec, self._pins.pop, ident, None)
        self._pins[ident] = (weakref.ref(spec), key, grammar)

    @property
    def cached_bytes(self) -> int:
        """Bytes of the compiled grammars the cache holds."""
        return self._bytes

    def limit_bytes(self, cache_bytes: int) -> None:
        """Keep at most `cache_bytes` of compiled grammars from now on (evicting what is past it now)."""
        if cache_bytes < 1:
            raise ValueError("the grammar cache needs cache_bytes >= 1")
        with self._lock:
            self.cache_bytes = cache_bytes
            self._evict()

    def _evict(self) -> None:
        """Drop the least recently used entries past `cache_size` entries or `cache_bytes` (the newest
        entry stays, whatever its size: the request that asked for it holds it anyway). Under the lock."""
        while len(self._cache) > 1 and (len(self._cache) > self.cache_size or self._bytes > self.cache_bytes):
            _, old = self._cache.popitem(last=False)
            self._bytes -= old.size

    def new_state(self, spec: StructuredOutputsParams) -> GrammarState:
        """A fresh matcher at the start of `spec`'s grammar."""
        import xgrammar

        return GrammarState(xgrammar.GrammarMatcher(self.compile(spec)), self.vocab_size)

    @property
    def num_cached(self) -> int:
        return len(self._cache)

    def _compile(self, spec: StructuredOutputsParams) -> Any:
        compiler = self._compiler
        kind, whitespace = spec.kind, not spec.disable_any_whitespace
        try:
            if kind == "json":
                return compiler.compile_json_schema(strict_json_strings(spec.source), any_whitespace=whitespace)
            if kind == "json_object":
                return compiler.compile_json_schema(ANY_JSON_OBJECT, any_whitespace=whitespace)
            if kind == "regex":
                return compiler.compile_regex(spec.regex)
            if kind == "choice":
                return compiler.compile_grammar(choice_grammar(spec.choice))
            return compiler.compile_grammar(spec.grammar)
        except Exception as exc:  # xgrammar raises RuntimeError / its own errors with C++ locations
            raise StructuredOutputError(f"the {kind} does not compile: {_clean(exc)}") from None

    def _xgrammar_compiler(self) -> Any:
        import xgrammar

        info = xgrammar.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size,
                                                       stop_token_ids=self.stop_token_ids or None)
        return xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)


_DATA_KEYS = frozenset({"const", "default", "enum", "examples"})  # values that are data, not schemas
_LENGTH_KEYS = ("minLength", "maxLength")


def strict_json_strings(schema_text: str) -> str:
    """`schema_text` with each length-limited plain string schema given a `pattern` that excludes
    control characters (see the module docstring); text that is not JSON is returned as is."""
    try:
        schema = json.loads(schema_text)
    except ValueError:
        return schema_text  # xgrammar reports it
    changed = [False]

    def visit(node: Any) -> None:
        if isinstance(node, list):
            for item in node:
                visit(item)
        elif isinstance(node, dict):
            if (node.get("type") == "string" and any(k in node for k in _LENGTH_KEYS)
                    and not {"pattern", "format", "enum", "const"} & set(node)):
                lo, hi = node.pop("minLength", 0), node.pop("maxLength", "")
                node["pattern"] = f'^[^"\\\\\\x00-\\x1f]{{{lo},{hi}}}$'
                changed[0] = True
            for key, value in node.items():
                if key not in _DATA_KEYS:
                    visit(value)

    visit(schema)
    return json.dumps(schema, ensure_ascii=False) if changed[0] else schema_text


def choice_grammar(choices: Sequence[str]) -> str:
    """EBNF for exactly one of `choices` (JSON string escapes are xgrammar's string escapes)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def _grammar_bytes(grammar: Any) -> int:
    """The compiled grammar's size as xgrammar counts it (its token masks dominate)."""
    try:
        return int(grammar.memory_size_bytes)
    except (AttributeError, TypeError, ValueError):  # an older xgrammar: counted as one byte
        return 1


def _clean(exc: BaseException) -> str:
    text = re.sub(r"Check failed: \(.*?\) is false:\s*", "", str(exc)).strip()
    lines = [_CPP_PREFIX.sub("", line) for line in text.splitlines() if line.strip()]
    return " ".join(lines)[:500] or type(exc).__name__
