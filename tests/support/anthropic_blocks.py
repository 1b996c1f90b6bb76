"""An Anthropic SDK message's content as (kind, value) pairs, for tests to compare."""

from __future__ import annotations

from typing import Any


def blocks_of(message: Any) -> list[tuple[str, Any]]:
    """``("thinking", text)``, ``("text", text)`` or ``("tool_use", (name, input))`` per
    block, in order; a tool_use block must carry an Anthropic-style ``toolu_`` id."""
    out = []
    for block in message.content:
        if block.type == "thinking":
            out.append(("thinking", block.thinking))
        elif block.type == "text":
            out.append(("text", block.text))
        else:
            assert block.type == "tool_use" and block.id.startswith("toolu_")
            out.append(("tool_use", (block.name, block.input)))
    return out
