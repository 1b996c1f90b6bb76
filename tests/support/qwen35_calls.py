"""Forced calls on the tiny random-weight Qwen3.5: tools whose values a random model
can finish, and the checks a client relies on. Shared by the GGUF and MLX tests.

A random-weight model writes nothing on purpose: every call is the grammar's doing. Each
schema bounds its values (enums, ranges, ``maxLength``, ``maxItems``), as a random model
would otherwise write a string until ``max_tokens``.
"""

from __future__ import annotations

import json
from typing import Any

import jsonschema

WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
    "days": {"type": "integer", "minimum": 1, "maximum": 7},
    "metric": {"type": "boolean"},
    "note": {"type": "string", "maxLength": 8},
    "tags": {"type": "array", "items": {"type": "string", "enum": ["warm", "dry"]},
             "maxItems": 2},
}, "required": ["city", "days", "metric", "note"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
        "required": ["zone"], "additionalProperties": False}
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
TOOLS = [{"type": "function", "function": {"name": name, "parameters": schema}}
         for name, schema in SCHEMAS.items()]
ANTHROPIC_TOOLS = [{"name": name, "input_schema": schema} for name, schema in SCHEMAS.items()]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}
MARKUP = ("<tool_call", "</tool_call", "<function=", "</function", "<parameter", "<think",
          "</think")


def check_typed(name: str, arguments: dict[str, Any], allowed=SCHEMAS) -> None:
    """The call names an allowed tool and its arguments are of its schema, typed."""
    assert name in allowed
    jsonschema.validate(arguments, allowed[name])
    if name == "get_weather":  # the XML text became JSON values of the schema's types
        assert type(arguments["days"]) is int and type(arguments["metric"]) is bool
        assert isinstance(arguments["note"], str)
        assert isinstance(arguments.get("tags", []), list)


def check_xml_written(logprobs: Any, name: str) -> None:
    """The tokens the model drew after the prompt's ``<tool_call>\\n`` are a Qwen3-Coder
    XML call, laid out as the template writes one."""
    written = "".join(token.token for token in logprobs.content)
    assert written.startswith(f"<function={name}>\n<parameter="), written
    assert written.rstrip().endswith("</function>\n</tool_call>"), written


def streamed_calls(stream: Any) -> tuple[list[tuple[str, dict[str, Any]]], str, str]:
    """(calls, content, finish_reason) from a streamed chat completion, checking that the
    first delta of a call carries id, type and name and later ones arguments only."""
    calls: dict[int, dict[str, str]] = {}
    content, finish = "", ""
    for chunk in stream:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for call in choice.delta.tool_calls or []:
            if call.index not in calls:
                assert call.id.startswith("call_") and call.type == "function"
                assert call.function.name and not call.function.arguments
                calls[call.index] = {"name": call.function.name, "arguments": ""}
            else:
                assert call.id is None and not call.function.name
                calls[call.index]["arguments"] += call.function.arguments
        finish = choice.finish_reason or finish
    return [(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())], \
        content, finish
