"""What a chat request constrains, as an llguidance grammar.

- ``response_format`` json_object / json_schema: the whole answer is JSON of the schema.
- A forced tool call (``required``, a named function, Anthropic ``any`` / ``tool``): the
  prompt opens ``<tool_call>`` and the grammar holds the rest of one call,
  ``{"name": <a declared tool>, "arguments": <its parameters schema>}`` and the close tag.
- ``auto`` with tools: the model is free until it writes ``<tool_call>``; from there the
  call is constrained the same way (a lazy grammar). With a ``response_format`` as well,
  the answer is either the JSON or a call.

Calls are constrained in the Hermes JSON markup butter writes into prompts; the JSON
grammar itself is llguidance's (``%json`` / ``grammar_from_json_schema``).
"""

from __future__ import annotations

import json
from typing import Any

import llguidance

from butter.chat.prompt import PromptPlan
from butter.chat.request import ChatRequest
from butter.engine.constraint import JSON_STYLE, GrammarSpec

TOOL_OPEN = "<tool_call>"
TOOL_CLOSE = "</tool_call>"


def grammar_for(request: ChatRequest, plan: PromptPlan) -> GrammarSpec | None:
    """The grammar ``request`` must follow, or None when its answer is free."""
    content = request.response_format.schema if request.response_format else None
    if not plan.parse_tools:
        return _json(content) if content is not None else None
    call = _call_schema(request)
    if request.tool_choice.mode in ("required", "function") and plan.answer_prefix:
        # The prompt already opened the call: the grammar is the rest of it.
        return _lark(f'start: "\\n"? call "\\n"? "{TOOL_CLOSE}"', call=call, what="tool_choice")
    if content is not None:
        return _lark(f'start: content | "{TOOL_OPEN}" "\\n"? call "\\n"? "{TOOL_CLOSE}"',
                     call=call, content=content, what="response_format")
    return _lark(f'start: "\\n"? call "\\n"? "{TOOL_CLOSE}"', call=call, what="tools",
                 trigger=TOOL_OPEN)


def _call_schema(request: ChatRequest) -> dict[str, Any]:
    choice = request.tool_choice
    tools = [tool["function"] for tool in request.tools
             if choice.mode != "function" or tool["function"]["name"] == choice.name]
    definitions: dict[str, Any] = {}
    choices = []
    for tool in tools:
        parameters = dict(tool["parameters"])
        # ``#/$defs/...`` references resolve from the root: the tools' definitions go there.
        definitions.update(parameters.pop("$defs", {}) or {})
        choices.append({
            "type": "object",
            "properties": {"name": {"const": tool["name"]}, "arguments": parameters},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        })
    return {"anyOf": choices, **({"$defs": definitions} if definitions else {})}


def _json(schema: dict[str, Any]) -> GrammarSpec:
    return GrammarSpec(llguidance.LLMatcher.grammar_from_json_schema(
        schema, overrides=JSON_STYLE), what="response_format")


def _lark(start: str, *, what: str, trigger: str | None = None,
          **rules: dict[str, Any]) -> GrammarSpec:
    lines = [start] + [f"{name}: %json {json.dumps(_styled(schema))}"
                       for name, schema in rules.items()]
    return GrammarSpec(llguidance.LLMatcher.grammar_from_lark("\n".join(lines)),
                       trigger=trigger, what=what)


def _styled(schema: dict[str, Any]) -> dict[str, Any]:
    return {**schema, "x-guidance": {**schema.get("x-guidance", {}), **JSON_STYLE}}
