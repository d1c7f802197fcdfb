"""server/logprobs.py: the chat and legacy shapes, built from TokenLogprob lists."""

from __future__ import annotations

import json
import math

from vegaserve.engine.request import TokenLogprob
from vegaserve.server.logprobs import IMPOSSIBLE_LOGPROB, LegacyLogprobs, chat_logprobs, merge


def test_half_a_character_gets_a_replacement_text_and_its_exact_bytes(fake):
    tokenizer = fake.ByteTokenizer()
    ids = list("é".encode())  # two byte-tokens, neither a character alone
    shaped = chat_logprobs(tokenizer, [TokenLogprob(t, -1.0, []) for t in ids])
    assert [e.token for e in shaped.content] == ["\ufffd", "\ufffd"]
    assert bytes(b for e in shaped.content for b in e.bytes).decode() == "é"


def test_minus_infinity_is_sent_as_openais_minus_9999_in_both_shapes(fake):
    tokenizer = fake.ByteTokenizer()
    entry = TokenLogprob(97, -math.inf, [(97, -math.inf), (98, -2.0)])
    chat = json.loads(chat_logprobs(tokenizer, [entry]).model_dump_json())["content"][0]
    assert chat["logprob"] == IMPOSSIBLE_LOGPROB
    assert [a["logprob"] for a in chat["top_logprobs"]] == [IMPOSSIBLE_LOGPROB, -2.0]
    legacy = json.loads(LegacyLogprobs(tokenizer).add([97], [entry]).model_dump_json())
    assert legacy["token_logprobs"] == [IMPOSSIBLE_LOGPROB]
    assert legacy["top_logprobs"] == [{"a": IMPOSSIBLE_LOGPROB, "b": -2.0}]


def test_legacy_offsets_keep_running_across_parts_and_merge_concatenates(fake):
    tokenizer = fake.ByteTokenizer()
    builder = LegacyLogprobs(tokenizer)
    bos = fake.SPECIALS["<s>"]
    first = builder.add([bos, 104], [None, TokenLogprob(104, -1.0, [])])
    second = builder.add([105], [TokenLogprob(105, -2.0, [])])
    whole = merge([first, second])
    assert whole.tokens == ["<s>", "h", "i"]
    assert whole.text_offset == [0, len("<s>"), len("<s>h")]
    assert whole.token_logprobs == [None, -1.0, -2.0]
    assert whole.top_logprobs == [None, {}, {}]
