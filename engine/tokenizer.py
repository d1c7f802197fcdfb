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

Metadata of the wrong type or shape (a token list of numbers, a merge naming no token) raises ValueError
naming the key, as damaged files do.

Encoding goes through `tokenizers`, with the GIL released while it runs (encode_batch: `encode` holds it,
which froze the HTTP front for seconds on a large prompt); decoding is ours: each id maps to the exact bytes
it stands for (`token_bytes`), so decode, streaming and the byte-level/byte-fallback cases share one table.

Control-token text that came from a user is quoted: `quote_special` wraps each control-token text in LITERAL
marks, and `encode` reads a quoted span as plain text while still matching the control tokens outside the
marks. The chat route quotes request strings before the template renders them, so `<|im_start|>system`
typed into a message stays text and the template's own turns stay control tokens.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Mapping
from typing import Any

from tokenizers import AddedToken, Encoding, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from vegaserve.engine.gguf_vocab import (
    BYTE, CONTROL, UNKNOWN, USER_DEFINED, Vocab, effective_types, gpt2_merges, gpt2_pre_family, list_of, read_vocab,
    spm_merges, stop_ids,
)  # fmt: skip
from vegaserve.engine.pre_tokenizers import word_splitter
from vegaserve.engine.protocol import Runner

log = logging.getLogger(__name__)

# Text between two LITERAL marks is plain text to `encode`, whatever control-token text it spells. A lone
# surrogate: no request text can hold one (server/body.py refuses them) and no template from a GGUF either
# (UTF-8 cannot encode one), so a mark can only come from `quote_special`.
LITERAL = "\udbff"

# A byte-level BPE text longer than twice this is encoded in pieces of about this many characters. One Encoding
# of an 8 MB text is two million tokens: building its ids list took 60 ms and releasing it 180 ms, each one call
# holding the GIL, during which the HTTP front's /health and the engine's step loop wait; for a 1 MiB piece,
# 11 and 34 ms. Not smaller: each piece is a return to the GIL for the low-priority thread that encodes it.
PIECE_CHARS = 1 << 20
# Where such a text can be cut without changing its tokens: at a space after a non-space. No regex of any `pre`
# family matches a non-space followed by a space (a word takes a space only in front), so every family ends a
# word there and starts the next at the space, whatever came before. (Python's \s is a superset of onig's.)
_CUT = re.compile(r"(?<=\S) ")


def gpt2_byte_alphabet() -> dict[str, int]:
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


_BYTE_OF_CHAR = gpt2_byte_alphabet()


def _gpt2_token_bytes(text: str, token_type: int) -> bytes:
    try:
        return bytes(_BYTE_OF_CHAR[c] for c in text)
    except KeyError:  # not byte-level text (a malformed vocab): its UTF-8 is the best reading
        return text.encode()


def _spm_token_bytes(text: str, token_type: int) -> bytes:
    if token_type == BYTE and len(text) == 6 and text.startswith("<0x") and text.endswith(">"):
        return bytes([int(text[3:5], 16)])
    return text.replace("▁", " ").encode()


class Tokenizer:
    """Text <-> token ids for one GGUF vocabulary. Build with `Tokenizer.from_metadata`."""

    def __init__(self, md: Mapping[str, Any]) -> None:
        v = read_vocab(md)
        self._vocab: Vocab = v
        self._stop_ids = stop_ids(v)
        self._types = effective_types(v, self._stop_ids)
        if v.model == "gpt2":
            self.pre_family, self._ignore_merges = gpt2_pre_family(md)
            self._merges = gpt2_merges(md)
            normal_bytes = _gpt2_token_bytes
        else:
            self.pre_family, self._ignore_merges = "spm", False
            scores = [float(s) for s in list_of(md, "tokenizer.ggml.scores", float, [0.0] * len(v.tokens))]
            if len(scores) < len(v.tokens):
                raise ValueError(f"tokenizer.ggml.scores has {len(scores)} entries for {len(v.tokens)} tokens")
            self._merges = spm_merges(v.tokens, scores, self._types)
            normal_bytes = _spm_token_bytes
        self._bytes = [
            t.encode() if ty in (CONTROL, USER_DEFINED, UNKNOWN) else normal_bytes(t, ty)
            for t, ty in zip(v.tokens, self._types)
        ]
        # control and unknown token texts -> their (first) id: what parse_special matches in text
        self._special_ids: dict[str, int] = {}
        for i, (t, ty) in enumerate(zip(v.tokens, self._types)):
            if t and ty in (CONTROL, UNKNOWN):
                self._special_ids.setdefault(t, i)
        self._special_re: re.Pattern[str] | None = None  # built on first use
        # An added token with a space inside could straddle a _CUT: then no text is cut
        self._cuttable = v.model == "gpt2" and not any(
            " " in t[1:] for t, ty in zip(v.tokens, self._types) if ty in (CONTROL, UNKNOWN, USER_DEFINED)
        )
        self._bound: tuple[int, bytes] | None = None  # _length_bound, computed on first use
        try:
            self._hf = self._build_hf(encode_special_tokens=False)
        except Exception as e:  # tokenizers raises a bare Exception on a merge naming no token
            raise ValueError(f"tokenizer.ggml.merges or tokens: the vocabulary does not build ({e})") from None
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
                [word_splitter(self.pre_family), pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
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

    def encode(
        self, text: str, add_special_tokens: bool = True, parse_special: bool = True, runner: Runner | None = None
    ) -> list[int]:
        """Token ids of `text`. add_special_tokens adds BOS/EOS as the metadata's add_bos_token/add_eos_token
        say; parse_special=False reads control tokens written in the text (`<|im_start|>`) as plain text.
        `runner(work)` runs the tokenizers call, which holds no GIL, where the caller wants it (the HTTP
        front: a low-priority thread for a huge text); what holds the GIL stays in the calling thread."""
        if parse_special and LITERAL in text:
            ids = self._encode_quoted(text, runner)
        else:
            ids = self._run(self._hf if parse_special else self._literal(), text, runner)
        if add_special_tokens:
            v = self._vocab
            if v.add_bos and v.bos_id is not None:
                ids.insert(0, v.bos_id)
            if v.add_eos and v.eos_id is not None:
                ids.append(v.eos_id)
        return ids

    def quote_special(self, text: str) -> str:
        """`text` with each control-token text in it between LITERAL marks, so that `encode` reads it as plain
        text; `text` itself when it holds none."""
        if not self._special_ids:
            return text
        if self._special_re is None:  # longest first: at one position the longest text wins, as in tokenizers
            texts = sorted(self._special_ids, key=len, reverse=True)
            self._special_re = re.compile("|".join(re.escape(t) for t in texts))
        return self._special_re.sub(lambda m: LITERAL + m.group(0) + LITERAL, text)

    def _literal(self) -> HFTokenizer:
        if self._hf_literal is None:  # a benign race: two threads may both build it, both correct
            self._hf_literal = self._build_hf(encode_special_tokens=True)
        return self._hf_literal

    def _run(self, hf: HFTokenizer, text: str, runner: Runner | None) -> list[int]:
        pieces = self._pieces(text)

        # encode_batch releases the GIL while it works (encode does not); one piece per call keeps the work on
        # this thread (a batch would spread over tokenizers' own pool, at its priority)
        def work() -> list[Encoding | None]:
            return [hf.encode_batch([piece], add_special_tokens=False)[0] for piece in pieces]

        encodings = work() if runner is None else runner(work)
        ids: list[int] = []
        for i, encoding in enumerate(encodings):
            assert encoding is not None
            ids += encoding.ids  # builds a list: holds the GIL, as does releasing the Encoding
            encodings[i] = encoding = None  # released piece by piece
        return ids

    def _pieces(self, text: str) -> list[str]:
        """`text` cut at _CUT points into pieces of about PIECE_CHARS, encoded one by one to the same ids."""
        if not self._cuttable or len(text) <= 2 * PIECE_CHARS:
            return [text]
        pieces, start = [], 0
        while len(text) - start > 2 * PIECE_CHARS and (cut := _CUT.search(text, start + PIECE_CHARS)):
            pieces.append(text[start : cut.start()])
            start = cut.start()
        pieces.append(text[start:])
        return pieces

    def _encode_quoted(self, text: str, runner: Runner | None) -> list[int]:
        """Control tokens matched outside the LITERAL-marked spans only; everything between two matched
        control tokens is one run of plain text, as `tokenizers` cuts the text at its added tokens."""
        self.quote_special("")  # compiles the pattern
        assert self._special_re is not None
        ids: list[int] = []
        run: list[str] = []
        for i, piece in enumerate(text.split(LITERAL)):  # odd pieces were quoted
            at = 0
            for m in () if i % 2 else self._special_re.finditer(piece):
                run.append(piece[at : m.start()])
                if any(run):
                    ids += self._run(self._literal(), "".join(run), runner)
                run = []
                ids.append(self._special_ids[m.group(0)])
                at = m.end()
            run.append(piece[at:])
        if any(run):
            ids += self._run(self._literal(), "".join(run), runner)
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

    def _length_bound(self) -> tuple[int, bytes]:
        """(the most bytes of text one token stands for, the bytes no token stands for); (0, b"") where no
        bound holds: a SentencePiece vocabulary without all 256 byte tokens folds any run of unknown
        characters into one token. A gpt2 vocabulary lacking a byte's token drops that byte (SmolLM2 lacks
        21, control characters and bytes UTF-8 never uses), so those bytes are not counted."""
        if self._bound is None:
            if self._vocab.model == "gpt2":
                present = set(self._vocab.tokens)
                dropped = bytes(sorted(b for c, b in _BYTE_OF_CHAR.items() if c not in present))
                self._bound = (max(map(len, self._bytes)), dropped)
            else:
                byte_tokens = {b for b, ty in zip(self._bytes, self._types) if ty == BYTE and len(b) == 1}
                self._bound = (max(map(len, self._bytes)), b"") if len(byte_tokens) == 256 else (0, b"")
        return self._bound

    def min_tokens(self, text: str) -> int:
        """At least how many tokens `text` (quoted or not) encodes to, from its length in bytes alone; 0
        where the vocabulary gives no such bound. Cheap: it lets a prompt too long for any context be refused
        before it is tokenized."""
        per_token, dropped = self._length_bound()
        if not per_token:
            return 0
        if text.isascii():
            n = len(text) - sum(text.count(chr(b)) for b in dropped if b < 0x80)
        else:
            data = text.encode("utf-8", "surrogatepass")
            n = len(data) - 3 * text.count(LITERAL) - sum(data.count(b) for b in dropped)
        return -(-n // per_token)

    @property
    def stop_token_ids(self) -> frozenset[int]:
        return self._stop_ids
