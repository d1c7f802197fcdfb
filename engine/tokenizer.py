"""The tokenizer of a GGUF model, built from its `tokenizer.ggml.*` metadata as a `tokenizers.Tokenizer`.

Two vocabulary kinds (`tokenizer.ggml.model`):
  gpt2   byte-level BPE: vocab + ranked merges; the text is first cut into words by the regex(es) of the
         `tokenizer.ggml.pre` value (the same ones llama.cpp uses), then each word's UTF-8 bytes are mapped
         to printable characters (GPT-2's byte alphabet) and merged.
  llama  SentencePiece: tokens + scores. llama.cpp merges, greedily, the adjacent pair whose union is the
         best-scoring token; a BPE whose merge ranks follow the score of the merged piece does the same.
         Spaces become '▁', a '▁' is prepended to every text run when `add_space_prefix` says so, and
         characters the vocab lacks fall back to their `<0xNN>` byte tokens.

Unknown `model` or `pre` values raise ValueError naming them: a wrong pre-tokenizer does not fail, it
silently changes every prompt's tokens, which we prefer to refuse loudly. A missing `pre` (old
conversions) means 'default', with a warning, as in llama.cpp.

Encoding goes through `tokenizers`; decoding is ours: each id maps to the exact bytes it stands for
(`token_bytes`), so decode, streaming and the byte-level/byte-fallback cases share one table.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from tokenizers import AddedToken, Regex, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

log = logging.getLogger(__name__)

# gguf.TokenType values, as stored in tokenizer.ggml.token_type.
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# Contractions are spelled with explicit case classes rather than (?i:...) so that Unicode case folding
# (e.g. the long s 'ſ' folding to 's') cannot make them match more than llama.cpp's do.
_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
# gpt-4o as in its tokenizer.json. llama.cpp emulates \p{Lu}/\p{Ll} with [^a-z]/[^A-Z] because std::regex
# lacks them, which groups non-ASCII letters differently; onig has the real classes, so we use them.
_UPPERS, _LOWERS = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]", r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]"
_GPT4O = (
    rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPERS}*{_LOWERS}+{_CONTRACTIONS}?"
    rf"|[^\r\n\p{{L}}\p{{N}}]?{_UPPERS}+{_LOWERS}*{_CONTRACTIONS}?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# Each family is a chain of regexes applied in turn, each cutting the pieces of the one before; text a
# regex does not match stays a piece of its own (llama.cpp's unicode_regex_split, Split "isolated").
PRE_TOKENIZER_REGEXES: dict[str, tuple[str, ...]] = {
    "default": (r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"),
    "gpt2": (_GPT2,),
    "starcoder": (r"\p{N}", _GPT2),  # every digit alone
    "llama3": (_LLAMA3,),  # digits in runs of at most 3
    "qwen2": (_QWEN2,),  # every digit alone, llama3's word rules
    "gpt-4o": (_GPT4O,),
}
# `pre` value -> family, and whether merges are skipped for words that are whole tokens (llama.cpp's
# ignore_merges, set for the llama3 family: their tokenizer.json says so).
_PRE_FAMILIES: dict[str, tuple[str, bool]] = {
    "default": ("default", False),
    **{p: ("llama3", True) for p in ("llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral")},
    **{p: ("starcoder", False) for p in ("smollm", "starcoder", "refact", "command-r", "codeshell")},
    **{p: ("qwen2", False) for p in ("qwen2", "deepseek-r1-qwen", "megrez", "stablelm2")},
    **{p: ("gpt-4o", False) for p in ("gpt-4o", "llama4")},
    **{p: ("gpt2", False) for p in ("gpt-2", "phi-2", "mpt", "olmo", "jais")},
}
KNOWN_PRE_VALUES = frozenset(_PRE_FAMILIES)


def _word_splitter(family: str) -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in PRE_TOKENIZER_REGEXES[family]]
    )


def split_words(text: str, pre: str) -> list[str]:
    """The words a gpt2 vocab with this `tokenizer.ggml.pre` value cuts `text` into before merging."""
    if pre not in _PRE_FAMILIES:
        raise ValueError(f"unknown tokenizer.ggml.pre {pre!r}; supported: {', '.join(sorted(_PRE_FAMILIES))}")
    return [w for w, _ in _word_splitter(_PRE_FAMILIES[pre][0]).pre_tokenize_str(text)]


# Token texts that end a turn or the text (llama.cpp's end-of-generation names, less its FIM tokens,
# which only end fill-in-the-middle completions).
_END_OF_TURN_NAMES = frozenset((
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<end_of_turn>", "<|endoftext|>",
    "<|eom_id|>", "<EOT>", "<|end_of_text|>", "<end_of_utterance>", "<｜end▁of▁sentence｜>", "<eos>",
))  # fmt: skip


def _gpt2_byte_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet, char -> byte: printable Latin-1 bytes stand for themselves, the other
    bytes (controls, space, ...) take the code points from 256 up, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    char_of = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in char_of:
            char_of[b] = chr(256 + extra)
            extra += 1
    return {c: b for b, c in char_of.items()}


_BYTE_OF_CHAR = _gpt2_byte_alphabet()


def _gpt2_token_bytes(text: str, token_type: int) -> bytes:
    try:
        return bytes(_BYTE_OF_CHAR[c] for c in text)
    except KeyError:  # not byte-level text (a malformed vocab): its UTF-8 is the best reading
        return text.encode()


def _spm_token_bytes(text: str, token_type: int) -> bytes:
    if token_type == BYTE and len(text) == 6 and text.startswith("<0x") and text.endswith(">"):
        return bytes([int(text[3:5], 16)])
    return text.replace("▁", " ").encode()


def _spm_merges(tokens: list[str], scores: list[float], types: list[int]) -> list[tuple[str, str]]:
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
class _Vocab:
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


def _read_vocab(md: Mapping[str, Any]) -> _Vocab:
    model = md.get("tokenizer.ggml.model")
    if model not in ("gpt2", "llama"):
        raise ValueError(
            f"unsupported tokenizer.ggml.model {model!r}; supported: 'gpt2' (BPE), 'llama' (SentencePiece)"
        )
    tokens = [str(t) for t in md["tokenizer.ggml.tokens"]]
    n = len(tokens)
    types = [int(t) for t in md.get("tokenizer.ggml.token_type", [NORMAL] * n)]
    if len(types) < n:
        raise ValueError(f"tokenizer.ggml.token_type has {len(types)} entries for {n} tokens")

    def token_id(key: str, default: int | None) -> int | None:
        # An id outside the vocab is ignored, as llama.cpp does (with a warning there too).
        for v in (md.get(f"tokenizer.ggml.{key}"), default):
            if v is not None and 0 <= int(v) < n:
                return int(v)
        return None

    spm = model == "llama"
    bos, eos = token_id("bos_token_id", 1 if spm else None), token_id("eos_token_id", 2 if spm else None)
    # Defaults as llama.cpp's: SentencePiece and the llama3 family add BOS unless the metadata says not.
    llama3 = _PRE_FAMILIES.get(_pre_value(md), ("",))[0] == "llama3"
    add_bos = bool(md.get("tokenizer.ggml.add_bos_token", spm or llama3))
    add_eos = bool(md.get("tokenizer.ggml.add_eos_token", False))
    for flag, tid, what in ((add_bos, bos, "bos"), (add_eos, eos, "eos")):
        if flag and tid is None:
            raise ValueError(f"tokenizer.ggml.add_{what}_token is true but tokenizer.ggml.{what}_token_id is not set")
    eot = tuple(i for i in (token_id("eot_token_id", None), token_id("eom_token_id", None)) if i is not None)
    return _Vocab(
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


def _pre_value(md: Mapping[str, Any]) -> str:
    return str(md.get("tokenizer.ggml.pre") or "")


def _gpt2_pre_family(md: Mapping[str, Any]) -> tuple[str, bool]:
    """(regex family, ignore_merges) for the metadata's `pre` value."""
    pre = _pre_value(md)
    if not pre:
        log.warning(
            "GGUF has no tokenizer.ggml.pre; using the 'default' pre-tokenizer (tokens may differ from the "
            "model's training; consider re-converting the model)"
        )
        pre = "default"
    if pre not in _PRE_FAMILIES:
        raise ValueError(f"unknown tokenizer.ggml.pre {pre!r}; supported: {', '.join(sorted(_PRE_FAMILIES))}")
    return _PRE_FAMILIES[pre]


def _gpt2_merges(md: Mapping[str, Any]) -> list[tuple[str, str]]:
    if "tokenizer.ggml.merges" not in md:
        raise ValueError("a gpt2 (BPE) vocabulary needs tokenizer.ggml.merges, which this GGUF lacks")
    merges = []
    for m in md["tokenizer.ggml.merges"]:
        cut = m.find(" ", 1)  # from 1: a merge's left part may itself be a space
        merges.append((m[:cut], m[cut + 1 :]))
    return merges


def _stop_ids(v: _Vocab) -> frozenset[int]:
    """EOS, the metadata's eot/eom ids, and every token named like an end of turn (`<|im_end|>`,
    `<|eot_id|>`, `<|endoftext|>`, ...) whatever its type: llama.cpp treats such a token typed normal as a
    conversion bug and forces it to control, and so do we (`_effective_types`). When a vocab has both
    `<|return|>` and `<|call|>` (gpt-oss's harmony format), `<|end|>` only closes a message, not the turn."""
    named = {i for i, t in enumerate(v.tokens) if t in _END_OF_TURN_NAMES}
    texts = {v.tokens[i] for i in named}
    if {"<|return|>", "<|call|>"} <= texts:
        named = {i for i in named if v.tokens[i] != "<|end|>"}
    return frozenset(named | set(v.eot_ids) | ({v.eos_id} if v.eos_id is not None else set()))


def _effective_types(v: _Vocab, stop_ids: frozenset[int]) -> list[int]:
    types = list(v.types)
    for i in stop_ids:
        if types[i] in (NORMAL, UNUSED):
            types[i] = CONTROL
    return types


class Tokenizer:
    """Text <-> token ids for one GGUF vocabulary. Build with `Tokenizer.from_metadata`."""

    def __init__(self, md: Mapping[str, Any]) -> None:
        v = _read_vocab(md)
        self._vocab = v
        self._stop_ids = _stop_ids(v)
        self._types = _effective_types(v, self._stop_ids)
        if v.model == "gpt2":
            self.pre_family, self._ignore_merges = _gpt2_pre_family(md)
            self._merges = _gpt2_merges(md)
            normal_bytes = _gpt2_token_bytes
        else:
            self.pre_family, self._ignore_merges = "spm", False
            scores = [float(s) for s in md.get("tokenizer.ggml.scores", [0.0] * len(v.tokens))]
            self._merges = _spm_merges(v.tokens, scores, self._types)
            normal_bytes = _spm_token_bytes
        self._bytes = [
            t.encode() if ty in (CONTROL, USER_DEFINED, UNKNOWN) else normal_bytes(t, ty)
            for t, ty in zip(v.tokens, self._types)
        ]
        self._hf = self._build_hf(encode_special_tokens=False)
        self._hf_literal: HFTokenizer | None = None  # built on first parse_special=False call

    @classmethod
    def from_metadata(cls, md: Mapping[str, Any]) -> Tokenizer:
        return cls(md)

    def _build_hf(self, encode_special_tokens: bool) -> HFTokenizer:
        v = self._vocab
        vocab: dict[str, int] = {}
        for i, t in enumerate(v.tokens):
            vocab.setdefault(t, i)  # a duplicated text encodes to its first id
        if v.model == "gpt2":
            hf = HFTokenizer(models.BPE(vocab=vocab, merges=self._merges, ignore_merges=self._ignore_merges))
            hf.pre_tokenizer = pre_tokenizers.Sequence(
                [_word_splitter(self.pre_family), pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
            )
        else:
            unk = v.tokens[v.unk_id] if v.unk_id is not None else None
            hf = HFTokenizer(
                models.BPE(vocab=vocab, merges=self._merges, unk_token=unk, fuse_unk=True, byte_fallback=True)
            )
            # The normalizer runs on each run of text between added tokens, so the '▁' lands after every
            # special token too, as llama.cpp's "prefix with space if previous is special" does.
            steps = [normalizers.Prepend("▁")] if v.add_space_prefix else []
            hf.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", "▁")])
        # Control and unknown tokens are "special": matched in text only when parse_special is on.
        # User-defined tokens are always matched, as in llama.cpp and HF.
        added = [
            AddedToken(t, special=ty in (CONTROL, UNKNOWN), normalized=False)
            for t, ty in zip(v.tokens, self._types)
            if t and ty in (CONTROL, UNKNOWN, USER_DEFINED)
        ]
        hf.add_special_tokens([tok for tok in added if tok.special])
        hf.add_tokens([tok for tok in added if not tok.special])
        hf.encode_special_tokens = encode_special_tokens
        return hf

    # -- encode / decode ---------------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True, parse_special: bool = True) -> list[int]:
        """Token ids of `text`. add_special_tokens adds BOS/EOS as the metadata's add_bos_token/add_eos_token
        say; parse_special=False reads control tokens written in the text (`<|im_start|>`) as plain text."""
        if parse_special:
            hf = self._hf
        else:
            if self._hf_literal is None:  # a benign race: two threads may both build it, both correct
                self._hf_literal = self._build_hf(encode_special_tokens=True)
            hf = self._hf_literal
        ids = hf.encode(text, add_special_tokens=False).ids
        if add_special_tokens:
            v = self._vocab
            if v.add_bos and v.bos_id is not None:
                ids.insert(0, v.bos_id)
            if v.add_eos and v.eos_id is not None:
                ids.append(v.eos_id)
        return ids

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes one token stands for (a byte-fallback token: one byte, maybe half a character);
        control tokens give their text."""
        if not 0 <= token_id < len(self._bytes):
            raise ValueError(f"token id {token_id} is outside the vocabulary (size {len(self._bytes)})")
        return self._bytes[token_id]

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        """Text of `ids`; bytes that are not valid UTF-8 come out as U+FFFD. With add_space_prefix (a
        SentencePiece vocab) the space the encoder prefixed is taken off again."""
        data = b"".join(
            self.token_bytes(i) for i in ids if not (skip_special_tokens and self.is_special(i))
        )
        text = data.decode("utf-8", errors="replace")
        if self._vocab.add_space_prefix and text.startswith(" "):
            text = text[1:]
        return text

    # -- vocabulary facts --------------------------------------------------------------------------------

    def is_special(self, token_id: int) -> bool:
        """Control and unknown tokens: the ones skip_special_tokens drops (user-defined ones are text)."""
        return 0 <= token_id < len(self._types) and self._types[token_id] in (CONTROL, UNKNOWN)

    @property
    def vocab_size(self) -> int:
        return len(self._vocab.tokens)

    @property
    def bos_token_id(self) -> int | None:
        return self._vocab.bos_id

    @property
    def eos_token_id(self) -> int | None:
        return self._vocab.eos_id

    @property
    def bos_token(self) -> str:
        return self._vocab.tokens[self._vocab.bos_id] if self._vocab.bos_id is not None else ""

    @property
    def eos_token(self) -> str:
        return self._vocab.tokens[self._vocab.eos_id] if self._vocab.eos_id is not None else ""

    @property
    def add_bos_token(self) -> bool:
        return self._vocab.add_bos

    @property
    def add_eos_token(self) -> bool:
        return self._vocab.add_eos

    @property
    def add_space_prefix(self) -> bool:
        """True when decoding the start of a text drops one leading space (SentencePiece vocabs)."""
        return self._vocab.add_space_prefix

    @property
    def stop_token_ids(self) -> frozenset[int]:
        return self._stop_ids
