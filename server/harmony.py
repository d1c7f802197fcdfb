"""gpt-oss's harmony replies: the `analysis` channel is `reasoning_content`, `final` is `content`, and a
`commentary` message addressed `to=functions.NAME` is a tool call whose body is its arguments.

The reply follows a prompt that ends `<|start|>assistant`, so it opens with a message header:

    <|channel|>analysis<|message|>Let me think...<|end|>
    <|start|>assistant<|channel|>final<|message|>The answer.            (then <|return|>, a stop token)
    <|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}   (<|call|>)

(the recipient may also stand in the header before the channel: `<|start|>assistant to=functions.f<|channel|>
commentary json<|message|>`). The control tokens come through the detokenizer as their text, so the markup
is parsed as text, incrementally: a marker cut between two increments is held back until it is whole.
A commentary message without a recipient (a preamble to the user) and any other channel are content; text
that never reached a `<|message|>` (a model that ignores the format) is content at the end.

Why not the `openai-harmony` library: it loads its o200k vocabulary from the network the first time it is
used (openai/harmony issues 46, 95, 101), which an offline deployment and the tests cannot do; the markup is a
handful of fixed markers.
"""

from __future__ import annotations

import re

from vegaserve.server.reasoning import held_prefix
from vegaserve.server.tool_calls import CallDelta, Increment, new_call_id

MESSAGE, END, START, CALL, RETURN = "<|message|>", "<|end|>", "<|start|>", "<|call|>", "<|return|>"
_ENDS = (END, CALL, RETURN, START)
_CHANNEL = re.compile(r"<\|channel\|>\s*([^\s<]+)")
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")


class HarmonyParser:
    def __init__(self) -> None:
        self._header: str | None = ""  # the current message's header while it is read; None in a body
        self._route = "content"  # where the current body goes: reasoning, content or call
        self._held = ""
        self._calls = 0

    def feed(self, text: str) -> Increment:
        text, self._held = self._held + text, ""
        out = Increment()
        while text:
            if self._header is not None:
                at = text.find(MESSAGE)
                if at < 0:
                    keep = held_prefix(text, MESSAGE)
                    self._header += text[: len(text) - keep]
                    self._held = text[len(text) - keep:]
                    break
                out += self._open(self._header + text[:at])
                self._header, text = None, text[at + len(MESSAGE):]
            else:
                at, marker = min(((text.find(m), m) for m in _ENDS if m in text), default=(-1, ""))
                body = text if at < 0 else text[:at]
                keep = max((held_prefix(body, m) for m in _ENDS), default=0) if at < 0 else 0
                out += self._body(body[: len(body) - keep])
                if at < 0:
                    self._held = body[len(body) - keep:]
                    break
                # a message ends; the next one's header starts after <|start|> (or right away)
                self._header, text = "", text[at + len(marker):]
        return out

    def _open(self, header: str) -> Increment:
        channel = _CHANNEL.search(header)
        recipient = _RECIPIENT.search(header)
        name = channel.group(1) if channel else ""
        if recipient and recipient.group(1).startswith("functions."):
            self._route = "call"
            index, self._calls = self._calls, self._calls + 1
            return Increment(calls=[CallDelta(index, new_call_id(), recipient.group(1).removeprefix("functions."), "")])
        self._route = "reasoning" if name == "analysis" else "content"
        if not channel and not header.strip().startswith(("<|", "assistant")):
            return Increment(content=header)  # not a header: text the model wrote without the format
        return Increment()

    def _body(self, text: str) -> Increment:
        if not text:
            return Increment()
        if self._route == "call":
            return Increment(calls=[CallDelta(self._calls - 1, arguments=text)])
        if self._route == "reasoning":
            return Increment(reasoning=text)
        return Increment(content=text)

    def finish(self) -> Increment:
        held, self._held = self._held, ""
        if self._header is not None:
            header, self._header = self._header + held, None
            if _CHANNEL.search(header) or not header.strip():
                return Increment()
            return Increment(content=header.removeprefix(START))
        return self._body(held)
