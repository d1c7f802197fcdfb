"""The word splitting of gpt2-style (byte-level BPE) vocabularies: the regexes of each `tokenizer.ggml.pre` value,
the same ones llama.cpp uses, as `tokenizers` pre-tokenizers.

Each family is a chain of regexes applied in turn, each cutting the pieces of the one before; text a regex
does not match stays a piece of its own (llama.cpp's unicode_regex_split, Split "isolated").
"""

from __future__ import annotations

from tokenizers import Regex, pre_tokenizers

# Contractions are spelled with explicit case classes rather than (?i:...) so that Unicode case folding
# (e.g. the long s 'ſ' folding to 's') cannot make them match more than llama.cpp's do.
_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
# Qwen3.5's: qwen2's, with combining marks kept inside words
_QWEN35 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+"
           r"|\s+(?!\S)|\s+")
# gpt-4o as in its tokenizer.json. llama.cpp emulates \p{Lu}/\p{Ll} with [^a-z]/[^A-Z] because std::regex
# lacks them, which groups non-ASCII letters differently; onig has the real classes, so we use them.
_UPPERS, _LOWERS = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]", r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]"
_GPT4O = (
    rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPERS}*{_LOWERS}+{_CONTRACTIONS}?"
    rf"|[^\r\n\p{{L}}\p{{N}}]?{_UPPERS}+{_LOWERS}*{_CONTRACTIONS}?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

PRE_TOKENIZER_REGEXES: dict[str, tuple[str, ...]] = {
    "default": (r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"),
    "gpt2": (_GPT2,),
    "starcoder": (r"\p{N}", _GPT2),  # every digit alone
    "llama3": (_LLAMA3,),  # digits in runs of at most 3
    "qwen2": (_QWEN2,),  # every digit alone, llama3's word rules
    "qwen35": (_QWEN35,),
    "gpt-4o": (_GPT4O,),
}
# `pre` value -> family, and whether merges are skipped for words that are whole tokens (llama.cpp's
# ignore_merges, set for the llama3 family: their tokenizer.json says so).
PRE_FAMILIES: dict[str, tuple[str, bool]] = {
    "default": ("default", False),
    **{p: ("llama3", True) for p in ("llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral")},
    **{p: ("starcoder", False) for p in ("smollm", "starcoder", "refact", "command-r", "codeshell")},
    **{p: ("qwen2", False) for p in ("qwen2", "deepseek-r1-qwen", "megrez", "stablelm2")},
    "qwen35": ("qwen35", False),
    **{p: ("gpt-4o", False) for p in ("gpt-4o", "llama4")},
    **{p: ("gpt2", False) for p in ("gpt-2", "phi-2", "mpt", "olmo", "jais")},
}


def word_splitter(family: str) -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in PRE_TOKENIZER_REGEXES[family]]
    )


def split_words(text: str, pre: str) -> list[str]:
    """The words a gpt2 vocab with this `tokenizer.ggml.pre` value cuts `text` into before merging."""
    if pre not in PRE_FAMILIES:
        raise ValueError(f"unknown tokenizer.ggml.pre {pre!r}; supported: {', '.join(sorted(PRE_FAMILIES))}")
    return [w for w, _ in word_splitter(PRE_FAMILIES[pre][0]).pre_tokenize_str(text)]
