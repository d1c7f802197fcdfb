"""A reply's reasoning split from its answer: `<think>...</think>` (Qwen3, Qwen3.5/3.6, DeepSeek-R1 style) into
`reasoning_content` and `content`, as vLLM and llama-server return them.

Parsers read the reply's text as it is generated (`feed`, then `finish` once it ended) and give back
increments; the whole reply of a non-streamed request goes through the same parser in one piece, so the two
modes agree to the character. A tag cut between two increments is held back until it is whole.

Where the reply starts depends on the prompt: a template that opens the think block itself (its generation
prompt ends with `<think>\\n`) leaves the model inside it, one that writes an empty block (Qwen3 with
`enable_thinking` false) leaves it in the answer, otherwise the reply may open one. `ThinkParser.after`
reads that from the prompt's last characters. Whitespace that only separates the tags from the text
(`<think>\\n`, `\\n</think>\\n\\n`) belongs to neither part. A reply cut off inside the block (max_tokens)
is all reasoning, as vLLM returns it.
"""

from __future__ import annotations

import enum

OPEN, CLOSE = "<think>", "</think>"


def held_prefix(text: str, tag: str) -> int:
    """The length of the longest end of `text` that is a proper beginning of `tag` (what may still grow
    into the tag with the next increment)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class _State(enum.Enum):
    START = "start"  # nothing but whitespace yet: the reply may still open a think block
    REASONING = "reasoning"
    CONTENT = "content"


class ThinkParser:
    """`<think>...</think>` out of a reply's text; feed() and finish() give (reasoning, content) increments."""

    def __init__(self, in_reasoning: bool = False) -> None:
        self._state = _State.REASONING if in_reasoning else _State.START
        self._held = ""
        self._strip = True  # the section just begun drops its leading whitespace

    @classmethod
    def after(cls, prompt_tail: str) -> ThinkParser:
        """The parser for a reply that follows a prompt ending in `prompt_tail`: inside the think block if the
        prompt opened one it did not close."""
        return cls(in_reasoning=prompt_tail.rfind(OPEN) > prompt_tail.rfind(CLOSE))

    def feed(self, text: str) -> tuple[str, str]:
        text, self._held = self._held + text, ""
        reasoning: list[str] = []
        content: list[str] = []
        while text:
            if self._state is _State.START:
                head = text.lstrip()
                if head.startswith(OPEN):
                    self._state, self._strip, text = _State.REASONING, True, head[len(OPEN):]
                elif not head or OPEN.startswith(head):
                    self._held = text
                    break
                else:
                    self._state, self._strip = _State.CONTENT, False
            elif self._state is _State.REASONING:
                if self._strip:
                    text = text.lstrip()
                    self._strip = bool(not text)
                    if not text:
                        break
                end = text.find(CLOSE)
                if end >= 0:
                    reasoning.append(text[:end].rstrip())
                    self._state, self._strip, text = _State.CONTENT, True, text[end + len(CLOSE):]
                    continue
                # hold what may be the start of the closing tag, and trailing whitespace that may precede it
                partial = held_prefix(text, CLOSE)
                rest = text[: len(text) - partial]
                keep = partial + len(rest) - len(rest.rstrip())
                reasoning.append(text[: len(text) - keep])
                self._held = text[len(text) - keep:]
                break
            else:
                if self._strip:
                    text = text.lstrip()
                    self._strip = bool(not text)
                content.append(text)
                break
        return "".join(reasoning), "".join(content)

    def finish(self) -> tuple[str, str]:
        held, self._held = self._held, ""
        if self._state is _State.REASONING:
            return held.rstrip(), ""
        return "", held if held.strip() else ""

    @property
    def in_reasoning(self) -> bool:
        return self._state is _State.REASONING
