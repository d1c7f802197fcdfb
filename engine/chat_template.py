"""Chat templates: a GGUF's `tokenizer.chat_template` (Jinja) rendered in jinja2's immutable sandbox.

A template is untrusted input (it comes with a downloaded model file), so it runs sandboxed: no attribute
of Python internals, no mutation of the data it is given. The environment matches what HF's
`apply_chat_template` offers templates, since templates are written against it: trim_blocks and
lstrip_blocks, the loop-control extension, a `{% generation %}` block tag, `raise_exception(msg)`,
`strftime_now(fmt)`, and a `tojson` that neither HTML-escapes nor sorts keys (jinja's own does both).

Errors: a template that does not compile is a bad model file (ValueError at construction); one that fails
while rendering was made to fail by the request (its messages or tools, or a raise_exception the template
chose to call), so it is an InvalidRequestError with the reason.
"""

from __future__ import annotations

import json
import re
from datetime import datetime
from typing import Any, NoReturn

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError

from vegaserve.engine.request import InvalidRequestError
from vegaserve.engine.tokenizer import LITERAL

# ChatML, for GGUFs without a template (llama-server's fallback too). Content must be a string or null.
CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message['content'] is not none and message['content'] is not string %}"
    "{{- raise_exception('message content must be a string') }}"
    "{%- endif %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + (message['content'] or '') + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


class _TemplateRaised(jinja2.TemplateError):
    """The template called raise_exception: its message is meant for the client as is."""


class _GenerationBlock(Extension):
    """`{% generation %}...{% endgeneration %}` marks the assistant's text for HF's training masks; for
    serving it renders its body unchanged."""

    tags = {"generation"}

    def parse(self, parser: Any) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_render_body"), [], [], body).set_lineno(lineno)

    def _render_body(self, caller: Any) -> str:
        return caller()


class _Sandbox(ImmutableSandboxedEnvironment):
    """The stock sandbox answers a forbidden attribute with an Undefined that prints as ''; a template that
    reaches for `__globals__` is hostile or broken, so we stop the render instead."""

    def unsafe_undefined(self, obj: Any, attribute: str) -> NoReturn:
        raise SecurityError(f"access to attribute {attribute!r} of {type(obj).__name__!r} object is unsafe")


def _raise_exception(message: str) -> NoReturn:
    raise _TemplateRaised(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


# An ASCII-only dump writes the tokenizer's LITERAL mark (quoted control-token text in request strings) as a
# \u escape; it is put back, or the control-token text inside would be read as the control token. An escape
# preceded by an odd number of backslashes is text the user wrote, not a mark.
_ESCAPED_LITERAL = re.compile(r"(?<!\\)((?:\\\\)*)" + re.escape(json.dumps(LITERAL)[1:-1]))


def _tojson(
    value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None, sort_keys: bool = False
) -> str:
    text = json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
    return _ESCAPED_LITERAL.sub(lambda m: m.group(1) + LITERAL, text) if ensure_ascii else text


def _environment() -> _Sandbox:
    env = _Sandbox(trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlock, "jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


class ChatTemplate:
    """One compiled chat template and the special-token texts it may print."""

    def __init__(self, source: str, bos_token: str = "", eos_token: str = "") -> None:
        if not isinstance(source, str):
            raise ValueError(f"tokenizer.chat_template: expected a string, got {type(source).__name__}")
        self.source = source
        self.bos_token = bos_token
        self.eos_token = eos_token
        try:
            self._template = _environment().from_string(source)
        except jinja2.TemplateSyntaxError as e:
            raise ValueError(f"chat template does not compile: {e.message} (template line {e.lineno})") from e

    @classmethod
    def default(cls, bos_token: str = "", eos_token: str = "") -> ChatTemplate:
        return cls(CHATML_TEMPLATE, bos_token, eos_token)

    def render(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        **extra: Any,
    ) -> str:
        """The prompt text. `extra` are further template variables (e.g. enable_thinking); the standard
        ones (messages, tools, add_generation_prompt, bos_token, eos_token) take precedence over them."""
        context = {
            **extra,
            "messages": messages,
            "tools": tools,
            "add_generation_prompt": add_generation_prompt,
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
        }
        try:
            return self._template.render(context)
        except _TemplateRaised as e:
            raise InvalidRequestError(f"chat template rejected the request: {e.message}") from e
        except SecurityError as e:
            raise InvalidRequestError(f"chat template broke the sandbox rules: {e}") from e
        except jinja2.TemplateError as e:
            raise InvalidRequestError(f"chat template failed: {type(e).__name__}: {e}") from e
        # Anything else a template does on request data ('a' + None, a missing key's method, a huge
        # recursion) is still the request's failure to fit this template, not the server's.
        except Exception as e:  # noqa: BLE001
            raise InvalidRequestError(f"chat template failed: {type(e).__name__}: {e}") from e
