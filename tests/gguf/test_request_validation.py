"""Requests OpenAI refuses are refused here too, through the SDK against the real
server: a 400 whose error body names the field, never a 200 that ignores it."""

from __future__ import annotations

import openai
import pytest

MODEL = "smollm2"
ASK = [{"role": "user", "content": "Say hi."}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.mark.parametrize(("fields", "param"), [
    ({"tool_choice": NAMED}, "tool_choice"),  # names a function, and there are no tools
    ({"tool_choice": "required"}, "tool_choice"),  # a call is required, of no tool
    ({"presence_penalty": 3}, "presence_penalty"),  # OpenAI's range is -2..2
    ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"logprobs": True, "top_logprobs": 30}, "top_logprobs"),  # at most 20
    ({"messages": [{"role": "user"}]}, "messages[0].content"),
])
def test_what_openai_refuses_is_a_400_naming_the_field(openai_client, fields, param) -> None:
    body = {"model": MODEL, "messages": ASK, "max_tokens": 2, **fields}
    with pytest.raises(openai.BadRequestError) as info:
        openai_client.chat.completions.create(**body)
    error = info.value.body
    assert info.value.status_code == 400
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert f"`{param}" in error["message"]
    assert openai_client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=1)
