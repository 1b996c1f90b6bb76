"""Constrained decoding on the MLX back end: the same grammar engine masks MLX logits."""

import json

import jsonschema
import openai
import pytest

pytestmark = pytest.mark.slow  # MLX on a CPU: seconds per request

CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                         "capital": {"type": "boolean"}},
        "required": ["city", "capital"], "additionalProperties": False}
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
           "required": ["city"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]


def test_json_schema_and_forced_call_on_mlx(mlx_server):
    client = openai.OpenAI(base_url=mlx_server.base_url, api_key="-", max_retries=0,
                           timeout=300)
    reply = client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "Paris, as JSON."}],
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": CITY}},
        temperature=0, max_tokens=40)
    assert reply.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(reply.choices[0].message.content), CITY)
    call = client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "Weather in Paris?"}],
        tools=TOOLS, tool_choice="required", temperature=0, max_tokens=40).choices[0].message
    assert call.tool_calls and call.tool_calls[0].function.name == "get_weather"
    jsonschema.validate(json.loads(call.tool_calls[0].function.arguments), WEATHER)


def test_logprobs_on_mlx(mlx_server):
    client = openai.OpenAI(base_url=mlx_server.base_url, api_key="-", max_retries=0,
                           timeout=300)
    reply = client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "Name a colour."}],
        temperature=0, max_tokens=4, logprobs=True, top_logprobs=2)
    entries = reply.choices[0].logprobs.content
    assert "".join(e.token for e in entries) == reply.choices[0].message.content
    assert all(e.top_logprobs[0].token == e.token and e.logprob <= 0 for e in entries)
