"""Decode speed with a json_schema grammar against unconstrained, one butter server.

The same prompt, greedy, streamed, one request at a time; constrained and free
requests alternate (AB, BA, ...) so drift on a noisy machine lands on both. Decode
tok/s is (n - 1) / (t_last - t_first) over a stream's content chunks, the median over
``--rounds``. The free requests run to ``--max-tokens`` (``ignore_eos``); the
constrained ones stop where their JSON closes, so only streams of at least
``--min-tokens`` count. Target: constrained/free >= 0.9.

    .venv/bin/python bench/constrained.py [--rounds 5] [--backend gguf|mlx] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

from common import (
    MODEL_ID,
    Row,
    console,
    log_dir,
    median,
    print_rows,
    save_json,
    serve_bench,
    spawned,
)

PROMPT = "List many French words and their English meanings, as JSON."
SCHEMA = {"type": "object", "properties": {"words": {"type": "array", "items": {
    "type": "object", "properties": {"french": {"type": "string"}, "english": {"type": "string"}},
    "required": ["french", "english"], "additionalProperties": False}}},
    "required": ["words"], "additionalProperties": False}


def body(max_tokens: int, constrained: bool) -> dict:
    request = {"model": MODEL_ID, "messages": [{"role": "user", "content": PROMPT}],
               "stream": True, "stream_options": {"include_usage": True},
               "max_tokens": max_tokens, "temperature": 0}
    if constrained:
        request["response_format"] = {"type": "json_schema",
                                      "json_schema": {"name": "words", "schema": SCHEMA}}
    else:
        request.update(ignore_eos=True, min_tokens=max_tokens)
    return request


async def timed(url: str, max_tokens: int, constrained: bool) -> tuple[int, float | None]:
    async with serve_bench.lane_client() as client:
        record = await serve_bench.stream_chat(client, url, body(max_tokens, constrained))
    if record.error:
        raise SystemExit(f"request failed: {record.error}")
    _, _, tokens = serve_bench.usage_tokens(record)
    span = (record.last_output or 0.0) - (record.first_output or 0.0)
    return tokens, (tokens - 1) / span if span > 0 else None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--min-tokens", type=int, default=32)
    parser.add_argument("--backend", choices=("gguf", "mlx"), default="gguf")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--log-dir", type=Path)
    parser.add_argument("--json", type=Path, metavar="FILE")
    args = parser.parse_args()
    command = [sys.executable, "-m", "butter", "serve", "--model", MODEL_ID,
               "--backend", args.backend, "--parallel", "1", "--max-context", "2048"]
    if args.backend == "gguf":
        command += ["--threads", str(args.threads)]
    samples: dict[str, list[dict]] = {"free": [], "json_schema": []}
    with spawned("butter", lambda port: [*command, "--port", str(port)],
                 log_dir(args)) as (root, _, _):
        url = f"{root}/v1"
        asyncio.run(timed(url, 8, True))  # warm-up: builds the grammar tokenizer
        for index in range(args.rounds):
            order = (False, True) if index % 2 == 0 else (True, False)
            for constrained in order:
                tokens, rate = asyncio.run(timed(url, args.max_tokens, constrained))
                name = "json_schema" if constrained else "free"
                samples[name].append({"tokens": tokens, "decode_tok_s": rate})
                console.print(f"[dim]{name}: {tokens} tokens, "
                              f"{rate or 0:.1f} tok/s[/dim]")
    rates = {name: median([s["decode_tok_s"] for s in values
                           if s["decode_tok_s"] and s["tokens"] >= args.min_tokens])
             for name, values in samples.items()}
    rows = [Row("decode tok/s (median)", rates["json_schema"], rates["free"])]
    print_rows(f"json_schema vs free decode, {args.backend}, {args.rounds} rounds", rows,
               peer="unconstrained")
    save_json(args.json, rows, {"samples": samples, "backend": args.backend})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
