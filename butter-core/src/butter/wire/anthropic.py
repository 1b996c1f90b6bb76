"""The Anthropic Messages API in butter's terms: pure translation, no I/O.

``parse_messages_request`` turns a ``POST /v1/messages`` body into the same
:class:`~butter.chat.request.ChatRequest` ``butter.wire.openai`` builds: ``system`` becomes
the first message, ``tool_use`` blocks become assistant ``tool_calls`` and
``tool_result`` blocks become ``tool`` messages, so prompt building, sessions and
recovery are shared with ``/v1/chat/completions``.

:class:`MessageBuilder` goes the other way: it turns the recovered deltas into
content blocks (``thinking``, ``text``, ``tool_use``) and, for a stream, into the
event sequence ``message_start``, ``content_block_start`` / ``_delta`` / ``_stop``
per block, ``message_delta``, ``message_stop``.

Usage follows Anthropic's accounting: ``input_tokens`` are the prompt tokens that
were not read from the cache, ``cache_read_input_tokens`` the ones that were (the
session's reused prefix); their sum is the whole prompt, as ``count_tokens`` says.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Mapping
from typing import Any

import attrs

from butter.chat.recovery import (
    ContentDelta,
    Delta,
    ReasoningDelta,
    ToolCallArguments,
    ToolCallStart,
)
from butter.chat.request import ChatRequest, ToolChoice, content_text, tool_list
from butter.errors import ButterError, InvalidRequestError
from butter.generation import Usage
from butter.wire.fields import JSON_OBJECT, SAMPLING, STOP, STRING, TEXT_PART, generation_params

MAX_TEMPERATURE = 1.0  # Anthropic's range is 0..1 (OpenAI's is 0..2)
ROUTE_PREFIX = "/v1/messages"  # this dialect's routes, and its unknown subroutes' errors
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}

StreamEvent = tuple[str, dict[str, Any]]  # (SSE event name, data)


# ---- request ---------------------------------------------------------------------------


def parse_messages_request(body: Mapping[str, Any], *, for_count: bool = False) -> ChatRequest:
    """A ``/v1/messages`` body as a :class:`ChatRequest`.

    ``for_count`` reads a ``/v1/messages/count_tokens`` body, which has no
    ``max_tokens``. Every problem is an :class:`InvalidRequestError` naming the field.
    """
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise InvalidRequestError("`model` must be a string.", param="model")
    if not for_count and body.get("max_tokens") is None:
        raise InvalidRequestError("`max_tokens` is required.", param="max_tokens")
    temperature = body.get("temperature")
    if isinstance(temperature, (int, float)) and not isinstance(temperature, bool) \
            and temperature > MAX_TEMPERATURE:
        raise InvalidRequestError(f"`temperature` must be between 0 and {MAX_TEMPERATURE}.",
                                  param="temperature")
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise InvalidRequestError("`stream` must be a boolean.", param="stream")
    tools = _tools(body.get("tools"))
    return ChatRequest(
        messages=[*_system(body.get("system")), *_messages(body.get("messages"))],
        params=generation_params(body, max_tokens_keys=("max_tokens",),
                                 stop_key="stop_sequences"),
        model=model,
        stream=bool(stream) and not for_count,
        tools=tools,
        tool_choice=_tool_choice(body.get("tool_choice"), tools),
        enable_thinking=_thinking(body.get("thinking")),
    )


def _system(value: Any) -> list[dict[str, Any]]:
    text = content_text(value, "system")
    return [{"role": "system", "content": text}] if text else []


def _messages(value: Any) -> list[dict[str, Any]]:
    if value is None:
        raise InvalidRequestError("`messages` is required.", param="messages")
    if not isinstance(value, list) or not value:
        raise InvalidRequestError("`messages` must be a non-empty list.", param="messages")
    out: list[dict[str, Any]] = []
    for index, item in enumerate(value):
        where = f"messages[{index}]"
        if not isinstance(item, dict):
            raise InvalidRequestError(f"`{where}` must be an object.", param=where)
        role = item.get("role")
        content = item.get("content")
        if role == "user":
            out += _user_turn(content, where)
        elif role == "assistant":
            out.append(_assistant_turn(content, where))
        else:
            raise InvalidRequestError(f"`{where}.role` must be `user` or `assistant`.",
                                      param=f"{where}.role")
    return out


def _blocks(content: Any, where: str) -> list[tuple[str, str, dict[str, Any]]]:
    """Message content as (where, type, block) per block; a string is one text block."""
    if isinstance(content, str):
        content = [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise InvalidRequestError(f"`{where}.content` must be a string or a list of blocks.",
                                  param=f"{where}.content")
    out = []
    for position, block in enumerate(content):
        at = f"{where}.content[{position}]"
        if not isinstance(block, dict) or not isinstance(block.get("type"), str):
            raise InvalidRequestError(f"`{at}` must be a block with a `type`.", param=at)
        out.append((at, block["type"], block))
    return out


def _user_turn(content: Any, where: str) -> list[dict[str, Any]]:
    """A user turn: its tool results as ``tool`` messages and its text as a user one,
    in the order the blocks came."""
    out: list[dict[str, Any]] = []
    text: list[str] = []

    def flush_text() -> None:
        if text:
            out.append({"role": "user", "content": "".join(text)})
            text.clear()

    for at, kind, block in _blocks(content, where):
        if kind == "text":
            text.append(content_text([block], at))
        elif kind == "tool_result":
            flush_text()
            out.append(_tool_result(block, at))
        else:
            raise InvalidRequestError(f"`{at}` is a `{kind}` block; user turns may hold "
                                      "`text` and `tool_result` blocks.", param=at)
    flush_text()
    if not out:  # an empty turn still is a turn
        out.append({"role": "user", "content": ""})
    return out


def _tool_result(block: Mapping[str, Any], where: str) -> dict[str, Any]:
    call_id = block.get("tool_use_id")
    if not isinstance(call_id, str) or not call_id:
        raise InvalidRequestError(f"`{where}.tool_use_id` must be a non-empty string.",
                                  param=f"{where}.tool_use_id")
    text = content_text(block.get("content"), f"{where}.content")
    if block.get("is_error") is True:
        text = f"Error: {text}" if text else "Error"
    return {"role": "tool", "content": text, "tool_call_id": call_id}


def _assistant_turn(content: Any, where: str) -> dict[str, Any]:
    text: list[str] = []
    thinking: list[str] = []
    calls: list[dict[str, Any]] = []
    for at, kind, block in _blocks(content, where):
        if kind == "text":
            text.append(content_text([block], at))
        elif kind == "tool_use":
            calls.append(_tool_use(block, at))
        elif kind == "thinking":
            # Handed to the template as reasoning_content: one that shows reasoning
            # (Qwen3.5, within a tool loop) shows the model its own again.
            if isinstance(block.get("thinking"), str):
                thinking.append(block["thinking"])
        elif kind == "redacted_thinking":
            continue  # nothing butter can read
        else:
            raise InvalidRequestError(f"`{at}` is a `{kind}` block; assistant turns may hold "
                                      "`text`, `thinking` and `tool_use` blocks.", param=at)
    message: dict[str, Any] = {"role": "assistant", "content": "".join(text)}
    if thinking:
        message["reasoning_content"] = "\n".join(thinking)
    if calls:
        message["tool_calls"] = calls
    return message


def _tool_use(block: Mapping[str, Any], where: str) -> dict[str, Any]:
    call_id, name, arguments = block.get("id"), block.get("name"), block.get("input", {})
    if not isinstance(call_id, str) or not call_id:
        raise InvalidRequestError(f"`{where}.id` must be a non-empty string.",
                                  param=f"{where}.id")
    if not isinstance(name, str) or not name:
        raise InvalidRequestError(f"`{where}.name` must be a non-empty string.",
                                  param=f"{where}.name")
    if not isinstance(arguments, dict):
        raise InvalidRequestError(f"`{where}.input` must be an object.", param=f"{where}.input")
    return {"id": call_id, "type": "function",
            "function": {"name": name, "arguments": arguments}}


def _tools(value: Any) -> list[dict[str, Any]]:
    """Anthropic tools as OpenAI function tools (the shape prompt building expects)."""
    return tool_list(value, _custom_tool)


def _custom_tool(tool: Any, where: str) -> tuple[str, dict[str, Any], Mapping[str, Any]]:
    if not isinstance(tool, dict) or not isinstance(tool.get("name"), str) or not tool["name"]:
        raise InvalidRequestError(f"`{where}` must be a tool with a `name`.", param=where)
    if tool.get("type") not in (None, "custom") or not isinstance(tool.get("input_schema"),
                                                                 dict):
        raise InvalidRequestError(f"`{where}` must be a custom tool with an `input_schema` "
                                  "object (server tools are not supported).", param=where)
    return tool["name"], tool["input_schema"], tool


def _tool_choice(value: Any, tools: list[dict[str, Any]]) -> ToolChoice:
    if value is None:
        return ToolChoice()
    kind = value.get("type") if isinstance(value, dict) else None
    if kind in ("auto", "none"):
        return ToolChoice(mode=kind)
    if kind == "any":
        if not tools:
            raise InvalidRequestError('`tool_choice: {"type": "any"}` needs `tools`.',
                                      param="tool_choice")
        return ToolChoice(mode="required")
    if kind == "tool":
        name = value.get("name")
        if not isinstance(name, str) or name not in {t["function"]["name"] for t in tools}:
            raise InvalidRequestError("`tool_choice.name` must name one of `tools`.",
                                      param="tool_choice.name")
        return ToolChoice(mode="function", name=name)
    raise InvalidRequestError('`tool_choice` must be {"type": "auto" | "any" | "none"} or '
                              '{"type": "tool", "name": ...}.', param="tool_choice")


def _thinking(value: Any) -> bool | None:
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind not in ("enabled", "disabled", "adaptive"):
        raise InvalidRequestError('`thinking` must be {"type": "enabled" | "disabled"}.',
                                  param="thinking")
    return kind != "disabled"


# ---- response --------------------------------------------------------------------------


def new_message_id() -> str:
    return "msg_" + secrets.token_hex(12)


def tool_use_id(call_id: str) -> str:
    """Anthropic spells tool call ids ``toolu_…``; the recovered ones are ``call_…``."""
    return "toolu_" + call_id.removeprefix("call_")


def stop_reason(finish_reason: str | None, stop_sequence: str | None) -> str:
    """The engine's finish reason in Anthropic's words."""
    if finish_reason == "tool_calls":
        return "tool_use"
    if finish_reason == "length":
        return "max_tokens"
    if stop_sequence is not None:
        return "stop_sequence"
    return "end_turn"


def _stop_fields(finish_reason: str | None, stop_sequence: str | None) -> dict[str, Any]:
    reason = stop_reason(finish_reason, stop_sequence)
    return {"stop_reason": reason,
            "stop_sequence": stop_sequence if reason == "stop_sequence" else None}


def usage_body(usage: Usage | None) -> dict[str, int]:
    usage = usage or Usage(0, 0, 0)
    return {
        "input_tokens": usage.prompt_tokens - usage.cached_tokens,
        "output_tokens": usage.completion_tokens,
        "cache_read_input_tokens": usage.cached_tokens,
        "cache_creation_input_tokens": 0,
    }


@attrs.define
class MessageBuilder:
    """Collects one answer's deltas into Anthropic content blocks.

    ``add`` returns the stream events each delta causes; a non-streaming route
    ignores them and reads ``message()`` at the end, so both shapes hold the same
    blocks. A text or thinking block opens at its first non-blank text: blank text
    between two blocks (or alone) makes no block.
    """

    message_id: str
    model: str
    blocks: list[dict[str, Any]] = attrs.field(factory=list, init=False)
    _open: bool = attrs.field(default=False, init=False)  # the last block takes deltas
    # Whitespace waiting for a block of kind `_blank_kind` to open.
    _blank: str = attrs.field(default="", init=False)
    _blank_kind: str = attrs.field(default="", init=False)
    _arguments: list[str] = attrs.field(factory=list, init=False)  # open tool_use's JSON

    def start(self, prompt_tokens: int) -> list[StreamEvent]:
        """``message_start``; the cache is not known yet, so all input counts as new."""
        return [("message_start", {"type": "message_start", "message": self._shell(
            content=[], stop_reason=None, stop_sequence=None,
            usage=usage_body(Usage(prompt_tokens, 0, 0)),
        )})]

    def add(self, delta: Delta) -> list[StreamEvent]:
        if isinstance(delta, ContentDelta):
            return self._text("text", delta.text)
        if isinstance(delta, ReasoningDelta):
            return self._text("thinking", delta.text)
        if isinstance(delta, ToolCallStart):
            events = self._close()
            block = {"type": "tool_use", "id": tool_use_id(delta.id), "name": delta.name,
                     "input": {}}
            return events + self._open_block(block)
        if isinstance(delta, ToolCallArguments):
            self._arguments.append(delta.fragment)
            return [self._delta({"type": "input_json_delta", "partial_json": delta.fragment})]
        raise TypeError(f"not a delta: {delta!r}")

    def finish(self, *, finish_reason: str | None, stop_sequence: str | None,
               usage: Usage | None) -> list[StreamEvent]:
        """The events that end the stream: the last ``content_block_stop``,
        ``message_delta`` (with the final usage) and ``message_stop``."""
        return [*self._close(), (
            "message_delta",
            {"type": "message_delta", "delta": _stop_fields(finish_reason, stop_sequence),
             "usage": usage_body(usage)},
        ), ("message_stop", {"type": "message_stop"})]

    def message(self, *, finish_reason: str | None, stop_sequence: str | None,
                usage: Usage | None) -> dict[str, Any]:
        """The non-streaming response body."""
        self._close()
        return self._shell(content=self.blocks, **_stop_fields(finish_reason, stop_sequence),
                           usage=usage_body(usage))

    def _shell(self, **fields: Any) -> dict[str, Any]:
        return {"id": self.message_id, "type": "message", "role": "assistant",
                "model": self.model, **fields}

    def _text(self, kind: str, text: str) -> list[StreamEvent]:
        events: list[StreamEvent] = []
        if not (self._open and self.blocks[-1]["type"] == kind):
            held = self._blank if self._blank_kind == kind else ""
            if not (held + text).strip():
                self._blank, self._blank_kind = held + text, kind
                return []
            text = held + text
            block = {"type": kind, kind: ""}
            if kind == "thinking":
                block["signature"] = ""  # butter's reasoning is not signed
            events = self._close() + self._open_block(block)
        self.blocks[-1][kind] += text
        delta_type = "text_delta" if kind == "text" else "thinking_delta"
        return events + [self._delta({"type": delta_type, kind: text})]

    def _open_block(self, block: dict[str, Any]) -> list[StreamEvent]:
        self.blocks.append(block)
        self._open = True
        return [("content_block_start", {"type": "content_block_start",
                                         "index": len(self.blocks) - 1,
                                         "content_block": dict(block)})]

    def _delta(self, delta: dict[str, Any]) -> StreamEvent:
        return ("content_block_delta", {"type": "content_block_delta",
                                        "index": len(self.blocks) - 1, "delta": delta})

    def _close(self) -> list[StreamEvent]:
        self._blank = ""
        if not self._open:
            return []
        self._open = False
        block = self.blocks[-1]
        if block["type"] == "tool_use":
            block["input"] = json.loads("".join(self._arguments) or "{}")
            self._arguments.clear()
        return [("content_block_stop", {"type": "content_block_stop",
                                        "index": len(self.blocks) - 1})]


def error_body(error: ButterError) -> dict[str, Any]:
    """Anthropic's error shape: ``{"type": "error", "error": {"type", "message"}}``."""
    kind = ERROR_TYPES.get(error.status_code, "api_error")
    return {"type": "error", "error": {"type": kind, "message": error.message}}


# ---- the request bodies' JSON Schemas (the routes publish them) ----------------------

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
MESSAGES_SCHEMA = {
    # No `model`: the resident model answers a request that names none, on every route.
    "type": "object", "required": ["messages", "max_tokens"],
    "properties": {
        **_ANTHROPIC_COMMON,
        "max_tokens": {"type": "integer", "minimum": 1},
        "stop_sequences": STOP,
        **SAMPLING,
        "temperature": {"type": "number", "minimum": 0, "maximum": 1},
    },
}
# count_tokens reads a Messages body (every field checked as there), max_tokens optional.
COUNT_TOKENS_SCHEMA = {"type": "object", "required": ["messages"],
                       "properties": MESSAGES_SCHEMA["properties"]}
