"""What a GGUF's `tokenizer.ggml.*` metadata says about its vocabulary, checked and normalized.

Lists of the wrong type or length, ids that are not integers and merges that are not two tokens raise
ValueError naming the key, so a damaged file is refused in one line; defaults are filled as llama.cpp fills
them. engine/tokenizer.py builds the `tokenizers.Tokenizer` from the result.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from vegaserve.engine.pre_tokenizers import PRE_FAMILIES

log = logging.getLogger("vegaserve.engine.tokenizer")

# gguf.TokenType values, as stored in tokenizer.ggml.token_type.
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# Token texts that end a turn or the text (llama.cpp's end-of-generation names, less its FIM tokens,
# which only end fill-in-the-middle completions).
_END_OF_TURN_NAMES = frozenset((
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<end_of_turn>", "<|endoftext|>",
    "<|eom_id|>", "<EOT>", "<|end_of_text|>", "<end_of_utterance>", "<｜end▁of▁sentence｜>", "<eos>",
))  # fmt: skip


def spm_merges(tokens: list[str], scores: list[float], types: list[int]) -> list[tuple[str, str]]:
    """Every (left, right) split of a normal token into two normal tokens, best merged score first: BPE
    then applies the best-scoring available merge first, as llama.cpp's SentencePiece loop does."""
    score_of = {t: s for t, s, ty in zip(tokens, scores, types) if ty == NORMAL and t}
    ranked: list[tuple[float, int, str, str]] = []
    for piece, score in score_of.items():
        for k in range(1, len(piece)):
            left, right = piece[:k], piece[k:]
            if left in score_of and right in score_of:
                ranked.append((-score, k, left, right))
    ranked.sort()
    return [(left, right) for _, _, left, right in ranked]


@dataclass(frozen=True)
class Vocab:
    """What the metadata says, normalized: lists as Python lists, defaults as llama.cpp fills them."""

    model: str
    tokens: list[str]
    types: list[int]
    bos_id: int | None
    eos_id: int | None
    unk_id: int | None
    add_bos: bool
    add_eos: bool
    add_space_prefix: bool
    eot_ids: tuple[int, ...]


def read_vocab(md: Mapping[str, Any]) -> Vocab:
    model = md.get("tokenizer.ggml.model")
    if model not in ("gpt2", "llama"):
        raise ValueError(
            f"unsupported tokenizer.ggml.model {model!r}; supported: 'gpt2' (BPE), 'llama' (SentencePiece)"
        )
    tokens = list_of(md, "tokenizer.ggml.tokens", str)
    n = len(tokens)
    if not n:
        raise ValueError("tokenizer.ggml.tokens: the vocabulary is empty")
    types = list_of(md, "tokenizer.ggml.token_type", int, [NORMAL] * n)
    if len(types) < n:
        raise ValueError(f"tokenizer.ggml.token_type has {len(types)} entries for {n} tokens")

    def token_id(key: str, default: int | None) -> int | None:
        # An id outside the vocab is ignored, as llama.cpp does (with a warning there too).
        value = md.get(f"tokenizer.ggml.{key}")
        if value is not None and type(value) is not int:
            raise ValueError(f"tokenizer.ggml.{key}: expected a token id, got {value!r}")
        for v in (value, default):
            if v is not None and 0 <= v < n:
                return v
        return None

    spm = model == "llama"
    bos, eos = token_id("bos_token_id", 1 if spm else None), token_id("eos_token_id", 2 if spm else None)
    # Defaults as llama.cpp's: SentencePiece and the llama3 family add BOS unless the metadata says not.
    llama3 = PRE_FAMILIES.get(_pre_value(md), ("",))[0] == "llama3"
    add_bos = bool(md.get("tokenizer.ggml.add_bos_token", spm or llama3))
    add_eos = bool(md.get("tokenizer.ggml.add_eos_token", False))
    for flag, tid, what in ((add_bos, bos, "bos"), (add_eos, eos, "eos")):
        if flag and tid is None:
            raise ValueError(f"tokenizer.ggml.add_{what}_token is true but tokenizer.ggml.{what}_token_id is not set")
    eot = tuple(i for i in (token_id("eot_token_id", None), token_id("eom_token_id", None)) if i is not None)
    return Vocab(
        model=model,
        tokens=tokens,
        types=types[:n],
        bos_id=bos,
        eos_id=eos,
        unk_id=token_id("unknown_token_id", 0 if spm else None),
        add_bos=add_bos,
        add_eos=add_eos,
        # BPE vocabularies never prefix a space (llama.cpp ignores the key for them).
        add_space_prefix=spm and bool(md.get("tokenizer.ggml.add_space_prefix", True)),
        eot_ids=eot,
    )


def list_of(md: Mapping[str, Any], key: str, kind: type, default: list[Any] | None = None) -> list[Any]:
    """The metadata list at `key`, every element a `kind` (ints also where floats are asked for)."""
    value = md.get(key, default)
    if value is None:
        raise ValueError(f"{key} is missing")
    kinds = (int, float) if kind is float else (kind,)
    if not isinstance(value, list) or not all(type(v) in kinds for v in value):
        raise ValueError(f"{key}: expected a list of {kind.__name__} values")
    return value


def _pre_value(md: Mapping[str, Any]) -> str:
    return str(md.get("tokenizer.ggml.pre") or "")


def gpt2_pre_family(md: Mapping[str, Any]) -> tuple[str, bool]:
    """(regex family, ignore_merges) for the metadata's `pre` value."""
    pre = _pre_value(md)
    if not pre:
        log.warning(
            "GGUF has no tokenizer.ggml.pre; using the 'default' pre-tokenizer (tokens may differ from the "
            "model's training; consider re-converting the model)"
        )
        pre = "default"
    if pre not in PRE_FAMILIES:
        raise ValueError(f"unknown tokenizer.ggml.pre {pre!r}; supported: {', '.join(sorted(PRE_FAMILIES))}")
    return PRE_FAMILIES[pre]


def gpt2_merges(md: Mapping[str, Any]) -> list[tuple[str, str]]:
    if "tokenizer.ggml.merges" not in md:
        raise ValueError("a gpt2 (BPE) vocabulary needs tokenizer.ggml.merges, which this GGUF lacks")
    merges = []
    for i, m in enumerate(list_of(md, "tokenizer.ggml.merges", str)):
        cut = m.find(" ", 1)  # from 1: a merge's left part may itself be a space
        if cut < 0:
            raise ValueError(f"tokenizer.ggml.merges entry {i} ({m!r}) is not two tokens joined by a space")
        merges.append((m[:cut], m[cut + 1 :]))
    return merges


def stop_ids(v: Vocab) -> frozenset[int]:
    """EOS, the metadata's eot/eom ids, and every token named like an end of turn (`<|im_end|>`,
    `<|eot_id|>`, `<|endoftext|>`, ...) whatever its type: llama.cpp treats such a token typed normal as a
    conversion bug and forces it to control, and so do we (`_effective_types`). When a vocab has both
    `<|return|>` and `<|call|>` (gpt-oss's harmony format), `<|end|>` only closes a message, not the turn."""
    named = {i for i, t in enumerate(v.tokens) if t in _END_OF_TURN_NAMES}
    texts = {v.tokens[i] for i in named}
    if {"<|return|>", "<|call|>"} <= texts:
        named = {i for i in named if v.tokens[i] != "<|end|>"}
    return frozenset(named | set(v.eot_ids) | ({v.eos_id} if v.eos_id is not None else set()))


def effective_types(v: Vocab, stop_ids: frozenset[int]) -> list[int]:
    types = list(v.types)
    for i in stop_ids:
        if types[i] in (NORMAL, UNUSED):
            types[i] = CONTROL
    return types
