"""Qwen3.5's tool-call format and its template-opened think block, on the real template.

The chat templates come from the pinned llama-cpp-python sdist (the ``tiny_qwen35_sdist``
fixture: ``BUTTER_LLAMA_SDIST``, which ``scripts/test.sh`` fills). Which format a template
teaches is read from it the way llama.cpp's chat-format detection reads it; the grammars
are compiled against the shipped SmolLM2 vocabulary and fed the text a call is made of;
the answers are scripted (a random-weight model writes neither thinking nor calls on its
own), replayed token by token through the real server app, and read with both official
SDKs, streamed and not.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import anthropic
import httpx2
import jsonschema
import llguidance
import openai
import pytest
from fakes.scripted import Reply, ScriptedBackend, real_tokenizer
from support.anthropic_blocks import blocks_of

from butter.chat.grammar import grammar_for
from butter.chat.prompt import build_prompt
from butter.chat.request import ChatRequest, ToolChoice
from butter.chat.template import ChatTemplate
from butter.generation import GenerationParams
from butter.http.app import create_app

MARKUP = ("<tool_call", "</tool_call", "<function=", "</function", "<parameter", "<think",
          "</think")

WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "enum": ["Paris", "Rome"]},
    "days": {"type": "integer", "minimum": 1, "maximum": 7},
    "metric": {"type": "boolean"},
    "note": {"type": "string", "maxLength": 12},
    "where": {"$ref": "#/$defs/Point"},
    "tags": {"type": "array", "items": {"type": "string"}},
}, "required": ["city", "days"], "$defs": {"Point": {
    "type": "object", "properties": {"lat": {"type": "number"}}, "required": ["lat"]}}}
TIME = {"type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
]
ANTHROPIC_TOOLS = [{"name": t["function"]["name"], "input_schema": t["function"]["parameters"]}
                   for t in TOOLS]
ASK = [{"role": "user", "content": "Weather in Paris for three days, please."}]

CALL = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
        "<parameter=days>\n3\n</parameter>\n<parameter=metric>\ntrue\n</parameter>\n"
        "<parameter=note>\ntwo\nlines\n</parameter>\n<parameter=where>\n{\"lat\": 48.9}\n"
        "</parameter>\n<parameter=tags>\n[\"warm\", \"dry\"]\n</parameter>\n</function>\n"
        "</tool_call>")
ARGUMENTS = {"city": "Paris", "days": 3, "metric": True, "note": "two\nlines",
             "where": {"lat": 48.9}, "tags": ["warm", "dry"]}
TIME_CALL = ("<tool_call>\n<function=get_time>\n<parameter=zone>\nEurope/Paris\n</parameter>\n"
             "</function>\n</tool_call>")
THOUGHT = "The user wants the weather; I will call the tool."
# What Qwen3.5 writes after its template opened ``<think>\n``: no opening tag.
THINK_THEN_CALLS = f"{THOUGHT}\n</think>\n\n{CALL}\n{TIME_CALL}"


@pytest.fixture(scope="module")
def templates(tiny_qwen35_sdist: Path) -> Path:
    """The pinned llama.cpp's model templates."""
    return tiny_qwen35_sdist / "vendor" / "llama.cpp" / "models" / "templates"


@pytest.fixture(scope="module")
def qwen35(templates: Path) -> str:
    return (templates / "Qwen3.5-4B.jinja").read_text()


def chat(messages=ASK, **fields: Any) -> ChatRequest:
    params = fields.pop("params", GenerationParams())
    return ChatRequest(messages=messages, params=params, **fields)


# ---- which format a template teaches -------------------------------------------------


@pytest.mark.parametrize(("name", "expected"), [
    ("Qwen3.5-4B.jinja", "qwen3_coder"),
    ("Qwen3-Coder.jinja", "qwen3_coder"),
    ("Qwen-Qwen2.5-7B-Instruct.jinja", "hermes"),
    ("Qwen-Qwen3-0.6B.jinja", "hermes"),
    ("NousResearch-Hermes-2-Pro-Llama-3-8B-tool_use.jinja", "hermes"),
])
def test_format_is_read_from_the_template(templates: Path, name: str, expected: str) -> None:
    assert ChatTemplate((templates / name).read_text()).tool_format == expected


def test_shipped_model_and_templates_without_tools_are_hermes() -> None:
    # SmolLM2's template renders no tools: butter writes the Hermes block for it.
    assert ChatTemplate(real_tokenizer().chat_template).tool_format == "hermes"
    assert ChatTemplate(None).tool_format == "hermes"


# ---- thinking on by default ----------------------------------------------------------


def test_thinking_follows_request_then_server_default(qwen35: str) -> None:
    template = ChatTemplate(qwen35, eos_token="<|im_end|>")
    on = build_prompt(chat(), template)
    assert on.text.endswith("<|im_start|>assistant\n<think>\n") and on.think_open
    for plan in (build_prompt(chat(enable_thinking=False), template),
                 build_prompt(chat(), template, default_thinking=False),
                 build_prompt(chat(enable_thinking=False), template, default_thinking=True)):
        assert plan.text.endswith("<think>\n\n</think>\n\n") and not plan.think_open
    assert build_prompt(chat(enable_thinking=True), template, default_thinking=False).think_open


def test_forced_call_under_thinking_opens_nothing(qwen35: str) -> None:
    template = ChatTemplate(qwen35)
    forced = chat(tools=TOOLS, tool_choice=ToolChoice("required"))
    thinking = build_prompt(forced, template)
    assert thinking.answer_prefix == "" and thinking.tool_format == "qwen3_coder"
    plain = build_prompt(chat(tools=TOOLS, tool_choice=ToolChoice("required"),
                              enable_thinking=False), template)
    assert plain.text.endswith("</think>\n\n<tool_call>\n")


# ---- the grammars write the template's format ----------------------------------------


@pytest.fixture(scope="module")
def lltokenizer(model_path) -> llguidance.LLTokenizer:
    from butter.library import Model

    return Model.load(str(model_path)).grammars.tokenizer()


def follows(spec, text: str, tokenizer: llguidance.LLTokenizer) -> bool:
    """Whether the grammar takes ``text`` whole and may stop there."""
    matcher = llguidance.LLMatcher(tokenizer, spec.grammar, log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    tokens = real_tokenizer().tokenize(text)
    return matcher.consume_tokens(tokens) and not matcher.is_error() and matcher.is_accepting()


def grammar(template: str, **fields: Any):
    request = chat(tools=TOOLS, **fields)
    return grammar_for(request, build_prompt(request, ChatTemplate(template)))


def test_forced_xml_call_is_held_to_the_schema(qwen35: str, lltokenizer) -> None:
    spec = grammar(qwen35, tool_choice=ToolChoice("required"), enable_thinking=False)
    body = CALL.removeprefix("<tool_call>\n")
    assert follows(spec, body, lltokenizer)
    assert follows(spec, TIME_CALL.removeprefix("<tool_call>\n"), lltokenizer)
    for wrong in (body.replace("Paris", "Oslo"),  # not in the enum
                  body.replace("\n3\n", "\n9\n"),  # above the maximum
                  body.replace("true", "yes"),  # not a JSON boolean
                  body.replace("two\nlines", "a note far too long"),  # past maxLength
                  body.replace('{"lat": 48.9}', '{"lon": 2.3}'),  # the $ref's required key
                  body.replace("<parameter=days>\n3\n</parameter>\n", ""),  # required missing
                  body.replace("</function>\n", "</function>"),  # not the template's layout
                  '{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>'):
        assert not follows(spec, wrong, lltokenizer), wrong


def test_named_xml_call_names_that_tool(qwen35: str, lltokenizer) -> None:
    spec = grammar(qwen35, tool_choice=ToolChoice("function", "get_time"),
                   enable_thinking=False)
    assert follows(spec, TIME_CALL.removeprefix("<tool_call>\n"), lltokenizer)
    assert not follows(spec, CALL.removeprefix("<tool_call>\n"), lltokenizer)


def test_forced_call_after_thinking(qwen35: str, lltokenizer) -> None:
    spec = grammar(qwen35, tool_choice=ToolChoice("required"))
    assert spec.triggers == ()
    assert follows(spec, f"{THOUGHT}\n</think>\n\n{CALL}", lltokenizer)
    assert not follows(spec, f"{THOUGHT}\n</think>\n\nNo call today.", lltokenizer)


def test_auto_call_grammar_waits_for_the_end_of_thinking(qwen35: str, lltokenizer) -> None:
    spec = grammar(qwen35)
    assert (spec.triggers, spec.armed_by) == (("<tool_call>",), "</think>")
    assert follows(spec, CALL, lltokenizer)
    assert grammar(qwen35, enable_thinking=False).armed_by is None


def test_lazy_constraint_counts_a_call_only_after_thinking(qwen35: str, lltokenizer) -> None:
    from butter.engine.constraint import Constraint

    spec = grammar(qwen35)
    constraint = Constraint(llguidance.LLMatcher(lltokenizer, spec.grammar, log_level=0),
                            lltokenizer, triggers=spec.triggers, armed_by=spec.armed_by)
    tokenizer = real_tokenizer()

    def write(text: str) -> None:
        for token, piece in zip(tokenizer.tokenize(text), tokenizer.pieces(text), strict=True):
            constraint.advance(token, piece)

    write("I could write <tool_call>\n<function=get_time>\n")  # a valid start, but thinking
    assert not constraint.active
    write("</think>\n\nLet me check.\n<tool_call>")
    assert constraint.active and constraint.mask() is not None


def test_qwen3_coder_may_open_a_bare_call(templates: Path, qwen35: str, lltokenizer) -> None:
    # llama.cpp triggers Qwen3-Coder's lazy grammar on <function=NAME> too (it sometimes
    # leaves out <tool_call>), not Qwen3.5's (a thinking template).
    coder = (templates / "Qwen3-Coder.jinja").read_text()
    spec = grammar(coder)
    assert spec.triggers == ("<tool_call>", "<function=get_weather>", "<function=get_time>")
    bare = TIME_CALL.removeprefix("<tool_call>\n").removesuffix("\n</tool_call>")
    assert follows(spec, bare, lltokenizer) and follows(spec, CALL, lltokenizer)
    assert grammar(qwen35, enable_thinking=False).triggers == ("<tool_call>",)


def test_hermes_templates_keep_json_calls(lltokenizer) -> None:
    spec = grammar(real_tokenizer().chat_template, tool_choice=ToolChoice("required"))
    call = '{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>'
    assert follows(spec, call, lltokenizer)
    assert not follows(spec, TIME_CALL.removeprefix("<tool_call>\n"), lltokenizer)


def test_json_answer_after_thinking(qwen35: str, lltokenizer) -> None:
    from butter.chat.request import ResponseFormat

    request = chat(response_format=ResponseFormat(schema={"type": "object"}))
    spec = grammar_for(request, build_prompt(request, ChatTemplate(qwen35)))
    assert follows(spec, 'Plan it.\n</think>\n\n{"a": 1}', lltokenizer)
    assert not follows(spec, '{"a": 1}', lltokenizer)  # thinking comes first


# ---- answers read through the server, both SDKs --------------------------------------


def backend(*replies: str | Reply, qwen35: str, **options: Any) -> ScriptedBackend:
    return ScriptedBackend(list(replies), chat_template=qwen35, **options)


def openai_client(scripted: ScriptedBackend) -> openai.AsyncOpenAI:
    transport = httpx2.ASGITransport(app=create_app(scripted))
    return openai.AsyncOpenAI(base_url="http://butter.test/v1", api_key="x", max_retries=0,
                              http_client=httpx2.AsyncClient(transport=transport))


def anthropic_client(scripted: ScriptedBackend) -> anthropic.AsyncAnthropic:
    transport = httpx2.ASGITransport(app=create_app(scripted))
    return anthropic.AsyncAnthropic(base_url="http://butter.test", api_key="x", max_retries=0,
                                    http_client=httpx2.AsyncClient(transport=transport))


def calls_of(tool_calls: Any) -> list[tuple[str, Any]]:
    return [(call.function.name, json.loads(call.function.arguments)) for call in tool_calls]


async def stream_openai(client: openai.AsyncOpenAI, **request: Any) -> dict[str, Any]:
    """A streamed answer put together as a client does, checking the delta contract."""
    content, reasoning, finish = [], [], None
    calls: dict[int, dict[str, Any]] = {}
    async for chunk in await client.chat.completions.create(stream=True, **request):
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        delta = choice.delta
        content.append(delta.content or "")
        reasoning.append(getattr(delta, "reasoning_content", None) or "")
        for call in delta.tool_calls or []:
            if call.index not in calls:  # the first delta: id, type and name
                assert call.id.startswith("call_") and call.type == "function"
                assert call.function.name and not call.function.arguments
                calls[call.index] = {"name": call.function.name, "arguments": ""}
            else:  # later ones: arguments only
                assert call.id is None and not call.function.name
                calls[call.index]["arguments"] += call.function.arguments
        finish = choice.finish_reason or finish
    return {"content": "".join(content), "reasoning": "".join(reasoning), "finish": finish,
            "calls": [(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())]}


async def test_openai_thinking_and_typed_xml_calls(qwen35: str) -> None:
    client = openai_client(backend(THINK_THEN_CALLS, THINK_THEN_CALLS, qwen35=qwen35))
    request = {"model": "scripted", "messages": ASK, "tools": TOOLS, "max_tokens": 400}
    expected = [("get_weather", ARGUMENTS), ("get_time", {"zone": "Europe/Paris"})]
    reply = await client.chat.completions.create(**request)
    message = reply.choices[0].message
    assert reply.choices[0].finish_reason == "tool_calls"
    assert message.reasoning_content == THOUGHT
    assert not message.content and calls_of(message.tool_calls) == expected
    jsonschema.validate(expected[0][1], WEATHER)
    streamed = await stream_openai(client, **request)
    assert streamed == {"content": "", "reasoning": THOUGHT, "finish": "tool_calls",
                        "calls": expected}


async def test_openai_thinking_cut_by_max_tokens_is_reasoning(qwen35: str) -> None:
    long_thought = "Let me think about the weather in Paris for a long while. " * 4
    client = openai_client(backend(long_thought, long_thought, qwen35=qwen35))
    request = {"model": "scripted", "messages": ASK, "max_tokens": 12}
    reply = await client.chat.completions.create(**request)
    choice = reply.choices[0]
    assert choice.finish_reason == "length"
    assert not choice.message.content and long_thought.startswith(choice.message.reasoning_content)
    assert len(choice.message.reasoning_content) > 20
    streamed = await stream_openai(client, **request)
    assert streamed["finish"] == "length" and streamed["content"] == ""
    assert streamed["reasoning"] == choice.message.reasoning_content


async def test_openai_thinking_off_answers_in_content(qwen35: str) -> None:
    for options, fields in (({}, {"extra_body": {"chat_template_kwargs":
                                                 {"enable_thinking": False}}}),
                            ({"enable_thinking": False}, {})):
        scripted = backend(f"It is sunny.\n{CALL}", qwen35=qwen35, **options)
        reply = await openai_client(scripted).chat.completions.create(
            model="scripted", messages=ASK, tools=TOOLS, **fields)
        message = reply.choices[0].message
        assert scripted.plans[0].text.endswith("<think>\n\n</think>\n\n")
        assert message.content == "It is sunny."
        assert getattr(message, "reasoning_content", None) is None
        assert calls_of(message.tool_calls) == [("get_weather", ARGUMENTS)]


async def test_reasoning_sent_back_reaches_the_template(qwen35: str) -> None:
    # Qwen3.5's template shows the model its reasoning again within a tool loop (after
    # the last user turn), so a round that resends it keeps the prompt the model wrote.
    scripted = backend("Sunny it is.", "Sunny it is.", qwen35=qwen35)
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_time", "arguments": '{"zone": "CET"}'}}
    await openai_client(scripted).chat.completions.create(model="scripted", tools=TOOLS,
        messages=[*ASK, {"role": "assistant", "content": None, "reasoning_content": THOUGHT,
                         "tool_calls": [call]},
                  {"role": "tool", "tool_call_id": "call_1", "content": "10:00"}])
    await anthropic_client(scripted).messages.create(
        model="scripted", max_tokens=50, tools=ANTHROPIC_TOOLS, messages=[
            *ASK, {"role": "assistant", "content": [
                {"type": "thinking", "thinking": THOUGHT, "signature": ""},
                {"type": "tool_use", "id": "toolu_1", "name": "get_time",
                 "input": {"zone": "CET"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                          "content": "10:00"}]}])
    turn = (f"<|im_start|>assistant\n<think>\n{THOUGHT}\n</think>\n\n<tool_call>\n"
            "<function=get_time>\n<parameter=zone>\nCET\n</parameter>\n</function>\n"
            "</tool_call><|im_end|>")
    assert all(turn in plan.text for plan in scripted.plans), scripted.plans[0].text


async def test_anthropic_thinking_blocks_and_typed_tool_use(qwen35: str) -> None:
    client = anthropic_client(backend(THINK_THEN_CALLS, THINK_THEN_CALLS, qwen35=qwen35))
    request = {"model": "scripted", "max_tokens": 400, "messages": ASK,
               "tools": ANTHROPIC_TOOLS}
    expected = [("thinking", THOUGHT), ("tool_use", ("get_weather", ARGUMENTS)),
                ("tool_use", ("get_time", {"zone": "Europe/Paris"}))]
    message = await client.messages.create(**request)
    assert blocks_of(message) == expected and message.stop_reason == "tool_use"
    async with client.messages.stream(**request) as stream:
        kinds = [event.delta.type async for event in stream
                 if event.type == "content_block_delta"]
        final = await stream.get_final_message()
    assert kinds[0] == "thinking_delta" and "input_json_delta" in kinds
    assert blocks_of(final) == expected and final.stop_reason == "tool_use"


async def test_anthropic_thinking_cut_by_max_tokens(qwen35: str) -> None:
    thought = "Still weighing the forecast for Paris and Rome, day by day. " * 3
    client = anthropic_client(backend(thought, thought, qwen35=qwen35))
    request = {"model": "scripted", "max_tokens": 10, "messages": ASK}
    for message in (await client.messages.create(**request),
                    await _final(client.messages.stream(**request))):
        assert message.stop_reason == "max_tokens"
        assert [block.type for block in message.content] == ["thinking"]
        assert thought.startswith(message.content[0].thinking)


async def test_anthropic_thinking_disabled_renders_the_empty_block(qwen35: str) -> None:
    scripted = backend("Sunny.", qwen35=qwen35)
    message = await anthropic_client(scripted).messages.create(
        model="scripted", max_tokens=50, messages=ASK, thinking={"type": "disabled"})
    assert scripted.plans[0].text.endswith("<think>\n\n</think>\n\n")
    assert blocks_of(message) == [("text", "Sunny.")]


async def _final(manager: Any) -> Any:
    async with manager as stream:
        return await stream.get_final_message()


def test_no_markup_reaches_content_at_any_cut(qwen35: str) -> None:
    # Every token boundary of the shipped tokenizer is a chunk boundary here; the
    # character-level splits are in tests/core/test_recovery.py.
    from butter.chat.answer import AnswerReader

    plan = build_prompt(chat(tools=TOOLS), ChatTemplate(qwen35))
    reader = AnswerReader.for_plan(plan, tools=TOOLS, formats=None)
    deltas = [d for piece in real_tokenizer().pieces(THINK_THEN_CALLS) for d in reader.feed(piece)]
    deltas += reader.finish()
    assert not any(tag in getattr(d, "text", "") for d in deltas for tag in MARKUP
                   if type(d).__name__ == "ContentDelta")
    assert [c.name for c in reader.tool_calls] == ["get_weather", "get_time"]
    assert json.loads(reader.tool_calls[0].arguments) == ARGUMENTS


def test_names_the_xml_format_cannot_carry_are_refused(qwen35: str) -> None:
    from butter.errors import InvalidRequestError

    spaced = {"type": "object", "properties": {"the city": {"type": "string"}}}
    request = chat(tools=[{"type": "function", "function": {"name": "get_weather",
                                                            "parameters": spaced}}],
                   tool_choice=ToolChoice("required"), enable_thinking=False)
    with pytest.raises(InvalidRequestError, match="the city") as raised:
        grammar_for(request, build_prompt(request, ChatTemplate(qwen35)))
    assert raised.value.param == "tools"
