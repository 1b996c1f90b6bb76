"""JSON Schemas of the request bodies, for the published OpenAPI document.

The routes read their bodies themselves (``butter.chat.request`` and
``butter.wire.anthropic`` validate every field and name it in a 400), so litestar
cannot infer these; they are stated here once and attached to the OpenAPI schema
litestar builds (``GET /schema/openapi.json``). Unknown fields are accepted and
ignored, as the contract says, hence no ``additionalProperties: false``.
"""

from __future__ import annotations

from typing import Any

STRING = {"type": "string"}
TEXT_PART = {"type": "object", "required": ["type", "text"],
             "properties": {"type": {"enum": ["text", "input_text"]}, "text": STRING}}
STOP = {"anyOf": [STRING, {"type": "array", "items": STRING, "maxItems": 16}, {"type": "null"}]}
JSON_OBJECT = {"type": "object"}

_FUNCTION = {
    "type": "object", "required": ["name"],
    "properties": {"name": STRING, "description": STRING, "parameters": JSON_OBJECT},
}
_TOOL_CALL = {
    "type": "object", "required": ["function"],
    "properties": {"id": STRING, "type": {"enum": ["function"]},
                   "function": {"type": "object", "required": ["name"],
                                "properties": {"name": STRING, "arguments": STRING}}},
}
_CHAT_MESSAGE = {
    "type": "object", "required": ["role"],
    "properties": {
        "role": {"enum": ["system", "developer", "user", "assistant", "tool"]},
        "content": {"anyOf": [STRING, {"type": "array", "items": TEXT_PART}, {"type": "null"}]},
        "name": STRING,
        "tool_calls": {"type": "array", "items": _TOOL_CALL},
        "tool_call_id": STRING,
    },
}
_SAMPLING = {
    "temperature": {"type": "number", "minimum": 0, "maximum": 2},
    "top_p": {"type": "number", "minimum": 0, "maximum": 1},
    "seed": {"type": "integer"},
    "ignore_eos": {"type": "boolean"},
    "min_tokens": {"type": "integer", "minimum": 0},
    "stream": {"type": "boolean"},
    "top_k": {"type": "integer", "minimum": -1},
    "frequency_penalty": {"type": "number", "minimum": -2, "maximum": 2},
    "presence_penalty": {"type": "number", "minimum": -2, "maximum": 2},
    "repetition_penalty": {"type": "number", "minimum": 0.01, "maximum": 10},
    "logit_bias": {"type": "object", "maxProperties": 300,
                   "additionalProperties": {"type": "number", "minimum": -100,
                                            "maximum": 100}},
}

CHAT_COMPLETION = {
    "type": "object", "required": ["messages"],
    "properties": {
        "model": STRING,
        "messages": {"type": "array", "minItems": 1, "items": _CHAT_MESSAGE},
        "max_tokens": {"type": "integer", "minimum": 1},
        "max_completion_tokens": {"type": "integer", "minimum": 1},
        "stop": STOP,
        "n": {"type": "integer", "minimum": 1, "maximum": 16},
        "stream_options": {"type": "object",
                           "properties": {"include_usage": {"type": "boolean"}}},
        "tools": {"type": "array", "items": {
            "type": "object", "required": ["function"],
            "properties": {"type": {"enum": ["function"]}, "function": _FUNCTION}}},
        "tool_choice": {"anyOf": [
            {"enum": ["none", "auto", "required"]},
            {"type": "object", "required": ["type", "function"],
             "properties": {"type": {"enum": ["function"]},
                            "function": {"type": "object", "required": ["name"],
                                         "properties": {"name": STRING}}}}]},
        "chat_template_kwargs": {"type": "object",
                                 "properties": {"enable_thinking": {"type": "boolean"}}},
        "reasoning_effort": {"enum": ["low", "medium", "high", "minimal", "none"]},
        "logprobs": {"type": "boolean"},
        "top_logprobs": {"type": "integer", "minimum": 0, "maximum": 20},  # needs logprobs
        **_SAMPLING,
    },
}

_BLOCK = {
    "type": "object", "required": ["type"],
    "properties": {
        "type": {"enum": ["text", "tool_use", "tool_result", "thinking", "redacted_thinking"]},
        "text": STRING, "id": STRING, "name": STRING, "input": JSON_OBJECT,
        "tool_use_id": STRING, "is_error": {"type": "boolean"},
        "content": {"anyOf": [STRING, {"type": "array", "items": TEXT_PART}]},
    },
}
_ANTHROPIC_MESSAGE = {
    "type": "object", "required": ["role", "content"],
    "properties": {"role": {"enum": ["user", "assistant"]},
                   "content": {"anyOf": [STRING, {"type": "array", "items": _BLOCK}]}},
}
_ANTHROPIC_COMMON = {
    "model": STRING,
    "messages": {"type": "array", "minItems": 1, "items": _ANTHROPIC_MESSAGE},
    "system": {"anyOf": [STRING, {"type": "array", "items": TEXT_PART}]},
    "tools": {"type": "array", "items": {
        "type": "object", "required": ["name", "input_schema"],
        "properties": {"name": STRING, "description": STRING, "input_schema": JSON_OBJECT,
                       "type": {"enum": ["custom"]}}}},
    "tool_choice": {"type": "object", "required": ["type"],
                    "properties": {"type": {"enum": ["auto", "any", "none", "tool"]},
                                   "name": STRING}},
    "thinking": {"type": "object", "required": ["type"],
                 "properties": {"type": {"enum": ["enabled", "disabled", "adaptive"]},
                                "budget_tokens": {"type": "integer"}}},
}
MESSAGES = {
    # No `model`: the resident model answers a request that names none, on every route.
    "type": "object", "required": ["messages", "max_tokens"],
    "properties": {
        **_ANTHROPIC_COMMON,
        "max_tokens": {"type": "integer", "minimum": 1},
        "stop_sequences": STOP,
        **_SAMPLING,
        "temperature": {"type": "number", "minimum": 0, "maximum": 1},
    },
}
COUNT_TOKENS = {"type": "object", "required": ["messages"], "properties": _ANTHROPIC_COMMON}

_TOKENS = {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1}

COMPLETION = {
    "type": "object", "required": ["prompt"],
    "properties": {
        "model": STRING,
        "prompt": {"anyOf": [STRING, {"type": "array", "items": STRING, "minItems": 1,
                                      "maxItems": 16},
                             _TOKENS, {"type": "array", "items": _TOKENS, "minItems": 1,
                                       "maxItems": 16}]},
        "suffix": STRING,
        "logprobs": {"type": "integer", "minimum": 0, "maximum": 5},
        "max_tokens": {"type": "integer", "minimum": 1},
        "stop": STOP,
        "n": {"type": "integer", "minimum": 1, "maximum": 16},
        "echo": {"type": "boolean"},
        "stream_options": {"type": "object",
                           "properties": {"include_usage": {"type": "boolean"}}},
        **_SAMPLING,
    },
}

REQUEST_BODIES: dict[str, dict[str, Any]] = {
    "/v1/chat/completions": CHAT_COMPLETION,
    "/v1/completions": COMPLETION,
    "/v1/messages": MESSAGES,
    "/v1/messages/count_tokens": COUNT_TOKENS,
}
