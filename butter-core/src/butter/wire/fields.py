"""Field readers both wire dialects share: the request body decoded and checked, and each
field read with its type and range, the generation parameters among them.

Every problem is an :class:`~butter.errors.InvalidRequestError` naming the field. No I/O.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from butter.errors import InvalidRequestError
from butter.generation import GenerationParams

DEFAULT_TEMPERATURE = 0.8  # llama-server's default; OpenAI's is 1.0
MAX_STOP_SEQUENCES = 16
MAX_LOGIT_BIAS = 300  # OpenAI's limit
DEFAULT_TOP_K = 40  # llama-server's
MAX_JSON_DEPTH = 64  # request bodies are shallow; deep nesting only costs recursion later


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
            check_text(value, where)
            continue
        if not isinstance(value, (dict, list)):
            continue
        if depth >= MAX_JSON_DEPTH:
            raise InvalidRequestError(f"The request body nests deeper than {MAX_JSON_DEPTH} "
                                      "levels.", param=where or None)
        if isinstance(value, dict):
            for key, item in value.items():
                path = f"{where}.{key}" if where else str(key)
                check_text(key, path)
                stack.append((item, path, depth + 1))
        else:
            stack.extend((item, f"{where}[{index}]", depth + 1) for index, item in enumerate(value))


def check_text(text: str, where: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        name = where.encode("utf-8", "replace").decode() or "body"
        raise InvalidRequestError(f"`{name}` is not valid text (it holds a lone UTF-16 "
                                  "surrogate).", param=name) from None


# ---- field readers ------------------------------------------------------------------

def number(body: Mapping[str, Any], key: str, default: float, *, low: float, high: float) -> float:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidRequestError(f"`{key}` must be a number.", param=key)
    if not low <= value <= high:
        raise InvalidRequestError(f"`{key}` must be between {low} and {high}.", param=key)
    return float(value)


def integer(body: Mapping[str, Any], key: str, *, low: int | None = None) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidRequestError(f"`{key}` must be an integer.", param=key)
    if low is not None and value < low:
        raise InvalidRequestError(f"`{key}` must be at least {low}.", param=key)
    return value


def boolean(body: Mapping[str, Any], key: str) -> bool | None:
    value = body.get(key)
    if value is None:
        return None
    if not isinstance(value, bool):
        raise InvalidRequestError(f"`{key}` must be a boolean.", param=key)
    return value


def json_object(body: Mapping[str, Any], key: str) -> dict[str, Any]:
    value = body.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise InvalidRequestError(f"`{key}` must be an object.", param=key)
    return value


def stops(value: Any, key: str) -> tuple[str, ...]:
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
        value = integer(body, key, low=1)
        if value is not None and max_tokens is None:
            max_tokens = value
    seed = integer(body, "seed")
    min_tokens = integer(body, "min_tokens", low=0) or 0
    top_k = integer(body, "top_k", low=-1)
    return GenerationParams(
        max_tokens=max_tokens,
        temperature=number(body, "temperature", DEFAULT_TEMPERATURE, low=0.0, high=2.0),
        top_p=number(body, "top_p", 1.0, low=0.0, high=1.0) or 1.0,
        seed=seed,
        stop=stops(body.get(stop_key), stop_key),
        ignore_eos=bool(boolean(body, "ignore_eos")),
        min_tokens=min_tokens,
        top_k=DEFAULT_TOP_K if top_k is None else max(top_k, 0),  # -1 (vLLM) and 0: off
        frequency_penalty=number(body, "frequency_penalty", 0.0, low=-2.0, high=2.0),
        presence_penalty=number(body, "presence_penalty", 0.0, low=-2.0, high=2.0),
        repetition_penalty=number(body, "repetition_penalty", 1.0, low=0.01, high=10.0),
        logit_bias=logit_bias(body.get("logit_bias")),
        min_p=number(body, "min_p", 0.0, low=0.0, high=1.0),
        speculation=boolean(body, "speculation") is not False,
    )


def logit_bias(value: Any) -> tuple[tuple[int, float], ...]:
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


# ---- JSON Schemas of what these readers take (published at /schema/openapi.json) ------
# The routes read their bodies themselves, so litestar cannot infer them; each dialect
# states its bodies beside its parser, from these pieces. Unknown fields are accepted and
# ignored, as the contract says, hence no ``additionalProperties: false``.

STRING = {"type": "string"}
TEXT_PART = {"type": "object", "required": ["type", "text"],
             "properties": {"type": {"enum": ["text", "input_text"]}, "text": STRING}}
STOP = {"anyOf": [STRING, {"type": "array", "items": STRING, "maxItems": 16}, {"type": "null"}]}
JSON_OBJECT = {"type": "object"}
SAMPLING = {
    "temperature": {"type": "number", "minimum": 0, "maximum": 2},
    "top_p": {"type": "number", "minimum": 0, "maximum": 1},
    "seed": {"type": "integer"},
    "ignore_eos": {"type": "boolean"},
    "min_tokens": {"type": "integer", "minimum": 0},
    # butter's own: false turns prompt-lookup speculation off (the tokens are the same).
    "speculation": {"type": "boolean"},
    "stream": {"type": "boolean"},
    "top_k": {"type": "integer", "minimum": -1},
    "frequency_penalty": {"type": "number", "minimum": -2, "maximum": 2},
    "presence_penalty": {"type": "number", "minimum": -2, "maximum": 2},
    "repetition_penalty": {"type": "number", "minimum": 0.01, "maximum": 10},
    "min_p": {"type": "number", "minimum": 0, "maximum": 1},
    "logit_bias": {"type": "object", "maxProperties": 300,
                   "additionalProperties": {"type": "number", "minimum": -100,
                                            "maximum": 100}},
}
RESPONSE_FORMAT = {
    "type": "object", "required": ["type"],
    "properties": {"type": {"enum": ["text", "json_object", "json_schema"]},
                   "json_schema": {"type": "object", "required": ["name"],
                                   "properties": {"name": STRING, "schema": JSON_OBJECT,
                                                  "strict": {"type": "boolean"}}}},
}
