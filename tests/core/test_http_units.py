"""SSE framing, request validation and the one error mapping, without a model."""

import json

import pytest
from litestar.exceptions import NotFoundException

from butter.errors import (
    ContextLengthExceededError,
    InternalError,
    InvalidRequestError,
    ModelNotFoundError,
)
from butter.http.common import sse
from butter.http.errors import as_butter_error, error_body
from butter.wire.anthropic import error_body as anthropic_body
from butter.wire.fields import parse_json_body
from butter.wire.openai import error_body as openai_body
from butter.wire.openai import parse_chat_completion


def test_sse_frames_one_json_event_per_data_line():
    frame = sse({"a": "é\nb"})
    assert frame == b'data: {"a":"\xc3\xa9\\nb"}\n\n'
    assert sse({"type": "ping"}, event="ping") == b'event: ping\ndata: {"type":"ping"}\n\n'


@pytest.mark.parametrize("raw, fragment", [
    (b"\xff\xfe", "UTF-8"),
    (b"{bad", "not valid JSON"),
    (b"[1, 2]", "JSON object"),
    (b"", "empty"),
])
def test_bodies_that_are_not_json_objects(raw, fragment):
    with pytest.raises(InvalidRequestError, match=fragment):
        parse_json_body(raw)


@pytest.mark.parametrize("body, param", [
    ({}, "messages"),
    ({"messages": "hi"}, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": 3}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": -1}, "max_tokens"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": "12"}, "max_tokens"),
    ({"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}, "temperature"),
    ({"messages": [{"role": "user", "content": "x"}], "stop": 5}, "stop"),
    ({"messages": [{"role": "user", "content": "x"}], "tool_choice": "maybe"}, "tool_choice"),
])
def test_wrong_fields_name_the_parameter(body, param):
    with pytest.raises(InvalidRequestError) as info:
        parse_chat_completion(body)
    assert info.value.param == param
    assert info.value.status_code == 400


def test_unknown_fields_are_ignored_and_aliases_read():
    request = parse_chat_completion({
        "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
        "max_completion_tokens": 7, "frobnicate": True, "stop": "END",
        "stream": True, "stream_options": {"include_usage": True}, "seed": 3,
    })
    assert request.messages[0]["content"] == "hi"
    assert request.params.max_tokens == 7 and request.params.stop == ("END",)
    assert request.params.seed == 3 and request.stream and request.include_usage


def test_error_envelopes():
    error = ContextLengthExceededError(prompt_tokens=10, requested_tokens=5, context_window=12)
    body = openai_body(error)
    assert body["error"]["code"] == "context_length_exceeded"
    assert body["error"]["type"] == "invalid_request_error"
    assert error.status_code == 400
    missing = ModelNotFoundError("x")
    assert missing.status_code == 404 and openai_body(missing)["error"]["code"] == "model_not_found"
    assert anthropic_body(missing) == {"type": "error", "error": {
        "type": "not_found_error", "message": missing.message}}
    assert error_body(missing, {"path": "/v1/messages/nope"})["type"] == "error"
    assert "type" not in error_body(missing, {"path": "/v1/nope"})


def test_unexpected_exceptions_never_leak_their_text():
    error = as_butter_error(RuntimeError("secret path /etc/x"))
    assert isinstance(error, InternalError) and error.status_code == 500
    assert "secret" not in json.dumps(openai_body(error))
    not_found = as_butter_error(NotFoundException())
    assert not_found.status_code == 404
