"""What the HTTP edge refuses before anything behind it runs: bodies, text, fields."""

import json

import pytest

from butter.errors import InvalidRequestError
from butter.wire.anthropic import parse_messages_request
from butter.wire.fields import MAX_JSON_DEPTH, parse_json_body
from butter.wire.openai import parse_chat_completion

USER = [{"role": "user", "content": "hi"}]
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {}}}


def chat_body(**fields) -> bytes:
    return json.dumps({"messages": USER, **fields}).encode()


@pytest.mark.parametrize("raw, fragment", [
    (b"[" * 100_000 + b"]" * 100_000, "nests deeper"),
    (b'{"a": ' + b"[" * (MAX_JSON_DEPTH + 1) + b"]" * (MAX_JSON_DEPTH + 1) + b"}",
     "nests deeper"),
    (b'{"max_tokens": 1' + b"0" * 5000 + b"}", "number too large"),
])
def test_hostile_json_is_a_400_not_a_crash(raw, fragment):
    with pytest.raises(InvalidRequestError, match=fragment) as info:
        parse_json_body(raw)
    assert info.value.status_code == 400


@pytest.mark.parametrize("raw, param", [
    (b'{"messages": [{"role": "user", "content": "a\\ud800b"}]}', "messages[0].content"),
    (b'{"messages": [{"role": "system", "content": [{"type": "text", "text": "\\udfff"}]}]}',
     "messages[0].content[0].text"),
    (b'{"tools": [{"type": "function", "function": {"name": "\\ud800"}}]}',
     "tools[0].function.name"),
    (b'{"model": "\\ud83d"}', "model"),
    (b'{"\\ud800": 1}', "?"),  # a bad key is named as well as it can be
])
def test_lone_surrogates_are_refused_and_named(raw, param):
    with pytest.raises(InvalidRequestError, match="lone UTF-16 surrogate") as info:
        parse_json_body(raw)
    assert info.value.param == param


def test_a_valid_surrogate_pair_is_text():
    body = parse_json_body(b'{"messages": [{"role": "user", "content": "\\ud83d\\ude00"}]}')
    assert body["messages"][0]["content"] == "\N{GRINNING FACE}"


@pytest.mark.parametrize("role", [["user"], {"a": 1}, None, 5])
def test_role_of_the_wrong_type_is_a_400(role):
    with pytest.raises(InvalidRequestError) as info:
        parse_chat_completion({"messages": [{"role": role, "content": "x"}]})
    assert info.value.param == "messages[0].role"


@pytest.mark.parametrize("key", ["tools", "messages", "add_generation_prompt", "bos_token"])
def test_template_kwargs_may_not_set_what_the_server_renders(key):
    with pytest.raises(InvalidRequestError, match=key) as info:
        parse_chat_completion({"messages": USER, "chat_template_kwargs": {key: []}})
    assert info.value.param == "chat_template_kwargs"


def test_tool_choice_must_name_a_declared_tool_on_both_routes():
    named = {"type": "function", "function": {"name": "my_function"}}
    with pytest.raises(InvalidRequestError, match="my_function"):
        parse_chat_completion({"messages": USER, "tools": [TOOL], "tool_choice": named})
    with pytest.raises(InvalidRequestError):
        parse_chat_completion({"messages": USER, "tool_choice": named})
    with pytest.raises(InvalidRequestError, match="needs `tools`"):
        parse_chat_completion({"messages": USER, "tool_choice": "required"})
    chosen = parse_chat_completion({"messages": USER, "tools": [TOOL], "tool_choice": {
        "type": "function", "function": {"name": "get_weather"}}}).tool_choice
    assert (chosen.mode, chosen.name) == ("function", "get_weather")

    anthropic = {"model": "m", "max_tokens": 5, "messages": USER}
    with pytest.raises(InvalidRequestError):
        parse_messages_request({**anthropic, "tool_choice": {"type": "tool", "name": "x"}})
    with pytest.raises(InvalidRequestError, match="needs `tools`"):
        parse_messages_request({**anthropic, "tool_choice": {"type": "any"}})


@pytest.mark.parametrize(("field", "value"), [
    ("frequency_penalty", -3), ("presence_penalty", 3), ("repetition_penalty", 0),
    ("top_k", -2), ("top_k", 1.5), ("logit_bias", {"abc": 1}), ("logit_bias", {"5": 101}),
    ("logit_bias", [1, 2]), ("logprobs", "yes"), ("top_logprobs", 30), ("top_logprobs", 2),
    ("response_format", {"type": "sound"}), ("response_format", {"type": "json_schema"}),
    ("response_format", {"type": "json_schema", "json_schema": {"schema": 123}}),
])
def test_sampling_and_output_fields_are_honoured_or_refused(field, value):
    with pytest.raises(InvalidRequestError) as info:
        parse_chat_completion({"messages": USER, field: value})
    assert info.value.param.startswith(field)


def test_sampling_fields_reach_the_generation_params():
    params = parse_chat_completion({
        "messages": USER, "top_k": 5, "frequency_penalty": 0.5, "presence_penalty": -0.5,
        "repetition_penalty": 1.1, "logit_bias": {"17": -100, "3": 2.5},
        "response_format": {"type": "text"}, "logprobs": False}).params
    assert (params.top_k, params.frequency_penalty, params.presence_penalty) == (5, 0.5, -0.5)
    assert params.repetition_penalty == 1.1 and params.logit_bias == ((3, 2.5), (17, -100.0))
    assert parse_chat_completion({"messages": USER, "top_k": -1}).params.top_k == 0  # off


def test_a_user_message_needs_content():
    with pytest.raises(InvalidRequestError) as info:
        parse_chat_completion({"messages": [{"role": "user"}]})
    assert info.value.param == "messages[0].content"


@pytest.mark.parametrize("bad", ["x", -1, 1.5])
def test_max_tokens_is_checked_even_beside_max_completion_tokens(bad):
    with pytest.raises(InvalidRequestError) as info:
        parse_chat_completion({"messages": USER, "max_tokens": bad, "max_completion_tokens": 1})
    assert info.value.param == "max_tokens"
