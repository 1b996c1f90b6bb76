"""How often does a request's answer change when it runs fused with seven others?

For each server (butter ``--parallel 8``, then llama-server ``-np 8``) this sends a set
of prompts, short (~40 tokens) and long (~300-700 tokens: once a lone row attends over
512+ KV cells, ggml's CPU flash
attention splits its keys across threads; a llama-server slot gets there past 256
tokens, butter's shared cache counts every session's cells):

1. each prompt alone, one after another;
2. all of them at once (one fused pass per step);
3. each prompt alone again.

Every request is greedy (temperature 0) or seeded (temperature 0.8, fixed seed), with
``ignore_eos`` and ``--max-tokens`` tokens. Before the first round the cache is
fragmented with a burst of mixed requests, as a server that has been in use is. It
reports how many answers were identical alone vs fused and alone vs alone again, and
where the first differing character was. Neither server is expected to be bitwise
batch-invariant on ggml's CPU kernels (see bench/README.md, "batch invariance").

    /work/venv/bin/python bench/batch_invariance.py [--rounds 2] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio

import httpx
from common import (
    MODEL_ID,
    ServerPlan,
    add_common_arguments,
    console,
    log_dir,
    running_server,
    save_json,
    server_order,
)
from concurrency import long_text

SHORT = ("Describe a lighthouse keeper's morning.", "Explain how bread rises.",
         "Write about a fox crossing a frozen river.", "Tell me about the first railway.")
LONG_TOKENS = (300, 450, 600, 700)
MODES = {"greedy": {"temperature": 0.0}, "seeded": {"temperature": 0.8, "seed": 1234}}


def prompts(round_index: int) -> list[str]:
    short = [f"{text} (Round {round_index}.)" for text in SHORT]
    long = [f"Round {round_index}, part {n}.\n{long_text(tokens)}\nSummarise these notes."
            for n, tokens in enumerate(LONG_TOKENS)]
    return short + long


async def complete(client: httpx.AsyncClient, url: str, prompt: str, max_tokens: int,
                   sampling: dict) -> str:
    body = {"model": MODEL_ID, "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens, "ignore_eos": True, **sampling}
    response = await client.post(f"{url}/chat/completions", json=body)
    response.raise_for_status()
    return response.json()["choices"][0]["message"]["content"]


async def fragment(client: httpx.AsyncClient, url: str) -> None:
    """Mixed lengths, eight at a time: caches of every size come and go."""
    jobs = [complete(client, url, f"Note {n}. {long_text(40 + 37 * n)}", 8 + 5 * n,
                     {"temperature": 0.8}) for n in range(16)]
    for start in range(0, len(jobs), 8):
        await asyncio.gather(*jobs[start:start + 8])


def first_difference(a: str, b: str) -> int | None:
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


async def probe(url: str, args: argparse.Namespace) -> dict:
    async with httpx.AsyncClient(timeout=600) as client:
        await fragment(client, url)
        results: dict[str, list[dict]] = {mode: [] for mode in MODES}
        for round_index in range(args.rounds):
            texts = prompts(round_index)
            for mode, sampling in MODES.items():
                def ask(p, sampling=sampling):
                    return complete(client, url, p, args.max_tokens, sampling)

                alone = [await ask(p) for p in texts]
                fused = await asyncio.gather(*(ask(p) for p in texts))
                again = [await ask(p) for p in texts]
                for index in range(len(texts)):
                    results[mode].append({
                        "prompt": "long" if index >= len(SHORT) else "short",
                        "fused_diff_at": first_difference(alone[index], fused[index]),
                        "again_diff_at": first_difference(alone[index], again[index]),
                    })
        return results


def summarise(name: str, results: dict) -> dict:
    summary = {}
    for mode, rows in results.items():
        for kind in ("short", "long"):
            picked = [r for r in rows if r["prompt"] == kind]
            fused = sum(r["fused_diff_at"] is None for r in picked)
            again = sum(r["again_diff_at"] is None for r in picked)
            diffs = [r["fused_diff_at"] for r in picked if r["fused_diff_at"] is not None]
            summary[f"{mode} {kind}"] = {"n": len(picked), "fused_equal": fused,
                                         "again_equal": again, "first_diff_chars": diffs}
            console.print(f"{name:13s} {mode:6s} {kind:5s}: alone = fused {fused}/{len(picked)}, "
                          f"alone = alone again {again}/{len(picked)}, "
                          f"first difference at chars {diffs}")
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_arguments(parser)
    parser.add_argument("--rounds", type=int, default=2, help="prompt sets per server")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--parallel", type=int, default=8)
    parser.add_argument("--slot-context", type=int, default=2048)
    args = parser.parse_args()
    logs = log_dir(args)
    summaries = {}
    for name in server_order(args, 0):
        plan = ServerPlan(name=name, parallel=args.parallel, slot_context=args.slot_context,
                          threads=args.threads, llama_server=args.llama_server,
                          butter_args=args.butter_args)
        with running_server(plan, logs) as url:
            summaries[name] = summarise(name, asyncio.run(probe(url, args)))
    save_json(args.json, [], {"summaries": summaries, "args": vars(args) | {
        "json": str(args.json), "log_dir": str(args.log_dir),
        "llama_server": str(args.llama_server)}})


if __name__ == "__main__":
    main()
