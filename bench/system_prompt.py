"""New questions on one cached system prompt: the time to first token of a chat request
whose system prompt the server has already read, against llama-server's.

An agent or an editor plugin sends the same long system prompt (``--tokens``, about
1,000 SmolLM2 tokens) with every question. The first request reads it; each of the
next ``--questions`` (8) asks something new under it, one at a time, as a
``/v1/chat/completions`` call with ``max_tokens`` 1, so its time is the time to first
token: reading the new question's few dozen tokens after the cached prefix.

Reported, as medians over ``--rounds`` of each figure and of its per-round ratio
butter/peer (lower is better): the questions' median and total time, and the first
request's (the cold read, for scale). A round starts one server, asks, stops it, then
the other; the side going first alternates, and every round's texts are new.
``--same butter`` runs one server in both columns (the A/A spread).

    .venv/bin/python bench/system_prompt.py [--rounds 5] [--same butter] [--json out.json]
    .venv/bin/python bench/system_prompt.py --replot A.json B.json ... --plot chart.png

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

FIGURES = ("question_p50", "question_total", "first")
PANELS = (("question_p50", "new question, median s (lower is better)"),
          ("question_total", "all new questions, s (lower is better)"),
          ("first", "first request, a cold read, s"))
TITLE = "New questions on a cached ~1,000-token system prompt (SmolLM2 Q4_1, 2 threads)"
QUESTIONS = ("Which word comes up most?", "Which word is the rarest?",
             "Name three words that appear twice.", "What is the last word?",
             "How many lines are there?", "Is 'copper' in it?",
             "Summarise it in five words.", "Which word comes first?",
             "Count the words that start with 'm'.", "Is the log sorted?")


def system_prompt(tokens: int, seed: str) -> str:
    """About ``tokens`` SmolLM2 tokens of instructions and a log, unlike any other seed's
    from its first words on."""
    rng = random.Random(seed)
    words = " ".join(rng.choice(common.WORDS) for _ in range(tokens - 24))
    return (f"Session {seed}. You answer questions about the log below in one short "
            f"sentence.\nLog: {words}")


async def ask(client: httpx.AsyncClient, url: str, system: str, question: str) -> float:
    started = time.perf_counter()
    response = await client.post(url, json={
        "model": common.MODEL_ID, "max_tokens": 1, "temperature": 0,
        "messages": [{"role": "system", "content": system},
                     {"role": "user", "content": question}]})
    response.raise_for_status()
    return time.perf_counter() - started


async def workload(base: str, args: argparse.Namespace, round_index: int) -> dict:
    url = f"{base}/chat/completions"
    system = system_prompt(args.tokens, f"{round_index}")
    questions = [f"{QUESTIONS[n % len(QUESTIONS)]} (question {n})"
                 for n in range(args.questions)]
    async with httpx.AsyncClient(timeout=600) as client:
        await ask(client, url, system_prompt(64, f"warm-{round_index}"), "Hello?")
        first = await ask(client, url, system, "What is this log?")
        times = [await ask(client, url, system, question) for question in questions]
    return {"question_p50": statistics.median(times), "question_total": sum(times),
            "first": first}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    common.add_common_arguments(parser)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--questions", type=int, default=8)
    parser.add_argument("--parallel", type=int, default=4, help="sessions (slots) per server")
    parser.add_argument("--tokens", type=int, default=1000, help="system prompt tokens")
    parser.add_argument("--slot-context", type=int, default=2048)
    parser.add_argument("--label", default="",
                        help="added to both columns' names in a --replot chart")
    common.add_round_arguments(parser)
    args = parser.parse_args()
    if common.replot(parser, args, FIGURES, PANELS, TITLE, lambda run: run.get("label", "")):
        return 0

    def measure(root: str, side: str, round_index: int) -> dict:
        return asyncio.run(workload(f"{root}/v1", args, round_index))

    results = common.run_rounds(args, measure, parallel=args.parallel,
                                slot_context=args.slot_context)
    if args.only:
        return 0
    title = (f"{args.questions} new questions, one at a time, on a cached ~{args.tokens}-token "
             f"system prompt; {args.threads} threads")
    common.report_rounds(args, results, FIGURES, title, butter_args=args.butter_args,
                         label=args.label)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
