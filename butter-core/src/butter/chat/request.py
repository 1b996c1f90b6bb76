"""A chat request, validated: the one shape both API dialects are turned into.

Messages and tools are held in OpenAI's shape. ``butter.wire.openai`` and
``butter.wire.anthropic`` read their dialect's body into a :class:`ChatRequest` with
the validators here. Every problem is an :class:`InvalidRequestError` naming the
field; unknown fields are ignored.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

import attrs

from butter.errors import InvalidRequestError
from butter.generation import GenerationParams

ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})
DEFAULT_TEMPERATURE = 0.8  # llama-server's default; OpenAI's is 1.0
MAX_STOP_SEQUENCES = 16
MAX_LOGIT_BIAS = 300  # OpenAI's limit
DEFAULT_TOP_K = 40  # llama-server's
MAX_JSON_DEPTH = 64  # request bodies are shallow; deep nesting only costs recursion later
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


def parse_json_body(raw: bytes) -> dict[str, Any]:
    """Decode a request body: UTF-8 JSON holding an object of valid text.

    Nesting deeper than :data:`MAX_JSON_DEPTH`, integers past Python's digit limit and
    strings that are not valid Unicode (a lone UTF-16 surrogate such as ``"\\ud800"``)
    are refused here, so nothing behind the edge ever meets them.
    """
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise InvalidRequestError("The request body is not valid UTF-8.") from None
    if not text.strip():
        raise InvalidRequestError("The request body is empty; expected a JSON object.")
    try:
        body = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InvalidRequestError(f"The request body is not valid JSON: {exc.msg} "
                                  f"(line {exc.lineno}, column {exc.colno}).") from None
    except RecursionError:
        raise InvalidRequestError(f"The request body nests deeper than {MAX_JSON_DEPTH} "
                                  "levels.") from None
    except ValueError:  # e.g. an integer with more digits than Python converts
        raise InvalidRequestError("The request body holds a number too large to read.") from None
    if not isinstance(body, dict):
        raise InvalidRequestError("The request body must be a JSON object.")
    check_json_values(body)
    return body


def check_json_values(body: Any) -> None:
    """Refuse nesting deeper than :data:`MAX_JSON_DEPTH` and strings that are not valid text."""
    stack: list[tuple[Any, str, int]] = [(body, "", 0)]
    while stack:
        value, where, depth = stack.pop()
        if isinstance(value, str):
            _check_text(value, where)
            continue
        if not isinstance(value, (dict, list)):
            continue
        if depth >= MAX_JSON_DEPTH:
            raise InvalidRequestError(f"The request body nests deeper than {MAX_JSON_DEPTH} "
                                      "levels.", param=where or None)
        if isinstance(value, dict):
            for key, item in value.items():
                path = f"{where}.{key}" if where else str(key)
                _check_text(key, path)
                stack.append((item, path, depth + 1))
        else:
            stack.extend((item, f"{where}[{index}]", depth + 1) for index, item in enumerate(value))


def _check_text(text: str, where: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        name = where.encode("utf-8", "replace").decode() or "body"
        raise InvalidRequestError(f"`{name}` is not valid text (it holds a lone UTF-16 "
                                  "surrogate).", param=name) from None


# ---- field readers ------------------------------------------------------------------

def _number(body: Mapping[str, Any], key: str, default: float, *, low: float, high: float) -> float:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidRequestError(f"`{key}` must be a number.", param=key)
    if not low <= value <= high:
        raise InvalidRequestError(f"`{key}` must be between {low} and {high}.", param=key)
    return float(value)


def _integer(body: Mapping[str, Any], key: str, *, low: int | None = None) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidRequestError(f"`{key}` must be an integer.", param=key)
    if low is not None and value < low:
        raise InvalidRequestError(f"`{key}` must be at least {low}.", param=key)
    return value


def _boolean(body: Mapping[str, Any], key: str) -> bool | None:
    value = body.get(key)
    if value is None:
        return None
    if not isinstance(value, bool):
        raise InvalidRequestError(f"`{key}` must be a boolean.", param=key)
    return value


def _object(body: Mapping[str, Any], key: str) -> dict[str, Any]:
    value = body.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise InvalidRequestError(f"`{key}` must be an object.", param=key)
    return value


def _stops(value: Any, key: str) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        raise InvalidRequestError(f"`{key}` must be a string or a list of strings.", param=key)
    if len(value) > MAX_STOP_SEQUENCES:
        raise InvalidRequestError(f"`{key}` takes at most {MAX_STOP_SEQUENCES} sequences.",
                                  param=key)
    return tuple(s for s in value if s)


def generation_params(body: Mapping[str, Any], *, max_tokens_keys: tuple[str, ...],
                      stop_key: str) -> GenerationParams:
    max_tokens = None
    for key in max_tokens_keys:  # every one given is checked; the first one wins
        value = _integer(body, key, low=1)
        if value is not None and max_tokens is None:
            max_tokens = value
    seed = _integer(body, "seed")
    min_tokens = _integer(body, "min_tokens", low=0) or 0
    top_k = _integer(body, "top_k", low=-1)
    return GenerationParams(
        max_tokens=max_tokens,
        temperature=_number(body, "temperature", DEFAULT_TEMPERATURE, low=0.0, high=2.0),
        top_p=_number(body, "top_p", 1.0, low=0.0, high=1.0) or 1.0,
        seed=seed,
        stop=_stops(body.get(stop_key), stop_key),
        ignore_eos=bool(_boolean(body, "ignore_eos")),
        min_tokens=min_tokens,
        top_k=DEFAULT_TOP_K if top_k is None else max(top_k, 0),  # -1 (vLLM) and 0: off
        frequency_penalty=_number(body, "frequency_penalty", 0.0, low=-2.0, high=2.0),
        presence_penalty=_number(body, "presence_penalty", 0.0, low=-2.0, high=2.0),
        repetition_penalty=_number(body, "repetition_penalty", 1.0, low=0.01, high=10.0),
        logit_bias=_logit_bias(body.get("logit_bias")),
        min_p=_number(body, "min_p", 0.0, low=0.0, high=1.0),
    )


def _logit_bias(value: Any) -> tuple[tuple[int, float], ...]:
    """OpenAI's ``{"token id": bias}`` with biases in -100..100."""
    if value is None:
        return ()
    if not isinstance(value, dict) or len(value) > MAX_LOGIT_BIAS:
        raise InvalidRequestError(f"`logit_bias` must be an object of at most {MAX_LOGIT_BIAS} "
                                  "token ids.", param="logit_bias")
    biases = []
    for key, bias in value.items():
        if not (isinstance(key, str) and key.isdigit() and len(key) <= 9):
            raise InvalidRequestError(f"`logit_bias` key {key!r} is not a token id.",
                                      param="logit_bias")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) \
                or not -100 <= bias <= 100:
            raise InvalidRequestError("`logit_bias` values must be numbers in -100..100.",
                                      param="logit_bias")
        biases.append((int(key), float(bias)))
    return tuple(sorted(biases))


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
    strict = _boolean(spec, "strict")
    return ResponseFormat(schema=schema, name=name, strict=bool(strict))


def parse_tools(value: Any) -> list[dict[str, Any]]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise InvalidRequestError("`tools` must be a list.", param="tools")
    tools = []
    for index, tool in enumerate(value):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise InvalidRequestError(f"`tools[{index}]` must be a function tool with a name.",
                                      param=f"tools[{index}]")
        parameters = function.get("parameters") or {"type": "object", "properties": {}}
        if not isinstance(parameters, dict):
            raise InvalidRequestError(f"`tools[{index}].function.parameters` must be an object.",
                                      param=f"tools[{index}]")
        entry = {"name": function["name"], "parameters": parameters}
        if isinstance(function.get("description"), str):
            entry["description"] = function["description"]
        tools.append({"type": "function", "function": entry})
    return tools
