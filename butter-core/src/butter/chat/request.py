"""A chat request, validated: the one shape both API dialects are turned into.

Messages and tools are held in OpenAI's shape. ``butter.wire.openai`` and
``butter.wire.anthropic`` read their dialect's body into a :class:`ChatRequest` with
the shared field readers of ``butter.wire.fields`` and the message, tool and
response-format validators here. Every problem is an :class:`InvalidRequestError` naming the
field; unknown fields are ignored.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from typing import Any

import attrs

from butter.errors import InvalidRequestError
from butter.generation import GenerationParams
from butter.wire.fields import boolean

ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})
# Names the chat template receives from butter itself; a client may not set them.
RESERVED_TEMPLATE_KWARGS = frozenset({"messages", "tools", "add_generation_prompt",
                                      "bos_token", "eos_token", "documents"})


@attrs.frozen
class ToolChoice:
    mode: str = "auto"  # "none" | "auto" | "required" | "function"
    name: str | None = None


@attrs.frozen
class ResponseFormat:
    """``response_format`` json_object or json_schema: the answer is JSON (``schema``)."""

    schema: dict[str, Any]
    name: str = "json_object"
    strict: bool = False


@attrs.frozen
class ChatRequest:
    messages: list[dict[str, Any]]
    params: GenerationParams
    model: str | None = None
    stream: bool = False
    include_usage: bool = False
    tools: list[dict[str, Any]] = attrs.field(factory=list)
    tool_choice: ToolChoice = ToolChoice()
    template_kwargs: dict[str, Any] = attrs.field(factory=dict)
    enable_thinking: bool | None = None
    reasoning_effort: str | None = None
    n: int = 1  # choices: n generations, seeds seed, seed+1, ...
    raw_prompt: str | None = None  # /v1/completions: the prompt as is, no chat template
    prompt_tokens: tuple[int, ...] | None = None  # /v1/completions: the prompt as token ids
    suffix: str | None = None  # /v1/completions: fill in the middle, before this text
    echo: bool = False  # /v1/completions: the prompt leads each choice's text
    response_format: ResponseFormat | None = None  # None: free text

    @property
    def wants_tools(self) -> bool:
        return bool(self.tools) and self.tool_choice.mode != "none"


def parse_messages(value: Any) -> list[dict[str, Any]]:
    if value is None:
        raise InvalidRequestError("`messages` is required.", param="messages")
    if not isinstance(value, list) or not value:
        raise InvalidRequestError("`messages` must be a non-empty list.", param="messages")
    return [_message(item, index) for index, item in enumerate(value)]


def _message(item: Any, index: int) -> dict[str, Any]:
    where = f"messages[{index}]"
    if not isinstance(item, dict):
        raise InvalidRequestError(f"`{where}` must be an object.", param=where)
    role = item.get("role")
    if not isinstance(role, str) or role not in ROLES:
        raise InvalidRequestError(f"`{where}.role` must be one of {sorted(ROLES)}.",
                                  param=f"{where}.role")
    if item.get("content") is None and role in ("system", "developer", "user", "tool"):
        raise InvalidRequestError(f"`{where}.content` is required for a {role} message.",
                                  param=f"{where}.content")
    message: dict[str, Any] = {"role": role, "content": content_text(item.get("content"),
                                                                     f"{where}.content")}
    if role == "assistant" and item.get("tool_calls"):
        message["tool_calls"] = _history_tool_calls(item["tool_calls"], where)
    # An answer's reasoning sent back (vLLM's and llama-server's field; ``reasoning`` is
    # what some clients call it): templates that show reasoning (Qwen3.5, within a tool
    # loop) render it, the others ignore it.
    reasoning = item.get("reasoning_content", item.get("reasoning"))
    if role == "assistant" and isinstance(reasoning, str) and reasoning:
        message["reasoning_content"] = reasoning
    if role == "tool":
        message["tool_call_id"] = str(item.get("tool_call_id") or "")
    if isinstance(item.get("name"), str):
        message["name"] = item["name"]
    return message


def content_text(content: Any, where: str) -> str:
    """Message content as text: a string, or the text parts of a list."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, str):
                parts.append(part)
            elif isinstance(part, dict) and part.get("type") in ("text", "input_text"):
                if not isinstance(part.get("text"), str):
                    raise InvalidRequestError(f"`{where}` text parts need a string `text`.",
                                              param=where)
                parts.append(part["text"])
            else:
                raise InvalidRequestError(f"`{where}` holds a part this model cannot read "
                                          "(only text parts are supported).", param=where)
        return "".join(parts)
    raise InvalidRequestError(f"`{where}` must be a string or a list of parts.", param=where)


def _history_tool_calls(value: Any, where: str) -> list[dict[str, Any]]:
    if not isinstance(value, list):
        raise InvalidRequestError(f"`{where}.tool_calls` must be a list.", param=where)
    calls = []
    for call in value:
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise InvalidRequestError(f"`{where}.tool_calls` entries need a function name.",
                                      param=where)
        arguments = function.get("arguments", "{}")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments or "{}")
            except json.JSONDecodeError:
                pass  # kept as the client sent it
        calls.append({"id": call.get("id", ""), "type": "function",
                      "function": {"name": function["name"], "arguments": arguments}})
    return calls


SCHEMA_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


def parse_response_format(value: Any) -> ResponseFormat | None:
    """OpenAI's ``response_format``: text (None), json_object or json_schema."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise InvalidRequestError("`response_format` must be an object.",
                                  param="response_format")
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return ResponseFormat(schema={"type": "object"})
    if kind != "json_schema":
        raise InvalidRequestError("`response_format.type` must be text, json_object or "
                                  "json_schema.", param="response_format.type")
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise InvalidRequestError("`response_format.json_schema` is required with type "
                                  "json_schema: an object with `name` and `schema`.",
                                  param="response_format.json_schema")
    name = spec.get("name")
    if not isinstance(name, str) or not SCHEMA_NAME.fullmatch(name):
        raise InvalidRequestError("`response_format.json_schema.name` must be 1 to 64 letters, "
                                  "digits, underscores or dashes.",
                                  param="response_format.json_schema.name")
    schema = spec.get("schema")
    if not isinstance(schema, dict):
        raise InvalidRequestError("`response_format.json_schema.schema` must be a JSON Schema "
                                  "object.", param="response_format.json_schema.schema")
    strict = boolean(spec, "strict")
    return ResponseFormat(schema=schema, name=name, strict=bool(strict))


def tool_list(value: Any, read_tool: Callable[[Any, str], tuple[str, dict[str, Any],
                                                                 Mapping[str, Any]]]
              ) -> list[dict[str, Any]]:
    """A request's ``tools`` as OpenAI function tools (the shape prompt building expects).

    ``read_tool(tool, where)`` checks one entry in its wire dialect and gives its name,
    its parameters schema and the mapping whose ``description`` (if a string) is kept.
    """
    if value is None:
        return []
    if not isinstance(value, list):
        raise InvalidRequestError("`tools` must be a list.", param="tools")
    tools = []
    for index, tool in enumerate(value):
        name, parameters, described = read_tool(tool, f"tools[{index}]")
        entry = {"name": name, "parameters": parameters}
        if isinstance(described.get("description"), str):
            entry["description"] = described["description"]
        tools.append({"type": "function", "function": entry})
    return tools


def parse_tools(value: Any) -> list[dict[str, Any]]:
    return tool_list(value, _function_tool)


def _function_tool(tool: Any, where: str) -> tuple[str, dict[str, Any], Mapping[str, Any]]:
    function = tool.get("function") if isinstance(tool, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise InvalidRequestError(f"`{where}` must be a function tool with a name.",
                                  param=where)
    parameters = function.get("parameters") or {"type": "object", "properties": {}}
    if not isinstance(parameters, dict):
        raise InvalidRequestError(f"`{where}.function.parameters` must be an object.",
                                  param=where)
    return function["name"], parameters, function
