"""Single-stream decode speed: butter vs llama-server on the shipped SmolLM2 GGUF.

One stream, greedy, exactly ``--max-tokens`` completion tokens (``ignore_eos``).
Each round starts one server, sends one warm-up request, times ``--per-block``
requests and stops it, then does the same with the other server; the first server
alternates between rounds (AB, BA, AB, ...) so drift on a noisy machine lands on
both sides. Only one server runs at any time.

Decode tok/s is (n - 1) / (t_last - t_first) over the content chunks of a stream
(n = usage.completion_tokens), i.e. decode without the prefill and first token;
end-to-end tok/s is n / request time. The figures are medians over all timed
requests. Target: butter/peer decode ratio >= 0.95.

For butter it also reads ``/metrics`` around each request and splits a decode step
(``butter_decode_step_seconds_total`` over ``butter_decode_steps_total``) into the back
end's step (``butter_decode_pass_seconds_total``: the native pass and the draws) and
the rest (the engine's planning and token bookkeeping, and handing the text to the HTTP
thread): where butter's time per token goes beside llama-server's, whose whole
decode step is C++.

    /work/venv/bin/python bench/decode_single.py [--rounds 5] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import os
from pathlib import Path

from common import (
    MODEL_ID,
    Row,
    ServerPlan,
    add_common_arguments,
    butter_counters,
    console,
    log_dir,
    median,
    print_rows,
    running_server,
    save_json,
    serve_bench,
    server_order,
)

PROMPT = "Write a long story about a lighthouse keeper who finds a message in a bottle."
SLOT_CONTEXT = 1024
STEP_COUNTERS = ("butter_decode_steps_total", "butter_decode_step_seconds_total",
                 "butter_decode_pass_seconds_total", "butter_generated_tokens_total")


def request_body(max_tokens: int) -> dict:
    return {
        "model": MODEL_ID,
        "messages": [{"role": "user", "content": PROMPT}],
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "min_tokens": max_tokens,
    }


async def timed_request(url: str, max_tokens: int) -> dict:
    """One stream's decode and end-to-end rates, with the counts they came from."""
    async with serve_bench.lane_client() as client:
        record = await serve_bench.stream_chat(client, url, request_body(max_tokens))
    if record.error:
        raise SystemExit(f"request failed: {record.error}")
    _, _, tokens = serve_bench.usage_tokens(record)
    decode_span = (record.last_output or 0.0) - (record.first_output or 0.0)
    return {
        "completion_tokens": tokens,
        "content_chunks": record.output_chunks,
        "ttft_s": (record.first_output or record.finished) - record.started,
        "decode_tok_s": (tokens - 1) / decode_span if decode_span > 0 else None,
        "decode_ms": 1000 * decode_span / (tokens - 1) if decode_span > 0 else None,
        "e2e_tok_s": tokens / (record.finished - record.started),
        "load_average_1m": os.getloadavg()[0],
    }


def step_split(url: str, max_tokens: int) -> dict:
    """One timed request on butter, with its decode steps' time from ``/metrics``: ms a
    step in all, inside the back end's step, and outside it."""
    root = url.removesuffix("/v1")
    before = butter_counters(root, STEP_COUNTERS)
    sample = asyncio.run(timed_request(url, max_tokens))
    after = butter_counters(root, STEP_COUNTERS)
    delta = {name: after.get(name, 0.0) - before.get(name, 0.0) for name in STEP_COUNTERS}
    steps = delta["butter_decode_steps_total"]
    if steps:
        step = 1000 * delta["butter_decode_step_seconds_total"] / steps
        inside = 1000 * delta["butter_decode_pass_seconds_total"] / steps
        sample.update(step_ms=step, pass_ms=inside, outside_ms=step - inside,
                      tokens_per_step=(delta["butter_generated_tokens_total"] - 1) / steps)
    return sample


def run_block(plan: ServerPlan, args: argparse.Namespace, logs: Path) -> list[dict]:
    with running_server(plan, logs) as url:
        asyncio.run(timed_request(url, args.max_tokens))  # warm-up, not counted
        if plan.name == "butter":
            samples = [step_split(url, args.max_tokens) for _ in range(args.per_block)]
        else:
            samples = [asyncio.run(timed_request(url, args.max_tokens))
                       for _ in range(args.per_block)]
    for sample in samples:
        split = (f", a decode step {sample['step_ms']:.2f} ms: {sample['pass_ms']:.2f} in the "
                 f"back end, {sample['outside_ms']:.2f} outside"
                 if "step_ms" in sample else "")
        console.print(f"[dim]{plan.name}: decode {sample['decode_tok_s']:.1f} tok/s "
                      f"({sample['decode_ms']:.2f} ms a token), "
                      f"{sample['completion_tokens']} tokens in "
                      f"{sample['content_chunks']} chunks{split}[/dim]")
    return samples


def summarize(samples: dict[str, list[dict]]) -> list[Row]:
    def figure(name: str, key: str) -> float | None:
        values = [s[key] for s in samples[name] if s[key] is not None]
        return median(values) if values else None

    return [
        Row("decode tok/s (median)", figure("butter", "decode_tok_s"),
            figure("peer", "decode_tok_s")),
        Row("end-to-end tok/s (median)", figure("butter", "e2e_tok_s"),
            figure("peer", "e2e_tok_s")),
        Row("TTFT ms (median)", _ms(figure("butter", "ttft_s")), _ms(figure("peer", "ttft_s")),
            higher_is_better=False),
        Row("decode ms a token (median)", figure("butter", "decode_ms"),
            figure("peer", "decode_ms"), higher_is_better=False),
        Row("butter decode step ms: in the back end", figure("butter", "pass_ms"), None,
            higher_is_better=False),
        Row("butter decode step ms: outside it", figure("butter", "outside_ms"), None,
            higher_is_better=False),
    ]


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5, help="server blocks per side")
    parser.add_argument("--per-block", type=int, default=1, help="timed requests per block")
    parser.add_argument("--max-tokens", type=int, default=128)
    add_common_arguments(parser)
    args = parser.parse_args()
    logs = log_dir(args)
    samples: dict[str, list[dict]] = {"butter": [], "peer": []}
    for round_index in range(args.rounds):
        for name in server_order(args, round_index):
            plan = ServerPlan(name=name, parallel=1, slot_context=SLOT_CONTEXT,
                              threads=args.threads, llama_server=args.llama_server,
                              butter_args=args.butter_args)
            samples[name] += run_block(plan, args, logs)
    rows = summarize(samples)
    print_rows(f"single-stream decode, {args.max_tokens} tokens, {args.rounds} rounds", rows)
    save_json(args.json, rows, {"samples": samples, "max_tokens": args.max_tokens,
                                "rounds": args.rounds, "threads": args.threads})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
