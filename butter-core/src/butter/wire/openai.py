"""The OpenAI chat-completions dialect: a body read into a ChatRequest, and the
completion (whole, or as stream chunks) rendered from recovered deltas. No I/O."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from butter.chat.recovery import (
    ContentDelta,
    Delta,
    ReasoningDelta,
    ToolCall,
    ToolCallArguments,
    ToolCallStart,
)
from butter.chat.request import (
    RESERVED_TEMPLATE_KWARGS,
    ChatRequest,
    ToolChoice,
    parse_messages,
    parse_response_format,
    parse_tools,
)
from butter.errors import ButterError, InvalidRequestError
from butter.generation import Logprob, LogprobsDelta, TokenChoice, Usage
from butter.wire.fields import (
    JSON_OBJECT,
    RESPONSE_FORMAT,
    SAMPLING,
    STOP,
    STRING,
    TEXT_PART,
    boolean,
    check_text,
    generation_params,
    integer,
    json_object,
)

MAX_CHOICES = 16  # n (times prompts) per request: each choice is a session's work
COMPLETION_MAX_TOKENS = 16  # the legacy endpoint's documented default
MAX_TOP_LOGPROBS = 20  # chat's top_logprobs, as OpenAI
MAX_LEGACY_LOGPROBS = 5  # /v1/completions' logprobs, as OpenAI


def parse_chat_completion(body: Mapping[str, Any]) -> ChatRequest:
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise InvalidRequestError("`model` must be a string.", param="model")
    n = _choices(body)
    logprobs = _chat_logprobs(body)
    stream = bool(boolean(body, "stream"))
    stream_options = json_object(body, "stream_options")
    kwargs = json_object(body, "chat_template_kwargs")
    effort = body.get("reasoning_effort")
    if effort is not None and effort not in ("low", "medium", "high", "minimal", "none"):
        raise InvalidRequestError("`reasoning_effort` must be low, medium or high.",
                                  param="reasoning_effort")
    reserved = sorted(RESERVED_TEMPLATE_KWARGS.intersection(kwargs))
    if reserved:
        raise InvalidRequestError(f"`chat_template_kwargs` may not set {', '.join(reserved)}: "
                                  "the server renders those from the request.",
                                  param="chat_template_kwargs")
    thinking = kwargs.get("enable_thinking")
    tools = parse_tools(body.get("tools"))
    return ChatRequest(
        messages=parse_messages(body.get("messages")),
        params=attrs.evolve(generation_params(
            body, max_tokens_keys=("max_completion_tokens", "max_tokens"), stop_key="stop"),
            logprobs=logprobs),
        model=model,
        stream=stream,
        include_usage=bool(stream_options.get("include_usage")),
        tools=tools,
        tool_choice=_tool_choice(body.get("tool_choice"), tools),
        template_kwargs=kwargs,
        enable_thinking=thinking if isinstance(thinking, bool) else None,
        reasoning_effort=effort,
        n=n,
        response_format=parse_response_format(body.get("response_format")),
    )


def _choices(body: Mapping[str, Any]) -> int:
    n = integer(body, "n", low=1)
    if n is not None and n > MAX_CHOICES:
        raise InvalidRequestError(f"`n` must be at most {MAX_CHOICES}.", param="n")
    return n or 1


def parse_completion(body: Mapping[str, Any]) -> list[ChatRequest]:
    """A legacy ``/v1/completions`` body: one raw-prompt request per prompt."""
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise InvalidRequestError("`model` must be a string.", param="model")
    prompts = _prompts(body.get("prompt"))
    suffix = body.get("suffix")
    if suffix is not None:
        if not isinstance(suffix, str):
            raise InvalidRequestError("`suffix` must be a string.", param="suffix")
        check_text(suffix, "suffix")
        if any(not isinstance(p, str) for p in prompts):
            raise InvalidRequestError("`suffix` needs a text `prompt`.", param="suffix")
    if boolean(body, "echo") and any(not isinstance(p, str) for p in prompts):
        raise InvalidRequestError("`echo` needs a text `prompt`.", param="echo")
    best_of = integer(body, "best_of", low=1)
    if best_of is not None and best_of > 1:
        raise InvalidRequestError("`best_of` above 1 is not supported by this server.",
                                  param="best_of")
    n = _choices(body)
    if n * len(prompts) > MAX_CHOICES:
        raise InvalidRequestError(f"`n` times the prompts must be at most {MAX_CHOICES}.",
                                  param="n")
    params = attrs.evolve(generation_params(body, max_tokens_keys=("max_tokens",),
                                            stop_key="stop"),
                          logprobs=_completion_logprobs(body))
    if body.get("max_tokens") is None:
        params = attrs.evolve(params, max_tokens=COMPLETION_MAX_TOKENS)
    stream = bool(boolean(body, "stream"))
    include_usage = bool(json_object(body, "stream_options").get("include_usage"))
    echo = bool(boolean(body, "echo"))
    response_format = parse_response_format(body.get("response_format"))
    return [ChatRequest(messages=[], params=params, model=model, stream=stream,
                        include_usage=include_usage, n=n, echo=echo,
                        raw_prompt=prompt if isinstance(prompt, str) else None,
                        prompt_tokens=None if isinstance(prompt, str) else prompt,
                        suffix=suffix, response_format=response_format)
            for prompt in prompts]


def _prompts(value: Any) -> list[str | tuple[int, ...]]:
    """``prompt``: a string, a list of strings, token ids, or a list of token-id lists."""
    if isinstance(value, str):
        value = [value]
    elif isinstance(value, list) and value and all(_is_token(t) for t in value):
        value = [value]
    if not isinstance(value, list) or not value or len(value) > MAX_CHOICES:
        raise InvalidRequestError(f"`prompt` must be a string, token ids, or a list of at "
                                  f"most {MAX_CHOICES} of either.", param="prompt")
    prompts: list[str | tuple[int, ...]] = []
    for index, prompt in enumerate(value):
        if isinstance(prompt, str):
            check_text(prompt, f"prompt[{index}]")
            prompts.append(prompt)
        elif isinstance(prompt, list) and prompt and all(_is_token(t) for t in prompt):
            prompts.append(tuple(prompt))
        else:
            raise InvalidRequestError(f"`prompt[{index}]` must be a string or a non-empty list "
                                      "of token ids.", param="prompt")
    return prompts


def _is_token(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**31


def _chat_logprobs(body: Mapping[str, Any]) -> int | None:
    """``logprobs`` / ``top_logprobs`` (0-20): None, or how many alternatives per token."""
    wanted = boolean(body, "logprobs")
    top = integer(body, "top_logprobs", low=0)
    if top is not None and top > MAX_TOP_LOGPROBS:
        raise InvalidRequestError(f"`top_logprobs` must be between 0 and {MAX_TOP_LOGPROBS}.",
                                  param="top_logprobs")
    if top is not None and not wanted:
        raise InvalidRequestError("`top_logprobs` needs `logprobs: true`.",
                                  param="top_logprobs")
    return (top or 0) if wanted else None


def _completion_logprobs(body: Mapping[str, Any]) -> int | None:
    """The legacy ``logprobs``: how many alternatives per token, 0-5."""
    top = integer(body, "logprobs", low=0)
    if top is not None and top > MAX_LEGACY_LOGPROBS:
        raise InvalidRequestError(f"`logprobs` must be between 0 and {MAX_LEGACY_LOGPROBS}.",
                                  param="logprobs")
    if top is not None and boolean(body, "echo"):
        raise InvalidRequestError("`echo` with `logprobs` would need the prompt's "
                                  "log-probabilities, which this server does not compute.",
                                  param="echo")
    return top


def _tool_choice(value: Any, tools: list[dict[str, Any]]) -> ToolChoice:
    if value is None:
        return ToolChoice()
    if isinstance(value, str) and value in ("none", "auto", "required"):
        if value == "required" and not tools:
            raise InvalidRequestError("`tool_choice: required` needs `tools`.",
                                      param="tool_choice")
        return ToolChoice(mode=value)
    if isinstance(value, dict):
        function = value.get("function")
        if isinstance(function, dict) and isinstance(function.get("name"), str):
            name = function["name"]
            if name not in {tool["function"]["name"] for tool in tools}:
                raise InvalidRequestError(f"`tool_choice` names `{name}`, which is not one of "
                                          "`tools`.", param="tool_choice")
            return ToolChoice(mode="function", name=name)
    raise InvalidRequestError("`tool_choice` must be none, auto, required or "
                              '{"type": "function", "function": {"name": ...}}.',
                              param="tool_choice")


def usage_body(usage: Usage | None) -> dict[str, Any]:
    usage = usage or Usage(0, 0, 0)
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.total_tokens,
        "cached_tokens": usage.cached_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
        "completion_tokens_details": {
            "accepted_prediction_tokens": usage.accepted_prediction_tokens,
            "rejected_prediction_tokens": usage.rejected_prediction_tokens},
    }


def chat_logprobs(entries: Sequence[Logprob]) -> dict[str, Any]:
    """A chat choice's ``logprobs``: each token with its bytes and top alternatives."""
    return {"content": [{**_choice_body(e.chosen),
                         "top_logprobs": [_choice_body(t) for t in e.top]} for e in entries],
            "refusal": None}


def _choice_body(choice: TokenChoice) -> dict[str, Any]:
    return {"token": choice.token, "logprob": choice.logprob, "bytes": list(choice.bytes)}


def legacy_logprobs(entries: Sequence[Logprob], offset: int) -> dict[str, Any]:
    """``/v1/completions``' ``logprobs``; ``offset`` is where the first token's text
    starts in the choice's text."""
    offsets = []
    for entry in entries:
        offsets.append(offset)
        offset += len(entry.chosen.token)
    return {"tokens": [e.chosen.token for e in entries],
            "token_logprobs": [e.chosen.logprob for e in entries],
            "top_logprobs": [{t.token: t.logprob for t in e.top} for e in entries],
            "text_offset": offsets}


def chat_choice(*, index: int, content: str, reasoning: str, calls: list[ToolCall],
                finish_reason: str | None,
                logprobs: Sequence[Logprob] | None = None) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant",
                               "content": (content.strip() or None) if calls else content}
    if reasoning:
        message["reasoning_content"] = reasoning
    if calls:
        message["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in calls
        ]
    return {"index": index, "message": message,
            "logprobs": None if logprobs is None else chat_logprobs(logprobs),
            "finish_reason": finish_reason}


def completion_body(*, completion_id: str, model: str, created: int,
                    choices: list[dict[str, Any]], usage: Usage | None) -> dict[str, Any]:
    """A whole ``chat.completion`` object."""
    return {"id": completion_id, "object": "chat.completion", "created": created,
            "model": model, "choices": choices, "usage": usage_body(usage)}


def text_completion_body(*, completion_id: str, model: str, created: int,
                         choices: list[dict[str, Any]], usage: Usage | None) -> dict[str, Any]:
    """A whole legacy ``text_completion`` object; choices are ``text_choice`` dicts."""
    return {"id": completion_id, "object": "text_completion", "created": created,
            "model": model, "choices": choices, "usage": usage_body(usage)}


def text_choice(*, index: int, text: str, finish_reason: str | None,
                logprobs: Sequence[Logprob] | None = None) -> dict[str, Any]:
    return {"index": index, "text": text,
            "logprobs": None if logprobs is None else legacy_logprobs(logprobs, 0),
            "finish_reason": finish_reason}


@attrs.define
class CompletionBuilder:
    """A whole (not streamed) completion, chat or legacy text, from its choices' deltas:
    ``add`` each ``(choice, delta)`` as it comes, then ``body``."""

    echoes: list[str]  # per choice: the prompt leading its text (legacy ``echo``), or ""
    chat: bool
    logprobs: bool
    _content: list[list[str]] = attrs.field(init=False)
    _reasoning: list[list[str]] = attrs.field(init=False)
    _entries: list[list[Logprob]] = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        self._content = [[echo] for echo in self.echoes]
        self._reasoning = [[] for _ in self.echoes]
        self._entries = [[] for _ in self.echoes]

    def add(self, index: int, delta: Delta | None) -> None:
        if isinstance(delta, ContentDelta):
            self._content[index].append(delta.text)
        elif isinstance(delta, ReasoningDelta):
            self._reasoning[index].append(delta.text)
        elif isinstance(delta, LogprobsDelta) and self.logprobs:
            self._entries[index].extend(delta.entries)

    def body(self, *, completion_id: str, model: str, created: int,
             finish_reasons: Sequence[str | None], calls: Sequence[list[ToolCall]],
             usage: Usage) -> dict[str, Any]:
        entries = [e if self.logprobs else None for e in self._entries]
        if self.chat:
            return completion_body(
                completion_id=completion_id, model=model, created=created, usage=usage,
                choices=[chat_choice(index=i, content="".join(self._content[i]),
                                     reasoning="".join(self._reasoning[i]), calls=calls[i],
                                     finish_reason=finish_reasons[i], logprobs=entries[i])
                         for i in range(len(self.echoes))])
        return text_completion_body(
            completion_id=completion_id, model=model, created=created, usage=usage,
            choices=[text_choice(index=i, text="".join(self._content[i]),
                                 finish_reason=finish_reasons[i], logprobs=entries[i])
                     for i in range(len(self.echoes))])


class ChunkWriter:
    """The chunks of one stream, as JSON text: ``chat.completion.chunk`` objects, or
    legacy ``text_completion`` ones with ``text=True``."""

    def __init__(self, *, completion_id: str, model: str, created: int,
                 text: bool = False) -> None:
        self._frame = {"id": completion_id, "created": created, "model": model,
                       "object": "text_completion" if text else "chat.completion.chunk"}
        self._text = text
        self._templates: dict[int, tuple[str, str]] = {}
        self._logprobs: dict[int, list[Logprob]] = {}  # not yet sent, per choice
        self._offsets: dict[int, int] = {}  # text sent so far, per choice (legacy offsets)

    def chunk(self, delta: dict[str, Any], finish_reason: str | None = None, *,
              index: int = 0, logprobs: Sequence[Logprob] | None = None) -> str:
        shaped = None
        if logprobs is not None:
            shaped = legacy_logprobs(logprobs, self._offsets.get(index, 0)) if self._text \
                else chat_logprobs(logprobs)
        choice = ({"index": index, "text": delta.get("content", ""), "logprobs": shaped,
                   "finish_reason": finish_reason} if self._text else
                  {"index": index, "delta": delta, "logprobs": shaped,
                   "finish_reason": finish_reason})
        return _json({**self._frame, "choices": [choice]})

    def opening(self, index: int = 0) -> str | None:
        return None if self._text else self.chunk({"role": "assistant", "content": ""},
                                                  index=index)

    def text(self, text: str, index: int = 0) -> str:
        pending = self._logprobs.pop(index, None)
        if pending is not None:  # the tokens behind this text go with it
            framed = self.chunk({"content": text}, index=index, logprobs=pending)
        else:
            # Content deltas are most of a stream: frame them from a prebuilt template.
            if index not in self._templates:
                head, tail = self.chunk({"content": "\x00"}, index=index).split('"\\u0000"')
                self._templates[index] = head, tail
            head, tail = self._templates[index]
            framed = head + json.dumps(text, ensure_ascii=False) + tail
        if self._text:  # legacy text offsets count what was sent, not the template
            self._offsets[index] = self._offsets.get(index, 0) + len(text)
        return framed

    def delta(self, delta: Delta | LogprobsDelta, index: int = 0) -> str | None:
        if isinstance(delta, LogprobsDelta):
            self._logprobs.setdefault(index, []).extend(delta.entries)
            return None
        if isinstance(delta, ContentDelta):
            return self.text(delta.text, index)
        if self._text:
            return None
        if isinstance(delta, ReasoningDelta):
            return self.chunk({"reasoning_content": delta.text}, index=index)
        if isinstance(delta, ToolCallStart):
            return self.chunk({"tool_calls": [{"index": delta.index, "id": delta.id,
                                               "type": "function",
                                               "function": {"name": delta.name,
                                                            "arguments": ""}}]}, index=index)
        if isinstance(delta, ToolCallArguments):
            return self.chunk({"tool_calls": [{"index": delta.index,
                                               "function": {"arguments": delta.fragment}}]},
                              index=index)
        return None

    def closing(self, finish_reason: str | None, index: int = 0) -> str:
        """The choice's last chunk, with the logprobs of tokens no text carried."""
        return self.chunk({}, finish_reason or "stop", index=index,
                          logprobs=self._logprobs.pop(index, None))

    def usage(self, usage: Usage | None) -> str:
        return _json({**self._frame, "choices": [], "usage": usage_body(usage)})


def _json(data: Mapping[str, Any]) -> str:
    return json.dumps(data, ensure_ascii=False, separators=(",", ":"))


def error_body(error: ButterError) -> dict[str, Any]:
    """OpenAI's error envelope: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": error.message, "type": error.error_type,
                      "param": error.param, "code": error.code}}


# ---- the request bodies' JSON Schemas (the routes publish them) ----------------------

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
CHAT_COMPLETION_SCHEMA = {
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
        "response_format": RESPONSE_FORMAT,
        **SAMPLING,
    },
}

_TOKENS = {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1}

COMPLETION_SCHEMA = {
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
        "best_of": {"type": "integer", "minimum": 1, "maximum": 1},
        "response_format": RESPONSE_FORMAT,
        "stream_options": {"type": "object",
                           "properties": {"include_usage": {"type": "boolean"}}},
        **SAMPLING,
    },
}
