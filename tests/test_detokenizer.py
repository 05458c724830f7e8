"""Tests for incremental detokenization, stop strings and finish rules (tiny byte-level BPE)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from vlmrun.engine.detokenizer import (
    IncrementalDetokenizer,
    OutputTextStream,
    StopDecision,
    check_stop,
    find_stop_string,
    safe_length,
)
from vlmrun.sampling_params import SamplingParams

TEXTS = [
    "The image shows a red cat that is sitting on the left.",
    "Emoji test: 😀 🐱 🚗 🌳 🍕 ❤️ 👍 and more 🦀🦀!",
    "東京の夜景はとても綺麗です。日本語のテキスト",
    "Ünïcödé: Straße, façade, crème brûlée — “quotes” … ok",
    "def f(x):\n    return x * 2\n\n\nLine two.",
]


@pytest.fixture(scope="module")
def tokenizer(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The shared tiny tokenizer (conftest's `tiny_tokenizer_dir` when present)."""
    try:
        path = Path(request.getfixturevalue("tiny_tokenizer_dir"))
    except pytest.FixtureLookupError:
        from testing.tiny_models import build_tiny_tokenizer

        path = tmp_path_factory.mktemp("tiny_tokenizer")
        build_tiny_tokenizer(path)
    return AutoTokenizer.from_pretrained(str(path))


@pytest.fixture(scope="module")
def prompt_ids(tokenizer: Any) -> list[int]:
    text = "<|im_start|>user\nDescribe the image.<|im_end|>\n<|im_start|>assistant\n"
    return tokenizer.encode(text, add_special_tokens=False)


def _byte_tokens(tokenizer: Any, text: str) -> list[int]:
    """One token per UTF-8 byte, so every multi-byte character is split across tokens."""
    table = _byte_to_symbol()
    ids = [tokenizer.convert_tokens_to_ids(table[b]) for b in text.encode("utf-8")]
    assert all(isinstance(i, int) and i >= 0 for i in ids)
    return ids


def _byte_to_symbol() -> dict[int, str]:
    """The byte-level BPE alphabet: printable Latin-1 bytes map to themselves, the rest to 256+."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _stream(tokenizer: Any, prompt: list[int], ids: list[int], skip: bool = True) -> list[str]:
    detok = IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens=skip)
    deltas = [detok.append(t) for t in ids]
    deltas.append(detok.flush())
    assert "".join(deltas) == detok.text
    return deltas


def _run_stream(tokenizer: Any, prompt: list[int], ids: list[int], params: SamplingParams,
                eos: tuple[int, ...] = ()) -> tuple[OutputTextStream, list[str], StopDecision | None]:
    stream = OutputTextStream(tokenizer, prompt, params, list(eos))
    deltas = []
    for t in ids:
        update = stream.add_token(t)
        deltas.append(update.delta)
        if update.finish_reason is not None:
            break
    assert "".join(deltas) == stream.text
    return stream, deltas, stream.finished


# ------------------------------------------------------------------------------- detokenizer


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("skip", [True, False])
def test_deltas_concatenate_to_full_decode(tokenizer, prompt_ids, text, skip):
    ids = tokenizer.encode(text, add_special_tokens=False)
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    mid = next(i for i in range(len(ids) // 2, len(ids)) if not tokenizer.decode(ids[:i]).endswith("\ufffd"))
    ids = ids[:mid] + [im_end] + ids[mid:]  # a special token between two whole characters
    deltas = _stream(tokenizer, prompt_ids, ids, skip)
    assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=skip)
    assert all("\ufffd" not in d for d in deltas)


@pytest.mark.parametrize("text", ["😀", "a😀b🐱東京é", "❤️👍 日本語", "🦀" * 5])
def test_split_multibyte_characters_never_stream_replacement_char(tokenizer, prompt_ids, text):
    ids = _byte_tokens(tokenizer, text)
    assert tokenizer.decode(ids) == text
    deltas = _stream(tokenizer, prompt_ids, ids)
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == text
    assert deltas[0] == ("" if ord(text[0]) > 127 else text[0])  # first byte of a multi-byte char waits


def test_works_without_prompt(tokenizer):
    ids = tokenizer.encode(TEXTS[1], add_special_tokens=False)
    assert "".join(_stream(tokenizer, [], ids)) == TEXTS[1]


def test_flush_emits_incomplete_tail(tokenizer, prompt_ids):
    ids = _byte_tokens(tokenizer, "ok😀")[:-1]  # emoji cut short
    detok = IncrementalDetokenizer(tokenizer, prompt_ids)
    assert "".join(detok.append(t) for t in ids) == "ok"
    assert detok.num_pending_tokens == 3
    assert detok.flush() == tokenizer.decode(ids)[2:]
    assert detok.text == tokenizer.decode(ids)


class _CountingTokenizer:
    """Wraps a tokenizer and records the longest id list it was asked to decode."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.longest = 0

    def decode(self, ids: list[int], **kwargs: Any) -> str:
        self.longest = max(self.longest, len(ids))
        return self.inner.decode(ids, **kwargs)


def test_decode_window_stays_small(tokenizer, prompt_ids):
    counting = _CountingTokenizer(tokenizer)
    ids = tokenizer.encode(" ".join(TEXTS) * 4, add_special_tokens=False)
    assert len(ids) > 400
    detok = IncrementalDetokenizer(counting, prompt_ids)
    for t in ids:
        detok.append(t)
    assert detok.text == tokenizer.decode(ids)
    assert counting.longest <= 12


class _DecodeOnly:
    """The tokenizer's `decode` alone (no `tokenizers` backend): the detokenizer's window decode in Python."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def decode(self, ids: list[int], **kwargs: Any) -> str:
        return self.inner.decode(ids, **kwargs)


def _mixed_ids(tokenizer: Any, seed: int) -> list[int]:
    """Whole-word tokens, single bytes of multi-byte characters and special tokens, shuffled by `seed`."""
    import random

    rng = random.Random(seed)
    pool = tokenizer.encode(" ".join(TEXTS), add_special_tokens=False)
    pool += _byte_tokens(tokenizer, "é東😀")
    pool += [tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|im_start|>", "<|endoftext|>")]
    return [rng.choice(pool) for _ in range(120)]


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("skip", [True, False])
def test_decode_stream_equals_window_decode(tokenizer, prompt_ids, seed, skip):
    """The fast tokenizer's DecodeStream path streams exactly what the window decode streams."""
    ids = _mixed_ids(tokenizer, seed)
    fast = IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens=skip)
    slow = IncrementalDetokenizer(_DecodeOnly(tokenizer), prompt_ids, skip_special_tokens=skip)
    assert fast._stream is not None and slow._stream is None
    fast_deltas = [fast.append(t) for t in ids] + [fast.flush()]
    slow_deltas = [slow.append(t) for t in ids] + [slow.flush()]
    assert "".join(fast_deltas) == "".join(slow_deltas) == fast.text == slow.text
    assert [d for d in fast_deltas if d] == [d for d in slow_deltas if d]


def test_fast_tokenizer_streams_without_python_decode(tokenizer, prompt_ids, monkeypatch):
    """Per token, a fast tokenizer's text comes from its `tokenizers` backend: `tokenizer.decode` (transformers'
    Python wrapping) is not called on the way; the text is what it would decode."""
    ids = tokenizer.encode(" ".join(TEXTS), add_special_tokens=False)
    expected = tokenizer.decode(ids)
    detok = IncrementalDetokenizer(tokenizer, prompt_ids)
    calls = []
    monkeypatch.setattr(tokenizer, "decode", lambda *a, **k: calls.append(a) or "")
    for t in ids:
        detok.append(t)
    monkeypatch.undo()
    assert calls == []
    assert detok.text == expected


# ------------------------------------------------------------------------------- stop strings


def test_matcher_earliest_occurrence_wins():
    match = find_stop_string("xx bar foo", 10, ["foo", "bar"])
    assert (match.stop, match.start, match.truncate_to) == ("bar", 3, 3)
    assert find_stop_string("xx bar foo", 10, ["foo", "bar"], include_stop_str_in_output=True).truncate_to == 6
    # same start: the shorter (completes first) wins
    assert find_stop_string("zabc", 3, ["abc", "ab"]).stop == "ab"


def test_matcher_only_looks_at_occurrences_touching_new_text():
    assert find_stop_string("stop here", 4, ["stop"]) is None  # entirely in older text
    assert find_stop_string("xx sto", 3, ["stop"]) is None
    assert find_stop_string("xx stop", 1, ["stop"]).start == 3  # spans old and new text
    assert find_stop_string("ab|cd", 2, ["|c"]).truncate_to == 2


def test_matcher_safe_length_holds_back_partial_match():
    stops = ["</answer>", "###"]
    assert safe_length("hello </ans", stops) == len("hello ")
    assert safe_length("hello ##", stops) == len("hello ")
    assert safe_length("hello <", stops) == len("hello ")
    assert safe_length("hello", stops) == 5
    assert safe_length("a ##", ["###"], include_stop_str_in_output=True) == 4


def _pieces(tokenizer: Any, ids: list[int]) -> list[str]:
    return [tokenizer.decode([t]) for t in ids]


def test_stop_string_spanning_two_tokens(tokenizer, prompt_ids):
    text = "The answer is: yes. Maybe more text follows here."
    ids = tokenizer.encode(text, add_special_tokens=False)
    pieces = _pieces(tokenizer, ids)
    ends = [len("".join(pieces[:i + 1])) for i in range(len(pieces))]  # char offset after token i
    stop, cut = next((pieces[i - 1][-2:] + pieces[i][:2], ends[i - 1] - 2) for i in range(3, len(pieces))
                     if len(pieces[i - 1]) >= 2 and len(pieces[i]) >= 2
                     and text.index(pieces[i - 1][-2:] + pieces[i][:2]) == ends[i - 1] - 2)
    stream, deltas, fin = _run_stream(tokenizer, prompt_ids, ids, SamplingParams(stop=stop, max_tokens=200))
    assert fin == StopDecision("stop", stop)
    assert stream.text == text[:cut]
    # the stop's first half (end of token i-1) was held back while it could still become the stop
    assert "".join(deltas[:-1]) == text[:cut] and deltas[-1] == ""
    stream, _, _ = _run_stream(tokenizer, prompt_ids, ids,
                               SamplingParams(stop=stop, max_tokens=200, include_stop_str_in_output=True))
    assert stream.text == text[:cut + len(stop)]


def test_stop_string_at_the_very_start(tokenizer, prompt_ids):
    text = "Caption: a dog"
    ids = tokenizer.encode(text, add_special_tokens=False)
    stream, deltas, fin = _run_stream(tokenizer, prompt_ids, ids, SamplingParams(stop=["Cap"], max_tokens=50))
    assert stream.text == "" and all(d == "" for d in deltas)
    assert fin.finish_reason == "stop" and fin.stop_reason == "Cap"


def test_several_stop_strings_earliest_wins(tokenizer, prompt_ids):
    text = "There are 42 of them (7). The answer is: no."
    ids = tokenizer.encode(text, add_special_tokens=False)
    params = SamplingParams(stop=["answer", "of", "(7)"], max_tokens=100)
    stream, _, fin = _run_stream(tokenizer, prompt_ids, ids, params)
    assert stream.text == "There are 42 " and fin.stop_reason == "of"


def test_streamed_deltas_never_leak_stop_string(tokenizer, prompt_ids):
    text = "Line one.\nLine two.\n\n###\nParagraph three."
    ids = _byte_tokens(tokenizer, text)  # one char per token: the partial match forms slowly
    stream, deltas, fin = _run_stream(tokenizer, prompt_ids, ids, SamplingParams(stop="\n###\n", max_tokens=500))
    assert stream.text == "Line one.\nLine two.\n"
    assert "#" not in "".join(deltas)
    # the held-back "\n" after "two." came out only when the match finished
    assert fin.stop_reason == "\n###\n"


def test_partial_match_that_fails_is_released(tokenizer, prompt_ids):
    text = "a ## b ### c"
    ids = _byte_tokens(tokenizer, text)
    stream, deltas, fin = _run_stream(tokenizer, prompt_ids, ids, SamplingParams(stop="####", max_tokens=12))
    assert fin.finish_reason == "length"
    assert "".join(deltas) == text == stream.text


def test_eos_and_stop_token_ids_end_without_their_text(tokenizer, prompt_ids):
    ids = tokenizer.encode("a red cat", add_special_tokens=False)
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    stream, _, fin = _run_stream(tokenizer, prompt_ids, ids + [im_end, 5], SamplingParams(max_tokens=50),
                                 eos=(im_end,))
    assert fin == StopDecision("stop", None) and stream.text == "a red cat"
    stop_id = ids[-1]
    params = SamplingParams(max_tokens=50, stop_token_ids=[stop_id], skip_special_tokens=False)
    stream, _, fin = _run_stream(tokenizer, prompt_ids, ids, params, eos=(im_end,))
    assert fin == StopDecision("stop", stop_id)
    assert stream.text == tokenizer.decode(ids[:-1])
    params = SamplingParams(max_tokens=50, stop_token_ids=[stop_id], include_stop_str_in_output=True)
    stream, _, _ = _run_stream(tokenizer, prompt_ids, ids, params, eos=(im_end,))
    assert stream.text == "a red cat"


def test_max_tokens_finishes_with_length_and_flushes(tokenizer, prompt_ids):
    ids = _byte_tokens(tokenizer, "hi😀😀")
    stream, deltas, fin = _run_stream(tokenizer, prompt_ids, ids, SamplingParams(max_tokens=4))
    assert fin == StopDecision("length")
    assert stream.text == tokenizer.decode(ids[:4])  # "hi" + two bytes of the emoji (flushed)
    assert len(stream.output_token_ids) == 4


def test_min_tokens_delays_stop_strings(tokenizer, prompt_ids):
    ids = _byte_tokens(tokenizer, "ab.cd.ef")
    stream, _, fin = _run_stream(tokenizer, prompt_ids, ids, SamplingParams(stop=".", min_tokens=4, max_tokens=20))
    assert stream.text == "ab.cd" and fin.stop_reason == "."


# ------------------------------------------------------------------------------- check_stop


def test_check_stop_rules():
    eos = [9]
    p = SamplingParams(max_tokens=5, stop_token_ids=[4])
    assert check_stop([], p, eos) is None
    assert check_stop([1, 2], p, eos) is None
    assert check_stop([1, 9], p, eos) == StopDecision("stop")
    assert check_stop([1, 4], p, eos) == StopDecision("stop", 4)
    assert check_stop([1, 2, 3, 5, 6], p, eos) == StopDecision("length")
    assert check_stop([1, 2, 3, 5, 9], p, eos) == StopDecision("stop")  # EOS beats length
    assert check_stop([1, 9], SamplingParams(ignore_eos=True), eos) is None
    assert check_stop([1, 9], SamplingParams(min_tokens=2), eos) is None
    assert check_stop([1, 2, 9], SamplingParams(min_tokens=2), eos) == StopDecision("stop")
    assert check_stop([1, 2, 3], SamplingParams(max_tokens=None), eos, num_prompt_tokens=7,
                      max_model_len=10) == StopDecision("length")
    assert check_stop([1, 2, 3], SamplingParams(max_tokens=None), eos) is None
