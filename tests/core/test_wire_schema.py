"""The published request schemas and the wire parsers agree: every field a dialect's
parser reads is in the schema its route publishes, and every field the schema names is
one the parser reads (so neither documents what the other ignores)."""

from __future__ import annotations

import pytest

from butter.http.app import request_bodies
from butter.wire.anthropic import parse_messages_request
from butter.wire.openai import parse_chat_completion, parse_completion


class Recording(dict):
    """A body that remembers which top-level fields were read."""

    def __init__(self, data) -> None:
        super().__init__(data)
        self.read: set[str] = set()

    def get(self, key, default=None):
        self.read.add(key)
        return super().get(key, default)

    def __getitem__(self, key):
        self.read.add(key)
        return super().__getitem__(key)

    def __contains__(self, key) -> bool:
        self.read.add(key)
        return super().__contains__(key)


TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True,
        "stream_options": {"include_usage": True}, "logprobs": True, "top_logprobs": 2,
        "tools": TOOLS, "tool_choice": "auto", "n": 2, "seed": 1,
        "chat_template_kwargs": {"enable_thinking": False}, "reasoning_effort": "low"}
COMPLETION = {"model": "m", "prompt": "hi", "stream": True,
              "stream_options": {"include_usage": True}, "logprobs": 2, "echo": False,
              "n": 2, "suffix": "x"}
MESSAGES = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}],
            "system": "s", "stream": True, "thinking": {"type": "enabled", "budget_tokens": 9},
            "tools": [{"name": "f", "input_schema": {"type": "object"}}],
            "tool_choice": {"type": "auto"}}


@pytest.mark.parametrize(("path", "parse", "body"), [
    ("/v1/chat/completions", parse_chat_completion, CHAT),
    ("/v1/completions", parse_completion, COMPLETION),
    ("/v1/messages", parse_messages_request, MESSAGES),
    ("/v1/messages/count_tokens",
     lambda body: parse_messages_request(body, for_count=True), MESSAGES),
])
def test_the_published_schema_names_exactly_the_fields_the_parser_reads(path, parse, body):
    published = set(request_bodies()[path]["properties"])
    recording = Recording(body)
    parse(recording)
    assert recording.read <= published, f"read but not published: {recording.read - published}"
    assert published <= recording.read, f"published but not read: {published - recording.read}"
