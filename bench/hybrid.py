"""A hybrid model (the tiny random-weight Qwen3.5 GGUF) on butter and llama-server.

    python bench/hybrid.py [--model FILE.gguf] [--lanes 1 4 8] [--tokens 64] [--json out.json]

Without ``--model`` it builds the tiny Qwen3.5 F16 GGUF the tests use
(``tests/support/tiny_qwen35.py``; needs the pinned sdist through ``BUTTER_LLAMA_SDIST``).
Each server is started alone, with the same threads, slots and KV room, llama-server
with its defaults (``--ctx-checkpoints`` 32 per slot in the pinned source). Two figures:

- **tool rounds**: a five-round tool conversation, each round resending every message.
  butter runs it with ``tool_choice: required`` (a random-weight model calls a tool only
  under a grammar); llama-server gets the very same message lists, round by round, so
  both read the same prompts. Each round's ``cached_tokens`` is printed for both.
- **tokens/s at N lanes**: N requests at once, each drawing ``--tokens`` tokens
  (``ignore_eos``, temperature 0.7, seed per lane); generated tokens over wall time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

import httpx
from common import (
    REPO,
    Row,
    add_common_arguments,
    console,
    log_dir,
    print_rows,
    save_json,
    spawned,
)

sys.path.insert(0, str(REPO / "tests"))
from support.conversations import TOOLS, tool_rounds  # noqa: E402

MODEL_ID = "tiny"
SLOT_CONTEXT = 4096


def tiny_gguf() -> Path:
    from support.tiny_qwen35 import build_gguf

    return build_gguf(Path(tempfile.mkdtemp(prefix="tiny-qwen35-")) / "Qwen3.5-tiny.gguf")


def butter_command(args, parallel: int):
    def command(port: int) -> list[str]:
        return [sys.executable, "-m", "butter", "serve", "--model", str(args.model),
                "--port", str(port), "--parallel", str(parallel),
                "--max-context", str(parallel * SLOT_CONTEXT),
                "--threads", str(args.threads), *args.butter_args.split()]
    return command


def peer_command(args, parallel: int):
    def command(port: int) -> list[str]:
        return [str(args.llama_server), "-m", str(args.model), "-a", MODEL_ID, "--jinja",
                "--host", "127.0.0.1", "--port", str(port), "-np", str(parallel),
                "-c", str(parallel * SLOT_CONTEXT), "-t", str(args.threads)]
    return command


def replay(url: str, transcript: list[list[dict]]) -> list[tuple[int, int]]:
    """Send each round's recorded messages; (prompt, cached) per round."""
    usage = []
    with httpx.Client(timeout=600) as client:
        for messages in transcript:
            response = client.post(f"{url}/chat/completions", json={
                "model": MODEL_ID, "messages": messages, "tools": TOOLS,
                "max_tokens": 40, "temperature": 0.0})
            response.raise_for_status()
            body = response.json()["usage"]
            usage.append((body["prompt_tokens"],
                          (body.get("prompt_tokens_details") or {}).get("cached_tokens", 0)))
    return usage


async def lanes_rate(url: str, model: str, lanes: int, tokens: int) -> float:
    async with httpx.AsyncClient(timeout=600) as client:
        async def one(lane: int) -> int:
            response = await client.post(f"{url}/chat/completions", json={
                "model": model, "max_tokens": tokens, "ignore_eos": True,
                "temperature": 0.7, "seed": lane,
                "messages": [{"role": "user", "content": f"Lane {lane}: tell a long story."}]})
            response.raise_for_status()
            return response.json()["usage"]["completion_tokens"]

        await one(99)  # warm-up
        start = time.monotonic()
        counts = await asyncio.gather(*(one(lane) for lane in range(lanes)))
        return sum(counts) / (time.monotonic() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_common_arguments(parser)
    parser.add_argument("--model", type=Path, help="a hybrid GGUF (default: the tiny Qwen3.5)")
    parser.add_argument("--lanes", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()
    args.model = args.model or tiny_gguf()
    logs = log_dir(args)
    sides = [args.only] if args.only else ["butter", "peer"]
    commands = {"butter": butter_command, "peer": peer_command}
    details: dict[str, object] = {"model": str(args.model)}
    transcript: list[list[dict]] = []
    rounds: dict[str, list[tuple[int, int]]] = {}
    for side in sides:
        with spawned(side, commands[side](args, 2), logs) as (root, _, _):
            url = f"{root}/v1"
            model = httpx.get(f"{url}/models").json()["data"][0]["id"]
            if not transcript:
                rounds[side] = tool_rounds(url, model, record=transcript)
            else:
                rounds[side] = replay(url, transcript)
    details["tool_rounds"] = rounds
    console.print(json.dumps(rounds))
    rows = []
    for n, _ in enumerate(transcript):
        got = {side: rounds[side][n] for side in rounds}
        rows.append(Row(f"round {n + 1} cached_tokens (prompt "
                        f"{'/'.join(str(got[s][0]) for s in got)})",
                        got.get("butter", (0, None))[1], got.get("peer", (0, None))[1]))
    rates: dict[str, dict[int, float]] = {side: {} for side in sides}
    for lanes in args.lanes:
        for side in sides:
            with spawned(side, commands[side](args, lanes), logs) as (root, _, _):
                url = f"{root}/v1"
                model = httpx.get(f"{url}/models").json()["data"][0]["id"]
                rates[side][lanes] = asyncio.run(lanes_rate(url, model, lanes, args.tokens))
        rows.append(Row(f"tok/s at {lanes} lanes", rates.get("butter", {}).get(lanes),
                        rates.get("peer", {}).get(lanes)))
    details["tokens_per_s"] = rates
    print_rows("tiny Qwen3.5 (hybrid) GGUF: butter vs llama-server", rows)
    save_json(args.json, rows, details)


if __name__ == "__main__":
    main()
