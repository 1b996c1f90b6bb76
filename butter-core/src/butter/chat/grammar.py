"""What a chat request constrains, as an llguidance grammar.

- ``response_format`` json_object / json_schema: the whole answer is JSON of the schema.
- A forced tool call (``required``, a named function, Anthropic ``any`` / ``tool``): the
  prompt opens ``<tool_call>`` and the grammar holds the rest of one call of a declared
  tool (or the named one) with arguments of its schema, and the close tag.
- ``auto`` with tools: the model is free until it writes ``<tool_call>`` (or, for
  Qwen3-Coder, which sometimes leaves that tag out, ``<function=`` and a declared tool's
  name, as llama.cpp triggers it); from there the call is constrained the same way (a lazy
  grammar). With a ``response_format`` as well, the answer is either the JSON or a call.

Calls are constrained in the format the chat template teaches (``PromptPlan.tool_format``):

- Hermes JSON, ``<tool_call>\\n{"name": …, "arguments": {…}}\\n</tool_call>``;
- Qwen3-Coder XML, ``<tool_call>\\n<function=NAME>\\n<parameter=P>\\nV\\n</parameter>\\n…
  </function>\\n</tool_call>``. Each value is held to its property's schema: JSON for a
  property that cannot be a string (numbers, booleans, objects, arrays), one of the
  listed strings for an enum, raw text of the schema's length for a string. Required
  parameters come in the schema's order, each optional one at most once in its place.

When the template opened a think block (``PromptPlan.think_open``) the model thinks first:
a forced call or a response_format holds from its ``</think>`` on, and under ``auto`` a
``<tool_call>`` inside the thinking does not trigger the call grammar.

The JSON grammar itself is llguidance's (``%json`` / ``grammar_from_json_schema``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import llguidance

from butter.chat.prompt import PromptPlan
from butter.chat.recovery import THINK_CLOSE
from butter.chat.request import ChatRequest
from butter.chat.toolformats import QWEN3_CODER, value_types
from butter.engine.constraint import JSON_STYLE, GrammarSpec
from butter.errors import InvalidRequestError

TOOL_OPEN = "<tool_call>"
TOOL_CLOSE = "</tool_call>"
# Thinking, up to and including its close tag, then the blank line the template writes.
_THINK = 'think "\\n"{0,2} '
_THINK_RULE = r"think[lazy]: /(?s:.*)<\/think>/"
_XML_END = "\\n</parameter>\\n"
_XML_STRING_RULE = r"xml_string[lazy]: /(?s:.*)\n<\/parameter>\n/"
# Longest string a length bound is written out for; longer bounds leave the string free.
_MAX_BOUND = 2048


def grammar_for(request: ChatRequest, plan: PromptPlan) -> GrammarSpec | None:
    """The grammar ``request`` must follow, or None when its answer is free."""
    content = request.response_format.schema if request.response_format else None
    # Under a template-opened think block, what is held starts after the thinking.
    think, think_rules = (_THINK, [_THINK_RULE]) if plan.think_open else ("", [])
    if not plan.parse_tools:
        if content is None:
            return None
        if not think:
            return _json(content)
        return _lark(f"start: {think}content", think_rules, what="response_format",
                     content=content)
    calls = _call_rules(request, plan.tool_format)
    body = _call_body(plan.tool_format)
    if request.tool_choice.mode in ("required", "function"):
        if plan.answer_prefix:  # the prompt already opened the call: the rest of it
            rest = _call_body(plan.tool_format, opened=plan.answer_prefix)
            return _lark(f"start: {rest}", calls, what="tool_choice")
        return _lark(f'start: {think}"{TOOL_OPEN}" {body}', calls + think_rules,
                     what="tool_choice")
    if content is not None:
        return _lark(f'start: {think}(content | "{TOOL_OPEN}" {body})', calls + think_rules,
                     what="response_format", content=content)
    # Lazy: the grammar takes over at a trigger, its text included (after </think>).
    start, triggers = f'start: "{TOOL_OPEN}" {body}', (TOOL_OPEN,)
    if plan.bare_calls:  # Qwen3-Coder may leave out <tool_call>: a bare call counts too
        start += " | call"
        triggers += tuple(f"<function={tool['name']}>" for tool in _chosen_tools(request))
    return _lark(start, calls, what="tools", triggers=triggers,
                 armed_by=THINK_CLOSE if plan.think_open else None)


def _call_body(tool_format: str, *, opened: str = TOOL_OPEN) -> str:
    """The rest of a call after ``opened`` (its open tag, perhaps with a newline): the
    format's ``call`` rule and the close tag. XML is laid out exactly as the template
    writes it (``<tool_call>\\n<function=…>…</function>\\n</tool_call>``); Hermes JSON
    may leave out the newlines."""
    if tool_format == QWEN3_CODER:
        newline = "" if opened.endswith("\n") else '"\\n" '
        return f'{newline}call "\\n{TOOL_CLOSE}"'
    return f'"\\n"? call "\\n"? "{TOOL_CLOSE}"'


def _chosen_tools(request: ChatRequest) -> list[dict[str, Any]]:
    choice = request.tool_choice
    return [tool["function"] for tool in request.tools
            if choice.mode != "function" or tool["function"]["name"] == choice.name]


def _call_rules(request: ChatRequest, tool_format: str) -> list[str]:
    """Lark lines defining ``call``: one call of a chosen tool, in ``tool_format``."""
    tools = _chosen_tools(request)
    if tool_format == QWEN3_CODER:
        return _xml_rules(tools)
    return [f"call: %json {json.dumps(_styled(_json_call_schema(tools)))}"]


def _json_call_schema(tools: list[dict[str, Any]]) -> dict[str, Any]:
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


# --- Qwen3-Coder XML ------------------------------------------------------------------


def _xml_rules(tools: list[dict[str, Any]]) -> list[str]:
    # An empty choice (a named tool that is not declared) is a grammar llguidance refuses,
    # which `Grammars.compile` turns into a 400 naming tool_choice.
    lines = ["call: " + (" | ".join(f"fn{i}" for i in range(len(tools))) or '""')]
    uses_string = False
    for i, tool in enumerate(tools):
        parameters = tool.get("parameters")
        parameters = parameters if isinstance(parameters, Mapping) else {}
        properties = parameters.get("properties")
        properties = properties if isinstance(properties, Mapping) else {}
        required = parameters.get("required")
        required = set(required) if isinstance(required, list) else set()
        parts = []
        _check_tag_name(tool["name"], "tool name")
        for j, (name, schema) in enumerate(properties.items()):
            _check_tag_name(name, f"parameter name of `{tool['name']}`")
            rule = f"fn{i}_p{j}"
            value, extra = _xml_value(schema, parameters, f"{rule}_v")
            uses_string = uses_string or value == "xml_string"
            opening = _literal(f"<parameter={name}>\n")
            lines.append(f"{rule}: {opening} {value}")
            lines += extra
            parts.append(rule if name in required else f"{rule}?")
        opening = _literal(f"<function={tool['name']}>\n")
        lines.append(" ".join([f"fn{i}:", opening, *parts, '"</function>"']))
    if uses_string:
        lines.append(_XML_STRING_RULE)
    return lines


def _xml_value(schema: Any, root: Mapping[str, Any], rule: str) -> tuple[str, list[str]]:
    """The grammar of one parameter's value and its closing tag: (expression, extra lines).

    Matches how `XmlToolFormat` types the value back (`value_types` decides both).
    """
    types = value_types(schema, root)
    schema = schema if isinstance(schema, Mapping) else {}
    if types and "string" not in types:  # JSON, as the template writes it (tojson)
        definitions = {key: root[key] for key in ("$defs", "definitions") if key in root}
        value = _styled({**definitions, **schema})
        return f'{rule} "{_XML_END}"', [f"{rule}: %json {json.dumps(value)}"]
    if types not in ([], ["string"]):  # a string or something else: any text, typed on parse
        return "xml_string", []
    choices = schema.get("enum", [schema["const"]] if "const" in schema else None)
    if isinstance(choices, list) and choices and all(isinstance(c, str) for c in choices):
        listed = " | ".join(_literal(choice) for choice in choices)
        return f'({listed}) "{_XML_END}"', []
    low, high = schema.get("minLength", 0), schema.get("maxLength")
    bounded = types == ["string"] and _is_count(low) and (high is None or _is_count(high)) \
        and (low or high is not None) and max(low, high or 0) <= _MAX_BOUND
    if not bounded:
        return "xml_string", []
    bound = f"{low},{'' if high is None else high}"
    return rule, [f"{rule}[lazy]: /(?s:.{{{bound}}})\\n<\\/parameter>\\n/"]


def _check_tag_name(name: str, what: str) -> None:
    """``<function=NAME>`` and ``<parameter=NAME>`` hold no space or angle bracket: a call
    written with one could not be read back, so it is refused rather than never parsed."""
    if not name or any(ch.isspace() or ch in "<>" for ch in name):
        raise InvalidRequestError(f"The {what} {name!r} cannot be written in this model's "
                                  "XML tool-call format (no spaces or angle brackets).",
                                  param="tools")


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _literal(text: str) -> str:
    return json.dumps(text)


# --- compiling ------------------------------------------------------------------------


def _json(schema: dict[str, Any]) -> GrammarSpec:
    return GrammarSpec(llguidance.LLMatcher.grammar_from_json_schema(
        schema, overrides=JSON_STYLE), what="response_format")


def _lark(start: str, lines: list[str], *, what: str, triggers: tuple[str, ...] = (),
          armed_by: str | None = None, content: dict[str, Any] | None = None) -> GrammarSpec:
    rules = [start, *lines]
    if content is not None:
        rules.append(f"content: %json {json.dumps(_styled(content))}")
    return GrammarSpec(llguidance.LLMatcher.grammar_from_lark("\n".join(rules)),
                       triggers=triggers, armed_by=armed_by, what=what)


def _styled(schema: dict[str, Any]) -> dict[str, Any]:
    return {**schema, "x-guidance": {**schema.get("x-guidance", {}), **JSON_STYLE}}
