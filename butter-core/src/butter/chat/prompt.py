"""From a :class:`ChatRequest` to prompt text, and how to read the model's answer.

Tools go to the chat template when it renders ``tools`` itself; otherwise a
Hermes-style tools block is put in the system message, assistant tool calls in the
history are written as ``<tool_call>`` JSON and tool results as
``<tool_response>`` user turns, so a template that knows nothing of tools still
shows the model a whole agent round trip.

``tool_choice``: ``none`` leaves the tools out and parses no calls; ``auto`` lets
the model decide; ``required`` and a named function open the answer with
``<tool_call>`` so the model must write a call (``butter.chat.grammar`` constrains
it to a declared tool, or the named one, and its arguments' schema), in the format
the template teaches (:attr:`ChatTemplate.tool_format`). When the template opened a
think block itself, nothing is opened for the model: it thinks first, and the grammar
holds the call that follows ``</think>``.
"""

from __future__ import annotations

import json
from typing import Any

import attrs

from butter.chat.guard import NO_SPECIALS, TextGuard
from butter.chat.recovery import THINK_OPEN
from butter.chat.request import ChatRequest
from butter.chat.template import ChatTemplate
from butter.chat.toolformats import HERMES
from butter.errors import TemplateError

TOOLS_PREAMBLE = (
    "You are a function calling AI model. You are provided with function signatures within "
    "<tools></tools> XML tags. You may call one or more functions to assist with the user "
    "query. Don't make assumptions about what values to plug into functions. Here are the "
    "available tools: <tools>\n{tools}\n</tools>\n"
    "For each function call return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags as follows:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)


@attrs.frozen
class PromptPlan:
    text: str
    parse_tools: bool
    think_open: bool
    # The call format the model is taught: "hermes" or "qwen3_coder" (butter.chat.toolformats).
    tool_format: str = HERMES
    # Whether the model may open a call with a bare <function=NAME> (Qwen3-Coder).
    bare_calls: bool = False
    # Text the prompt already wrote for the model (a forced tool-call opening): the
    # answer is read as if it started with it.
    answer_prefix: str = ""
    # Every message but the last, rendered without a generation prompt (None where the
    # template refuses that): ``text`` departs from it where the final message starts.
    history: str | None = None


def build_prompt(request: ChatRequest, template: ChatTemplate, *,
                 default_thinking: bool | None = None,
                 default_effort: str | None = None,
                 guard: TextGuard = NO_SPECIALS) -> PromptPlan:
    """The prompt for ``request``; client text in it is hidden by ``guard`` (see
    :mod:`butter.chat.guard`), so ``guard.encode`` keeps it from becoming special tokens."""
    use_tools = request.wants_tools
    messages = guard.hide(request.messages)
    tools = guard.hide(request.tools) if use_tools else None
    if use_tools and not template.accepts_tools:
        messages = _inline_tools(messages, tools)
        tools = None
    elif template.accepts_tools:
        messages = [dict(m, role="system") if m["role"] == "developer" else m for m in messages]
    else:
        messages = _inline_history(messages)
    kwargs = guard.hide(dict(request.template_kwargs))
    thinking = request.enable_thinking if request.enable_thinking is not None else default_thinking
    if thinking is not None:
        kwargs["enable_thinking"] = thinking
    effort = request.reasoning_effort or default_effort
    if effort is not None:
        kwargs["reasoning_effort"] = effort
    text = template.render(messages, tools=tools, add_generation_prompt=True, **kwargs)
    # Read from the text, not the model's name: the template opened a think block (the
    # Qwen3.5 template does unless enable_thinking is false), so the answer starts in it.
    think_open = text.rstrip().endswith(THINK_OPEN)
    # A template that opened a think block lets the model think first: no forced opening.
    prefix = _forced_opening(request) if use_tools and not think_open else ""
    return PromptPlan(text=text + guard.hide(prefix), parse_tools=use_tools, think_open=think_open,
                      tool_format=template.tool_format, bare_calls=template.bare_calls,
                      answer_prefix=prefix, history=_history(template, messages, tools, kwargs))


def _history(template: ChatTemplate, messages: list[dict[str, Any]],
             tools: list[dict[str, Any]] | None, kwargs: dict[str, Any]) -> str | None:
    """Every message before the last, rendered as in the prompt, without a generation
    prompt; None for a single message the template will not render without, or refuses."""
    if not messages:
        return None
    try:
        return template.render(messages[:-1], tools=tools, add_generation_prompt=False,
                               **kwargs)
    except TemplateError:
        return None


def _forced_opening(request: ChatRequest) -> str:
    return "<tool_call>\n" if request.tool_choice.mode in ("required", "function") else ""


def _inline_tools(messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> list[dict]:
    block = TOOLS_PREAMBLE.format(
        tools="\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)
    )
    messages = _inline_history(messages)
    if messages and messages[0]["role"] in ("system", "developer"):
        first = dict(messages[0], role="system",
                     content=f"{messages[0]['content']}\n\n{block}".strip())
        return [first, *messages[1:]]
    return [{"role": "system", "content": block}, *messages]


def _inline_history(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Write tool calls and tool results as text, for templates that know no tools."""
    out: list[dict[str, Any]] = []
    for message in messages:
        if message["role"] == "assistant" and message.get("tool_calls"):
            calls = "\n".join(
                "<tool_call>\n" + json.dumps({"name": c["function"]["name"],
                                              "arguments": c["function"]["arguments"]},
                                             ensure_ascii=False) + "\n</tool_call>"
                for c in message["tool_calls"]
            )
            content = f"{message['content']}\n{calls}".strip()
            out.append({"role": "assistant", "content": content})
        elif message["role"] == "tool":
            response = f"<tool_response>\n{message['content']}\n</tool_response>"
            if out and out[-1]["role"] == "user" and out[-1].get("_tool_responses"):
                out[-1] = dict(out[-1], content=out[-1]["content"] + "\n" + response)
            else:
                out.append({"role": "user", "content": response, "_tool_responses": True})
        elif message["role"] == "developer":
            out.append(dict(message, role="system"))
        else:
            out.append(message)
    return [{k: v for k, v in m.items() if k != "_tool_responses"} for m in out]
