"""Conversations that come back after others took their session: the prompt cache in host
memory (``--cache-ram``) against llama-server's.

An agent serving more conversations than the server has sessions: ``--conversations``
(12) each send a first turn of about ``--tokens`` prompt tokens (1,000), ``--lanes`` (4)
at a time, to a server with ``--parallel`` 4 sessions; each answer is ``--answer`` tokens
(32). Then every conversation comes back, in the same order, with its first turn, its
answer and a new question: by then eight others have passed through its session. Without
a prompt cache the return turn reads the whole conversation again; with one it loads the
saved keys and values and reads only the new question (``--turn`` words of a tool's
output before it, none by default). Each return turn is a
``/v1/completions`` call with ``max_tokens`` 1 (its time is the time to first token).

Reported, as medians over ``--rounds`` of each figure and of its per-round ratio
butter/peer (lower is better): the return turns' median and total time, and the first
turns' median (the cold read, for scale). A round starts one server, runs both phases,
stops it, then the other; the side going first alternates, and every round's texts are
new. ``--same butter`` runs one server in both columns (the A/A spread);
``--butter-args "--cache-ram 0"`` gives butter without the cache.

    .venv/bin/python bench/prompt_cache.py [--rounds 3] [--same butter] [--json out.json]
    .venv/bin/python bench/prompt_cache.py --replot A.json B.json ... --plot chart.png

``--replot`` draws the saved runs' medians side by side (a bar per server and setting).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time

import common
import httpx

FIGURES = ("return_p50", "return_total", "first_p50")
PANELS = (("return_p50", "return turn, median s (lower is better)"),
          ("return_total", "all return turns, s (lower is better)"),
          ("first_p50", "first turn, median s (lower is better)"))
COUNTERS = ("butter_prompt_cache_hits_total", "butter_prompt_cache_tokens_total",
            "butter_prompt_cache_saves_total")


def opening(tokens: int, seed: str) -> str:
    """A conversation's first turn of about ``tokens`` SmolLM2 tokens, unlike any other
    seed's from its first words on."""
    rng = random.Random(seed)
    words = " ".join(rng.choice(common.WORDS) for _ in range(tokens - 16))
    return f"Log {seed}: {words}\nQuestion: which word comes up most?\nAnswer:"


def follow_up(tokens: int, seed: str) -> str:
    """A return turn's new text: ``tokens`` words of a tool's output (none by default),
    then a short question."""
    rng = random.Random(f"turn-{seed}")
    output = " ".join(rng.choice(common.WORDS) for _ in range(tokens))
    return (f"\nTool output: {output}" if tokens else "") + "\nQuestion: and the least?\nAnswer:"


async def complete(client: httpx.AsyncClient, url: str, prompt: str,
                   tokens: int) -> tuple[float, str]:
    started = time.perf_counter()
    response = await client.post(url, json={"model": common.MODEL_ID, "prompt": prompt,
                                            "max_tokens": tokens, "temperature": 0})
    response.raise_for_status()
    return time.perf_counter() - started, response.json()["choices"][0]["text"]


async def in_lanes(lanes: int, jobs) -> list:
    """Run the coroutine factories ``jobs`` with at most ``lanes`` at once, in order."""
    gate = asyncio.Semaphore(lanes)

    async def run(job):
        async with gate:
            return await job()

    return await asyncio.gather(*(run(job) for job in jobs))


async def workload(base: str, args: argparse.Namespace, round_index: int) -> dict:
    url = f"{base}/completions"
    seeds = [f"{round_index}-{n}" for n in range(args.conversations)]
    async with httpx.AsyncClient(timeout=600) as client:
        await complete(client, url, opening(64, f"warm-{round_index}"), 1)
        firsts = await in_lanes(args.lanes, [
            lambda s=seed: complete(client, url, opening(args.tokens, s), args.answer)
            for seed in seeds])
        started = time.perf_counter()
        returns = await in_lanes(args.lanes, [
            lambda s=seed, a=answer: complete(
                client, url, opening(args.tokens, s) + a + follow_up(args.turn, s), 1)
            for seed, (_, answer) in zip(seeds, firsts)])
        total = time.perf_counter() - started
    found = {"return_p50": statistics.median(t for t, _ in returns), "return_total": total,
             "first_p50": statistics.median(t for t, _ in firsts)}
    return found


def label(run: dict) -> str:
    """What a saved run adds to its columns' names: the return turn's tool output."""
    return f", +{run['turn']} words" if run.get("turn") else ""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    common.add_common_arguments(parser)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--conversations", type=int, default=12)
    parser.add_argument("--parallel", type=int, default=4, help="sessions (slots) per server")
    parser.add_argument("--lanes", type=int, default=4, help="requests at once")
    parser.add_argument("--tokens", type=int, default=1000, help="first-turn prompt tokens")
    parser.add_argument("--turn", type=int, default=0,
                        help="words of tool output a return turn adds before its question")
    parser.add_argument("--answer", type=int, default=32, help="first-turn answer tokens")
    parser.add_argument("--slot-context", type=int, default=2048)
    common.add_round_arguments(parser)
    args = parser.parse_args()
    title = ("12 conversations coming back after others took their 4 sessions "
             "(SmolLM2 Q4_1, 2 threads)")
    if common.replot(parser, args, FIGURES, PANELS, title, label):
        return 0

    def measure(root: str, side: str, round_index: int) -> dict:
        found = asyncio.run(workload(f"{root}/v1", args, round_index))
        if side == "butter":
            found |= common.butter_counters(root, COUNTERS)
        return found

    results = common.run_rounds(args, measure, parallel=args.parallel,
                                slot_context=args.slot_context)
    if args.only:
        return 0
    title = (f"{args.conversations} conversations of ~{args.tokens} tokens on {args.parallel} "
             f"sessions, {args.lanes} at once, coming back; {args.threads} threads")
    common.report_rounds(args, results, FIGURES, title, butter_args=args.butter_args,
                         turn=args.turn)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
