"""Conversations the session tests replay against a real server."""

from __future__ import annotations

import copy
import json

import httpx

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}}, "required": ["city"]}}}]


def tool_rounds(url: str, model: str, rounds: int = 5,
                record: list[list[dict]] | None = None) -> list[tuple[int, int]]:
    """A tool conversation resending every message each round; (prompt, cached) per round.
    ``record`` gets each round's messages as sent (to replay them elsewhere)."""
    messages = [{"role": "system", "content": "You are a travel assistant. Use tools."},
                {"role": "user", "content": "Plan a trip to Lisbon, Porto, Madrid, Seville "
                                            "and Valencia. Check the weather in each."}]
    usage = []
    with httpx.Client(timeout=300) as client:
        for n in range(rounds):
            if record is not None:
                record.append(copy.deepcopy(messages))
            response = client.post(f"{url}/chat/completions", json={
                "model": model, "messages": messages, "tools": TOOLS,
                "tool_choice": "required", "max_tokens": 40, "temperature": 0.0})
            assert response.status_code == 200, response.text
            body = response.json()
            usage.append((body["usage"]["prompt_tokens"],
                          body["usage"]["prompt_tokens_details"]["cached_tokens"]))
            message = body["choices"][0]["message"]
            calls = message.get("tool_calls") or []
            messages.append({"role": "assistant", "content": message.get("content") or "",
                             "tool_calls": calls})
            messages += [{"role": "tool", "tool_call_id": call["id"],
                          "content": json.dumps({"forecast": "sunny", "high_c": 20 + n})}
                         for call in calls]
            if not calls:
                messages.append({"role": "user", "content": "Go on."})
    return usage


def check_tool_rounds_resume_from_snapshots(server, snapshot_every: int, tail: int
                                            ) -> tuple[list[tuple[int, int]], dict, dict]:
    """Replay :func:`tool_rounds` on a hybrid model's ``server`` and check what a user
    sees: each round reports the previous prompt as cached, resumed from the last
    recurrent-state snapshot inside it (a multiple of ``snapshot_every``) and at least
    from the tail snapshot ``tail`` tokens before its end; the template renders the
    generation prompt's last token otherwise once the answer is in the history, so the
    prompts share all but it. The tokens reported cached are exactly those not prefilled.
    Gives the usage rows and the metrics before and after, for further checks."""
    before = server.wait_idle()
    usage = tool_rounds(server.base_url, server.model_id)
    after = server.wait_idle()
    assert usage[0][1] == 0
    for (previous, _), (prompt, cached) in zip(usage, usage[1:]):
        assert prompt > previous
        assert cached >= (previous - 1) // snapshot_every * snapshot_every > 0, usage
        assert previous - tail <= cached < previous, usage
    prompts, cached = sum(p for p, _ in usage), sum(c for _, c in usage)
    assert after["butter_prefill_tokens_total"] - before["butter_prefill_tokens_total"] \
        == prompts - cached
    return usage, before, after
