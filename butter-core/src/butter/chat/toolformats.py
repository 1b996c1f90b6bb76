"""Tool-call markup families that `butter.chat.recovery.StreamParser` recovers.

A format answers two questions about text that starts at one of its open tags: where
does the block end, and which calls does it hold. The stream parser does all the
buffering, so a format always sees text from the open tag on, never a lone delta.

Built in:

- `JsonToolFormat` – Hermes / Qwen: ``<tool_call>{"name": …, "arguments": {…}}</tool_call>``.
- `XmlToolFormat` – Qwen3-Coder: ``<tool_call><function=NAME><parameter=P>V</parameter>…
  </function></tool_call>``, and the same ``<function=…>`` block without the wrapper.
  Parameter values are text; they are typed by the tool's JSON schema.

`taught_format` reads which of the two a chat template teaches its model.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final, Protocol

import attrs

from butter.hookspecs import hookimpl

__all__ = [
    "BUILTIN_TOOL_FORMATS",
    "HERMES",
    "NOT_A_BLOCK",
    "QWEN3_CODER",
    "Arguments",
    "JsonToolFormat",
    "ToolFormat",
    "XmlToolFormat",
    "taught_format",
    "value_types",
    "writes_bare_calls",
]

Arguments = dict[str, Any]

HERMES: Final = "hermes"
QWEN3_CODER: Final = "qwen3_coder"

NOT_A_BLOCK: Final = 0
"""`ToolFormat.block_end`'s answer when the text at the open tag is already known not
to be a block of that format (say ``<tool_call>`` followed by prose)."""


class ToolFormat(Protocol):
    """One family of tool-call markup. Third parties add one through the
    ``register_tool_formats`` hook.

    Both methods must answer the same for a text and any longer text that starts with
    it, whatever the chunking; the stream parser relies on that to give the same
    result for every split of the model's output.
    """

    @property
    def name(self) -> str:
        """Short identifier, e.g. ``"hermes"``."""
        ...

    @property
    def open_tags(self) -> tuple[str, ...]:
        """Literal strings that start a block of this format, e.g. ``("<tool_call>",)``."""
        ...

    @property
    def close_tags(self) -> tuple[str, ...]:
        """Tags that end blocks (or sit inside them): dropped wherever they stand outside
        a parsed block, and stripped from a block given up as content. May be empty."""
        ...

    @property
    def inner_tags(self) -> tuple[str, ...]:
        """Tags opened only inside a block (``<function=``); stripped likewise. May be
        empty."""
        ...

    def block_end(self, text: str) -> int | None:
        """Given text starting at one of `open_tags`: the index just past the block's
        end; None while the block may still close; `NOT_A_BLOCK` when it cannot be a
        block of this format."""
        ...

    def parse(
        self, block: str, tools: Sequence[Mapping[str, Any]]
    ) -> list[tuple[str, Arguments]] | None:
        """The (name, arguments) calls in a closed block, or None when it is malformed.

        ``tools`` is the request's OpenAI tool list, for formats whose values need the
        tool's JSON schema to be typed. Names are not checked against it.
        """
        ...


def _reject_constant(constant: str) -> Any:
    raise ValueError(f"{constant} is not JSON")


# Python's json accepts NaN and Infinity; the arguments we emit must be strict JSON.
_JSON: Final = json.JSONDecoder(parse_constant=_reject_constant)
_JSON_ERRORS: Final = (ValueError, RecursionError)
_WHITESPACE: Final = re.compile(r"\s*")


def _skip_whitespace(text: str, pos: int) -> int:
    match = _WHITESPACE.match(text, pos)
    return match.end() if match else pos


def _is_prefix(text: str, *tags: str) -> bool:
    """Whether ``text`` could still grow into one of ``tags``."""
    return any(tag.startswith(text) for tag in tags)


# --- Hermes / Qwen JSON ---------------------------------------------------------------


@attrs.frozen
class JsonToolFormat:
    """A JSON call object (or several, or a list of them) between two tags.

    The object is ``{"name": …, "arguments": {…}}``; the arguments may be a JSON string,
    may be called ``"parameters"``, and the OpenAI shape ``{"function": {…}}`` is
    accepted too. Other models wrap the same JSON in other tags: pass them in.
    """

    name: str = HERMES
    open_tag: str = "<tool_call>"
    close_tag: str = "</tool_call>"

    @property
    def open_tags(self) -> tuple[str, ...]:
        return (self.open_tag,)

    @property
    def close_tags(self) -> tuple[str, ...]:
        return (self.close_tag,)

    @property
    def inner_tags(self) -> tuple[str, ...]:
        return ()

    def block_end(self, text: str) -> int | None:
        start = _skip_whitespace(text, len(self.open_tag))
        if start < len(text) and text[start] not in "{[":
            return NOT_A_BLOCK
        close = text.find(self.close_tag, start)
        return None if close < 0 else close + len(self.close_tag)

    def parse(
        self, block: str, tools: Sequence[Mapping[str, Any]]
    ) -> list[tuple[str, Arguments]] | None:
        body = block.removeprefix(self.open_tag).removesuffix(self.close_tag)
        calls: list[tuple[str, Arguments]] = []
        pos = _skip_whitespace(body, 0)
        while pos < len(body):
            try:
                value, pos = _JSON.raw_decode(body, pos)
            except _JSON_ERRORS:
                return None
            for item in value if isinstance(value, list) else [value]:
                call = _json_call(item)
                if call is None:
                    return None
                calls.append(call)
            pos = _skip_whitespace(body, pos)
        return calls or None


def _json_call(item: object) -> tuple[str, Arguments] | None:
    if not isinstance(item, dict):
        return None
    if isinstance(item.get("function"), dict):
        item = item["function"]
    name = item.get("name")
    if not isinstance(name, str) or not name.strip():
        return None
    arguments = item.get("arguments", item.get("parameters"))
    if isinstance(arguments, str):
        try:
            arguments = _JSON.decode(arguments) if arguments.strip() else {}
        except _JSON_ERRORS:
            return None
    if arguments is None:
        arguments = {}
    if not isinstance(arguments, dict):
        return None
    return name.strip(), arguments


# --- Qwen3-Coder XML ------------------------------------------------------------------

_FUNCTION: Final = "<function="
_FUNCTION_END: Final = "</function>"
_PARAMETER: Final = "<parameter="
_PARAMETER_END: Final = "</parameter>"


class _NotAFunction(Exception):
    """The text at ``<function=`` does not follow the XML call grammar."""


@attrs.frozen
class _Function:
    end: int
    name: str
    parameters: list[tuple[str, str]]


@attrs.frozen
class XmlToolFormat:
    """Qwen3-Coder's XML calls, wrapped in ``<tool_call>`` or bare.

    A parameter value may itself contain ``</parameter>`` (code often does), so only
    a closing tag followed by the next parameter or by ``</function>`` ends it.
    """

    name: str = QWEN3_CODER
    wrapper_open: str = "<tool_call>"
    wrapper_close: str = "</tool_call>"

    @property
    def open_tags(self) -> tuple[str, ...]:
        return (self.wrapper_open, _FUNCTION)

    @property
    def close_tags(self) -> tuple[str, ...]:
        return (self.wrapper_close, "</function>", "</parameter>")

    @property
    def inner_tags(self) -> tuple[str, ...]:
        return ("<parameter=",)

    def block_end(self, text: str) -> int | None:
        if text.startswith(_FUNCTION):
            try:
                function = _scan_function(text, 0)
            except _NotAFunction:
                return NOT_A_BLOCK
            return None if function is None else function.end
        start = _skip_whitespace(text, len(self.wrapper_open))
        if not text.startswith(_FUNCTION, start) and not _is_prefix(text[start:], _FUNCTION):
            return NOT_A_BLOCK
        close = text.find(self.wrapper_close, start)
        return None if close < 0 else close + len(self.wrapper_close)

    def parse(
        self, block: str, tools: Sequence[Mapping[str, Any]]
    ) -> list[tuple[str, Arguments]] | None:
        if block.startswith(self.wrapper_open):
            block = block.removeprefix(self.wrapper_open).removesuffix(self.wrapper_close)
        calls: list[tuple[str, Arguments]] = []
        pos = _skip_whitespace(block, 0)
        while pos < len(block):
            try:
                function = _scan_function(block, pos) if block.startswith(_FUNCTION, pos) else None
            except _NotAFunction:
                return None
            if function is None:
                return None
            calls.append((function.name, _typed_arguments(function, tools)))
            pos = _skip_whitespace(block, function.end)
        return calls or None


def _scan_function(text: str, pos: int) -> _Function | None:
    """The function element at ``pos``, or None if ``text`` ends before it does.

    Raises _NotAFunction as soon as the text breaks the grammar.
    """
    scanned = _scan_tag_name(text, pos + len(_FUNCTION))
    if scanned is None:
        return None
    name, pos = scanned
    parameters: list[tuple[str, str]] = []
    while True:
        pos = _skip_whitespace(text, pos)
        if text.startswith(_FUNCTION_END, pos):
            return _Function(end=pos + len(_FUNCTION_END), name=name, parameters=parameters)
        if not text.startswith(_PARAMETER, pos):
            if _is_prefix(text[pos:], _FUNCTION_END, _PARAMETER):
                return None
            raise _NotAFunction
        scanned = _scan_tag_name(text, pos + len(_PARAMETER))
        if scanned is None:
            return None
        parameter, value_start = scanned
        value_end = _find_value_end(text, value_start)
        if value_end is None:
            return None
        parameters.append((parameter, text[value_start:value_end]))
        pos = value_end + len(_PARAMETER_END)


def _scan_tag_name(text: str, pos: int) -> tuple[str, int] | None:
    """The ``NAME`` of ``<function=NAME>`` / ``<parameter=NAME>`` and the index past ``>``."""
    close = text.find(">", pos)
    name = text[pos:] if close < 0 else text[pos:close]
    if "<" in name or "\n" in name or len(name.split()) > 1:  # names have no spaces; prose does
        raise _NotAFunction
    if close < 0:
        return None
    if not name.strip():
        raise _NotAFunction
    return name.strip(), close + 1


def _find_value_end(text: str, start: int) -> int | None:
    """Index of the ``</parameter>`` that ends the value starting at ``start``."""
    search = start
    while (end := text.find(_PARAMETER_END, search)) >= 0:
        after = _skip_whitespace(text, end + len(_PARAMETER_END))
        following = text[after : after + len(_PARAMETER)]
        if following.startswith((_PARAMETER, _FUNCTION_END)):
            return end
        if _is_prefix(following, _PARAMETER, _FUNCTION_END):
            return None  # the text stops before we can tell
        search = end + 1
    return None


# --- typing XML values by the tool's JSON schema --------------------------------------


def _typed_arguments(function: _Function, tools: Sequence[Mapping[str, Any]]) -> Arguments:
    root = _parameters_schema(function.name, tools)
    properties = root.get("properties")
    properties = properties if isinstance(properties, Mapping) else {}
    return {
        name: _typed_value(raw.removeprefix("\n").removesuffix("\n"), properties.get(name), root)
        for name, raw in function.parameters
    }


def _parameters_schema(name: str, tools: Sequence[Mapping[str, Any]]) -> Mapping[str, Any]:
    for tool in tools:
        if not isinstance(tool, Mapping):
            continue
        function = tool.get("function")
        function = function if isinstance(function, Mapping) else tool
        if function.get("name") != name:
            continue
        schema = function.get("parameters")
        return schema if isinstance(schema, Mapping) else {}
    return {}


class _NoValue:
    """A converter's answer when the text is not of its type."""


_NO_VALUE: Final = _NoValue()


def value_types(schema: object, root: Mapping[str, Any] | None = None) -> list[str]:
    """The JSON types a property allows, most specific first (``"string"``, which any
    text is, last); empty when the schema does not say.

    ``root`` is the tool's parameters schema, where local ``$ref`` s point. The XML call
    grammar (`butter.chat.grammar`) and the parser type a value by this one answer.
    """
    schema = _resolved(schema, root)
    if not isinstance(schema, Mapping):
        return []
    declared = schema.get("type")
    types = [declared] if isinstance(declared, str) else declared
    if not isinstance(types, list):
        options = [*_as_list(schema.get("anyOf")), *_as_list(schema.get("oneOf"))]
        options = [_resolved(option, root) for option in options]
        types = [option.get("type") for option in options if isinstance(option, Mapping)]
    known = {t for t in types if isinstance(t, str) and t in _CONVERTERS}
    return sorted(known, key=list(_CONVERTERS).index)


def _resolved(schema: object, root: Mapping[str, Any] | None) -> object:
    """``schema``, or what its local ``$ref`` (``#/$defs/Name``) points at."""
    if not isinstance(schema, Mapping) or not isinstance(schema.get("$ref"), str):
        return schema
    ref = schema["$ref"]
    if not ref.startswith("#/") or root is None:
        return schema
    target: object = root
    for part in ref[2:].split("/"):
        part = part.replace("~1", "/").replace("~0", "~")
        target = target.get(part) if isinstance(target, Mapping) else None
    return target if isinstance(target, Mapping) else schema


def _as_list(value: object) -> list[Any]:
    return value if isinstance(value, list) else []


def _typed_value(raw: str, schema: object, root: Mapping[str, Any]) -> Any:
    for type_ in value_types(schema, root):
        value = _CONVERTERS[type_](raw)
        if value is not _NO_VALUE:
            return value
    return raw


def _json_number(text: str) -> int | float | _NoValue:
    try:
        value = _JSON.decode(text)
    except _JSON_ERRORS:
        try:
            value = float(text)
        except ValueError:
            return _NO_VALUE
    if isinstance(value, bool) or not isinstance(value, int | float):
        return _NO_VALUE
    return value if math.isfinite(value) else _NO_VALUE


def _to_null(raw: str) -> None | _NoValue:
    return None if raw.strip().lower() in ("null", "none") else _NO_VALUE


def _to_boolean(raw: str) -> bool | _NoValue:
    text = raw.strip().lower()
    if text in ("true", "1", "yes"):
        return True
    if text in ("false", "0", "no"):
        return False
    return _NO_VALUE


def _to_integer(raw: str) -> int | _NoValue:
    value = _json_number(raw.strip())
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value if isinstance(value, int) else _NO_VALUE


def _to_number(raw: str) -> int | float | _NoValue:
    return _json_number(raw.strip())


def _to_container(kind: type) -> Callable[[str], Any]:
    def convert(raw: str) -> Any:
        try:
            value = _JSON.decode(raw.strip())
        except _JSON_ERRORS:
            return _NO_VALUE
        return value if isinstance(value, kind) else _NO_VALUE

    return convert


# Tried in this order; "string" last since any text is one.
_CONVERTERS: Final[dict[str, Callable[[str], Any]]] = {
    "null": _to_null,
    "boolean": _to_boolean,
    "integer": _to_integer,
    "number": _to_number,
    "object": _to_container(dict),
    "array": _to_container(list),
    "string": lambda raw: raw,
}

def taught_format(template_source: str) -> str:
    """The name of the call format a chat template teaches: ``"qwen3_coder"`` for a
    template that writes ``<tool_call>``, ``<function=`` and ``<parameter=`` (Qwen3.5,
    Qwen3-Coder), else ``"hermes"``.

    The same test as llama.cpp's chat-format detection (``common/chat.cpp``), including
    its exclusion of templates that write ``<tool_call><function=`` with no newline
    between the tags: those models are not Qwen3-Coder's.
    """
    markers = ("<tool_call>", _FUNCTION, _PARAMETER)
    if all(marker in template_source for marker in markers) and \
            "'<tool_call><function=' ~ tool_call.name ~ '>'" not in template_source:
        return QWEN3_CODER
    return HERMES


def writes_bare_calls(template_source: str) -> bool:
    """Whether the model may open an XML call with ``<function=`` and no ``<tool_call>``.

    llama.cpp allows it for Qwen3-Coder (an XML template with no think block) and not for
    the thinking models that share its format (Qwen3.5), which keep the wrapper.
    """
    return taught_format(template_source) == QWEN3_CODER and "<think>" not in template_source


BUILTIN_TOOL_FORMATS: Final[tuple[ToolFormat, ...]] = (JsonToolFormat(), XmlToolFormat())
"""Tried in this order when two formats share an open tag."""


@hookimpl
def register_tool_formats(register) -> None:
    """The built-in formats register through the same hook as third-party ones."""
    for tool_format in BUILTIN_TOOL_FORMATS:
        register(tool_format)
