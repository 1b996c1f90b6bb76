"""Long prompts: time to first token against llama-server (issue 24, item 4).

Three workloads, every prompt new to the server (a fresh text each time: nothing cached):

* ``one``: one prompt of about ``--long`` tokens (4,000), alone;
* ``eight``: eight prompts of about ``--lane-tokens`` tokens (1,100) each, all at once;
  reported as the median lane's time and the last lane's (when all eight have their
  first token);
* ``stall``: a stream already answering (counting on: ``--stall-tokens`` tokens, 256)
  when a prompt of about ``--long`` tokens arrives: the longest wait for the stream's
  next text while that prompt is read (what the reading costs a user watching
  the stream), and the long prompt's time to first token beside the stream.

Each timed prompt is a ``/v1/completions`` call with ``max_tokens`` 1, so its time is
the prompt's prefill plus one sampled token: the time to first token. Both servers get the
same texts in the same round. A round starts one server (``--parallel 8``, ``--threads``
threads, 8 x ``--slot-context`` KV cells), runs the workloads, stops it, then does the
same with the other; the side that goes first alternates from round to round. Reported:
the median over ``--rounds`` of each figure and of its per-round ratio butter/peer
(lower is better: a ratio under 1.0 is butter ahead). ``--same butter`` (or ``peer``)
runs one server in both columns: the A/A spread.

    .venv/bin/python bench/long_prompt.py [--rounds 5] [--same butter] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time

import common
import httpx

WORDS = (*common.WORDS, "river", "candle", "marble", "signal", "pepper", "canyon",
         "velvet", "anchor")
LANES = 8
FIGURES = ("one", "eight_p50", "eight_last", "stall_max_gap", "stall_long_ttft")
# Seconds the stream runs alone before the long prompt arrives.
STALL_LEAD = 0.5


def text(tokens: int, seed: str) -> str:
    """A prompt of about ``tokens`` SmolLM2 tokens (one a word), unlike any other seed's
    from its first words on."""
    rng = random.Random(seed)
    words = [rng.choice(WORDS) for _ in range(tokens - 12)]
    return f"Record {seed}: " + " ".join(words) + "\nSummary:"


async def first_token(client: httpx.AsyncClient, url: str, prompt: str) -> tuple[float, int]:
    started = time.perf_counter()
    response = await client.post(url, json={"model": common.MODEL_ID, "prompt": prompt,
                                            "max_tokens": 1, "temperature": 0})
    response.raise_for_status()
    return time.perf_counter() - started, response.json()["usage"]["prompt_tokens"]


async def token_times(client: httpx.AsyncClient, url: str, prompt: str, tokens: int,
                      started: asyncio.Event) -> list[float]:
    """Stream a completion of ``tokens`` tokens (``ignore_eos``: it runs its length);
    return when each piece of text arrived (both servers send a token's text as soon as
    it is whole, whitespace included). ``started`` is set at the first."""
    times: list[float] = []
    body = {"model": common.MODEL_ID, "prompt": prompt, "max_tokens": tokens,
            "temperature": 0, "stream": True, "ignore_eos": True}
    async with client.stream("POST", url, json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choices = json.loads(line[6:]).get("choices") or ()
            if any(choice.get("text") for choice in choices):
                times.append(time.perf_counter())
                started.set()
    return times


async def stall(client: httpx.AsyncClient, url: str, args: argparse.Namespace,
                round_index: int) -> dict:
    """The ``stall`` workload: a long prompt arrives while a stream is answering."""
    started = asyncio.Event()
    # A count to continue: every token the model writes is text (digits, commas and
    # spaces), so a gap is the server's doing, not an end-of-turn marker's empty text.
    first = 1 + 500 * round_index
    counting = "".join(f"{n}, " for n in range(first, first + 8)).rstrip()
    stream = asyncio.create_task(token_times(
        client, url, counting, args.stall_tokens, started))
    waiting = asyncio.create_task(started.wait())
    await asyncio.wait({stream, waiting}, return_when=asyncio.FIRST_COMPLETED)
    if not started.is_set():  # the stream failed, or ended without text
        waiting.cancel()
        stream.result()
        raise RuntimeError("the stall workload's stream wrote no text")
    await asyncio.sleep(STALL_LEAD)
    arrived = time.perf_counter()
    long_ttft, _ = await first_token(client, url, text(args.long, f"stall-{round_index}"))
    times = await stream
    if times[-1] < arrived + long_ttft:
        raise RuntimeError("the stream ended before the long prompt was read: "
                           "raise --stall-tokens")
    gaps = [(b - a, b) for a, b in zip(times, times[1:])]
    during = [gap for gap, at in gaps if arrived <= at <= arrived + long_ttft + 0.5]
    return {"stall_max_gap": max(during), "stall_long_ttft": long_ttft}


async def workloads(base: str, args: argparse.Namespace, round_index: int) -> dict:
    url = f"{base}/completions"
    async with httpx.AsyncClient(timeout=600) as client:
        await first_token(client, url, text(64, f"warm-{round_index}"))
        one, one_tokens = await first_token(client, url, text(args.long, f"one-{round_index}"))
        lanes = await asyncio.gather(*(
            first_token(client, url, text(args.lane_tokens, f"lane-{round_index}-{lane}"))
            for lane in range(LANES)))
        stalled = await stall(client, url, args, round_index)
    times = sorted(seconds for seconds, _ in lanes)
    return {"one": one, "one_tokens": one_tokens, "eight_p50": statistics.median(times),
            "eight_last": times[-1], "lane_tokens": lanes[0][1], **stalled}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    common.add_common_arguments(parser)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--long", type=int, default=4000, help="tokens of the lone prompt")
    parser.add_argument("--lane-tokens", type=int, default=1100,
                        help="tokens of each of the eight concurrent prompts")
    parser.add_argument("--stall-tokens", type=int, default=256,
                        help="tokens the stream of the stall workload answers")
    parser.add_argument("--slot-context", type=int, default=4608)
    parser.add_argument("--same", choices=common.SERVERS,
                        help="one server in both columns (the A/A run)")
    args = parser.parse_args()
    results = common.run_rounds(
        args, lambda root, _side, round_index: asyncio.run(
            workloads(f"{root}/v1", args, round_index)),
        parallel=LANES, slot_context=args.slot_context)
    if args.only:
        return 0
    title = (f"long prompts: one of ~{args.long} tokens, eight of ~{args.lane_tokens} at "
             f"once, one beside a stream; {args.threads} threads")
    common.report_rounds(args, results, FIGURES, title)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
