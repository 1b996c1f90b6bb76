"""Chat templating: the checkpoint's own template rendered as transformers does."""

import pytest
from reference import REFERENCE, SMOLLM2

from butter.chat.prompt import build_prompt
from butter.chat.template import ChatTemplate
from butter.errors import TemplateError
from butter.wire.openai import parse_chat_completion


def test_renders_the_reference_prompt_with_the_default_system_prompt():
    template = ChatTemplate(SMOLLM2, bos_token="<|im_start|>", eos_token="<|im_end|>")
    text = template.render([{"role": "user", "content": "What is the capital of France?"}])
    assert text == REFERENCE


def test_hf_template_features():
    source = (
        "{{ bos_token }}{% for m in messages %}{% if m.role == 'bad' %}"
        "{{ raise_exception('no bad roles') }}{% endif %}{{ m | tojson }}\n"
        "{% endfor %}{% if add_generation_prompt %}GO{% endif %}"
    )
    template = ChatTemplate(source, bos_token="<s>")
    assert template.render([{"role": "user", "content": "é"}]) == (
        '<s>{"role": "user", "content": "é"}\nGO'
    )
    with pytest.raises(TemplateError, match="no bad roles"):
        template.render([{"role": "bad", "content": ""}])


def test_template_without_tools_gets_a_hermes_block():
    template = ChatTemplate(SMOLLM2)
    request = parse_chat_completion({
        "messages": [{"role": "user", "content": "Weather in Paris?"}],
        "tools": [{"type": "function", "function": {"name": "get_weather",
                                                    "parameters": {"type": "object"}}}],
    })
    plan = build_prompt(request, template)
    assert plan.parse_tools
    assert plan.text.startswith("<|im_start|>system\nYou are a function calling AI model")
    assert '"name": "get_weather"' in plan.text
    none = parse_chat_completion({**{"messages": request.messages}, "tools": [
        {"type": "function", "function": {"name": "f"}}], "tool_choice": "none"})
    assert "<tools>" not in build_prompt(none, template).text


def test_template_that_knows_tools_renders_them_itself():
    source = ("{% if tools %}TOOLS:{% for t in tools %}{{ t.function.name }}{% endfor %}\n"
              "{% endif %}{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}")
    template = ChatTemplate(source)
    assert template.accepts_tools
    request = parse_chat_completion({
        "messages": [{"role": "user", "content": "hi"}],
        "tools": [{"type": "function", "function": {"name": "lookup"}}],
    })
    # trim_blocks eats the newline
    assert build_prompt(request, template).text == "TOOLS:lookupuser: hi\n"


def test_tool_history_renders_for_a_template_without_tools():
    request = parse_chat_completion({"messages": [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]})
    text = build_prompt(request, ChatTemplate(SMOLLM2)).text
    call = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
    assert f"<tool_call>\n{call}\n</tool_call>" in text
    assert "<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>" in text
