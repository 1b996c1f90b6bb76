"""Constrained decoding on the real model, through the official SDKs: response_format,
the SDK's ``.parse()``, forced and lazy tool calls, and no markup in content at any seed.

SmolLM2-135M writes neither JSON nor tool calls reliably on its own; every assertion
here holds because the grammar masks the logits, not because the model is good.
"""

from __future__ import annotations

import asyncio
import json
from typing import Literal

import anthropic
import jsonschema
import openai
import pydantic
import pytest

MODEL = "smollm2"
CITY = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 20},
    "population": {"type": "integer", "minimum": 0},
    "capital": {"type": "boolean"},
}, "required": ["city", "population", "capital"], "additionalProperties": False}
WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 20},
    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
}, "required": ["city", "unit"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
        "required": ["zone"], "additionalProperties": False}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                      "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "description": "Time in a zone",
                                      "parameters": TIME}},
]
SCHEMAS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]
FRANCE = [{"role": "user", "content": "Describe the capital of France as JSON."}]
MARKUP = ("<tool_call", "</tool_call", "<function=", "</function>")


def city_format(strict: bool = True) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY,
                                                   "strict": strict}}


def check_calls(message, allowed=SCHEMAS) -> None:
    assert message.tool_calls, message
    for call in message.tool_calls:
        assert call.function.name in allowed
        jsonschema.validate(json.loads(call.function.arguments), allowed[call.function.name])
    assert not any(tag in (message.content or "") for tag in MARKUP)


# ---- response_format --------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_schema_answer_validates(openai_client, temperature) -> None:
    reply = openai_client.chat.completions.create(
        model=MODEL, messages=FRANCE, response_format=city_format(), temperature=temperature,
        seed=3, max_tokens=80)
    assert reply.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(reply.choices[0].message.content), CITY)


def test_json_schema_streamed(openai_client) -> None:
    chunks = list(openai_client.chat.completions.create(
        model=MODEL, messages=FRANCE, response_format=city_format(), temperature=0,
        max_tokens=80, stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    jsonschema.validate(json.loads(text), CITY)
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_json_object_is_an_object(openai_client) -> None:
    reply = openai_client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "List three colours."}],
        response_format={"type": "json_object"}, temperature=0, max_tokens=120)
    if reply.choices[0].finish_reason == "stop":  # an object cut by max_tokens is no JSON
        assert isinstance(json.loads(reply.choices[0].message.content), dict)
    assert reply.choices[0].message.content.startswith("{")


class City(pydantic.BaseModel):
    city: str = pydantic.Field(max_length=20)
    population: int
    kind: Literal["capital", "town", "village"]


def test_sdk_parse_round_trip(openai_client) -> None:
    completion = openai_client.chat.completions.parse(
        model=MODEL, messages=FRANCE, response_format=City, temperature=0, max_tokens=80)
    parsed = completion.choices[0].message.parsed
    assert isinstance(parsed, City) and parsed.kind in ("capital", "town", "village")


def test_legacy_completion_honours_json_schema(openai_client) -> None:
    for stream in (False, True):
        reply = openai_client.completions.create(
            model=MODEL, prompt="The capital of France, as JSON:", max_tokens=80,
            temperature=0, stream=stream, extra_body={"response_format": city_format()})
        text = "".join(c.choices[0].text for c in reply) if stream else reply.choices[0].text
        jsonschema.validate(json.loads(text), CITY)


@pytest.mark.parametrize(("value", "param"), [
    ({"type": "sound"}, "response_format.type"),
    ({"type": "json_schema"}, "response_format.json_schema"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": 123}},
     "response_format.json_schema.schema"),
    ({"type": "json_schema", "json_schema": {"schema": {}}}, "response_format.json_schema.name"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}},
     "response_format"),
])
def test_invalid_response_format_is_a_400_naming_it(openai_client, value, param) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        openai_client.chat.completions.create(model=MODEL, messages=FRANCE, max_tokens=4,
                                              response_format=value)
    assert info.value.body["param"] == param and info.value.body["type"] == \
        "invalid_request_error"
    assert openai_client.chat.completions.create(model=MODEL, messages=FRANCE, max_tokens=2)


# ---- tool calls -------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("choice", ["required", {"type": "function",
                                                 "function": {"name": "get_time"}}])
def test_forced_calls_validate(openai_client, choice, stream) -> None:
    allowed = SCHEMAS if choice == "required" else {"get_time": TIME}
    request = dict(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=choice, temperature=0,
                   max_tokens=80)
    if not stream:
        reply = openai_client.chat.completions.create(**request)
        assert reply.choices[0].finish_reason == "tool_calls"
        check_calls(reply.choices[0].message, allowed)
        return
    chunks = list(openai_client.chat.completions.create(**request, stream=True))
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    names = [d.function.name for c in chunks if c.choices for d in c.choices[0].delta.tool_calls
             or () if d.function and d.function.name]
    arguments = "".join(d.function.arguments or "" for c in chunks if c.choices
                        for d in c.choices[0].delta.tool_calls or () if d.function)
    assert len(names) == 1 and names[0] in allowed and not content.strip()
    jsonschema.validate(json.loads(arguments), allowed[names[0]])
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


@pytest.mark.slow  # up to 16 sampled answers of 80 tokens (7 minutes on a busy machine)
def test_auto_call_is_constrained_once_opened(openai_client) -> None:
    """The model is free until it writes <tool_call>; told to copy a call with a wrong
    argument, it still produces a call that validates."""
    copy = ('Repeat exactly: <tool_call>\n{"name": "get_weather", "arguments": '
            '{"city": "Paris", "unit": "kelvin"}}\n</tool_call>')
    made = 0
    for seed in range(16):  # SmolLM2 opens the call in about a third of its samples
        reply = openai_client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": copy}], tools=TOOLS,
            temperature=0.7, seed=seed, max_tokens=80)
        message = reply.choices[0].message
        assert not any(tag in (message.content or "") for tag in MARKUP)
        if message.tool_calls:
            made += 1
            check_calls(message)
            if made == 2:
                break
    assert made, "the model never opened a call"


@pytest.fixture(scope="module")
def claude(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.root, api_key="-", max_retries=0, timeout=120)


@pytest.mark.parametrize("choice", [{"type": "any"}, {"type": "tool", "name": "get_weather"}])
def test_anthropic_forced_tool_use(claude, choice) -> None:
    tools = [{"name": t["function"]["name"], "description": t["function"]["description"],
              "input_schema": t["function"]["parameters"]} for t in TOOLS]
    message = claude.messages.create(model=MODEL, messages=ASK, tools=tools, tool_choice=choice,
                                     max_tokens=80, extra_body={"temperature": 0})
    uses = [block for block in message.content if block.type == "tool_use"]
    assert message.stop_reason == "tool_use" and len(uses) == 1
    allowed = SCHEMAS if choice["type"] == "any" else {"get_weather": WEATHER}
    assert uses[0].name in allowed
    jsonschema.validate(uses[0].input, allowed[uses[0].name])
    text = "".join(block.text for block in message.content if block.type == "text")
    assert not any(tag in text for tag in MARKUP)


@pytest.mark.parametrize("choice", ["auto", "required"])
def test_no_markup_in_content_at_any_seed(openai_client, choice) -> None:
    copy = ("Repeat exactly: <tool_call>\n{{1}} // 1\n</tool_call}}\n</tool_call> and then "
            "<tool_call>\n{\"name\": \"get_weather\"")
    for seed in range(8):
        request = dict(model=MODEL, messages=[{"role": "user", "content": copy}], tools=TOOLS,
                       tool_choice=choice, temperature=1.0, seed=seed, max_tokens=48)
        message = openai_client.chat.completions.create(**request).choices[0].message
        assert not any(tag in (message.content or "") for tag in MARKUP), (seed, message)
        chunks = openai_client.chat.completions.create(**request, stream=True)
        streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert not any(tag in streamed for tag in MARKUP), (seed, streamed)


# ---- in the fused batch -----------------------------------------------------------------


def test_constrained_requests_share_model_passes(server) -> None:
    client = openai.AsyncOpenAI(base_url=server.base_url, api_key="-", max_retries=0,
                                timeout=120)
    listing = {"type": "json_schema", "json_schema": {"name": "words", "schema": {
        "type": "object", "properties": {"words": {"type": "array", "items": {
            "type": "string", "maxLength": 12}}}, "required": ["words"]}}}

    async def run() -> list:
        free = [client.chat.completions.create(
            model=MODEL, messages=FRANCE, max_tokens=32, temperature=0,
            extra_body={"ignore_eos": True}) for _ in range(2)]
        bound = [client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Many French words, as JSON."}],
            max_tokens=32, temperature=0, response_format=listing) for _ in range(2)]
        return await asyncio.gather(*free, *bound)

    before = server.wait_idle()
    replies = asyncio.run(run())
    after = server.wait_idle()
    generated = after["butter_generated_tokens_total"] - before["butter_generated_tokens_total"]
    steps = after["butter_decode_steps_total"] - before["butter_decode_steps_total"]
    assert generated == sum(r.usage.completion_tokens for r in replies)
    # Four requests decoded alone would take about ``generated`` steps; together, a third.
    assert steps < generated / 2, (steps, generated)
