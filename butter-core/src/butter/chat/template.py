"""Render a checkpoint's own Jinja chat template the way Hugging Face transformers does.

Sandboxed environment with ``trim_blocks`` / ``lstrip_blocks`` and the loop-controls
extension; ``raise_exception``, ``strftime_now`` and a ``tojson`` filter that keeps
non-ASCII text; ``bos_token`` / ``eos_token`` and ``add_generation_prompt`` passed in.
The rendered text is tokenized with special tokens parsed as special.
"""

from __future__ import annotations

import datetime
import functools
import json
from collections.abc import Mapping, Sequence
from typing import Any

import jinja2
import jinja2.meta
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from butter.chat.toolformats import HERMES, taught_format, writes_bare_calls
from butter.errors import TemplateError

# ChatML, for checkpoints that carry no template of their own.
FALLBACK_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


class _TemplateRaised(Exception):
    pass


def _raise_exception(message: str) -> None:
    raise _TemplateRaised(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: Sequence[str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent,
                      separators=tuple(separators) if separators else None, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=8)
def _compile(source: str) -> tuple[jinja2.Template, frozenset[str]]:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    variables = frozenset(jinja2.meta.find_undeclared_variables(env.parse(source)))
    return env.from_string(source), variables


class ChatTemplate:
    """One checkpoint's chat template and its special tokens."""

    def __init__(self, source: str | None, *, bos_token: str = "", eos_token: str = "") -> None:
        self.source = source or FALLBACK_TEMPLATE
        self.bos_token = bos_token
        self.eos_token = eos_token
        self._template, self._variables = _compile(self.source)

    @property
    def accepts_tools(self) -> bool:
        """Whether the template renders a ``tools`` list itself."""
        return "tools" in self._variables

    @property
    def tool_format(self) -> str:
        """The call format the model is taught (`butter.chat.toolformats.taught_format`):
        the template's own when it renders tools, else the Hermes JSON butter writes into
        the system message for it."""
        return taught_format(self.source) if self.accepts_tools else HERMES

    @property
    def bare_calls(self) -> bool:
        """Whether its model may write an XML call without the ``<tool_call>`` wrapper
        (Qwen3-Coder; `butter.chat.toolformats.writes_bare_calls`)."""
        return self.accepts_tools and writes_bare_calls(self.source)

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        **kwargs: Any,
    ) -> str:
        """The prompt text; raise :class:`TemplateError` when the template refuses."""
        context = dict(kwargs)
        context.update(
            messages=list(messages),
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token,
            eos_token=self.eos_token,
        )
        if tools:
            context["tools"] = list(tools)
        try:
            return self._template.render(**context)
        except _TemplateRaised as exc:
            raise TemplateError(f"The chat template rejected the messages: {exc}") from None
        except jinja2.TemplateError as exc:
            raise TemplateError(f"The chat template failed to render: {exc}") from None
        except (TypeError, KeyError, AttributeError, ValueError) as exc:
            raise TemplateError(f"The chat template failed on these messages: {exc}") from None
