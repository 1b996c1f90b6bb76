"""Aggregate throughput under concurrency: butter vs llama-server, 8 slots each.

Work is cut into blocks: one per concurrency level plus the mixed level. For each
block it starts butter ``--parallel 8``, sends one warm-up request, runs the block
with ``butter serve-bench``'s code and stops it, then does the same with
llama-server ``-np 8`` (never both at once; each has 8 x ``--slot-context`` KV
positions); the side that goes first alternates from block to block, so load that
drifts on a shared machine lands on both sides. The blocks:

* a sweep of synchronized waves at concurrency 1, 2, 4, 8, every request exactly
  ``--max-tokens`` completion tokens: wall-clock and post-TTFT completion tok/s;
* a mixed level: ``--mixed-lanes`` lanes per wave, one of which carries a
  ~``--long-tokens``-token prompt (unique per wave, so it really prefills); it
  compares the TTFT p95 of the short lanes, i.e. how much one long prefill stalls
  everyone else.

Ratios are butter/peer: above 1 is better for tok/s, below 1 is better for TTFT.
With ``--rounds`` > 1 every block runs again and the figures are medians. The JSON
keeps every level with the 1-minute load average seen when it ended.

``--same peer`` (or ``butter``) runs that one server in both columns, in the same
alternating order: an A/A run, whose ratios are what the machine's noise alone does.

    /work/venv/bin/python bench/concurrency.py [--waves 3] [--json out.json]
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
    console,
    log_dir,
    median,
    print_rows,
    running_server,
    save_json,
    serve_bench,
    server_order,
)

# Varied sentences, numbered so the text never repeats verbatim; SmolLM2's tokenizer
# gives about CHARS_PER_TOKEN characters per token on it (checked with /tokenize).
SENTENCES = (
    "The harbour master logged every ship that entered the bay before the fog rolled in.",
    "A committee of seven engineers reviewed the bridge design over three long winters.",
    "Copper wiring in the old mill had corroded where the river damp reached the walls.",
    "Farmers along the valley rotated barley, clover and turnips to rest the soil.",
    "The observatory recorded a faint comet drifting slowly past the constellation Lyra.",
    "Her grandmother kept recipes for plum jam in a tin box beneath the kitchen stairs.",
    "Students measured the pendulum period and compared it with the predicted value.",
    "After the storm, volunteers cleared fallen branches from the railway cutting.",
    "The archive held letters from merchants who traded wool, salt and amber.",
    "Night trains carried mail sacks north, stopping briefly at every junction town.",
    "A quiet violinist practised scales each morning in the empty concert hall.",
    "Surveyors mapped the coastline again after the cliffs collapsed into the sea.",
)
CHARS_PER_TOKEN = 4.3
MIXED = "mixed"


def long_text(tokens: int) -> str:
    parts, length, index = [], 0, 0
    while length < tokens * CHARS_PER_TOKEN:
        part = f"Note {index + 1}: {SENTENCES[index % len(SENTENCES)]}"
        parts.append(part)
        length += len(part) + 1
        index += 1
    return "\n".join(parts)


def bench_config(url: str, args: argparse.Namespace, **overrides) -> serve_bench.BenchConfig:
    settings = {"model": MODEL_ID, "url": url, "max_tokens": args.max_tokens,
                "waves": args.waves} | overrides
    return serve_bench.BenchConfig(**settings)


def block_config(block: str, url: str, args: argparse.Namespace) -> serve_bench.BenchConfig:
    """A sweep level (``"4"``) or the mixed level (``"mixed"``) as a serve-bench config."""
    if block == MIXED:
        return bench_config(url, args, concurrency=(args.mixed_lanes,), long_prompt_lanes=1,
                            long_prompt=long_text(args.long_tokens))
    return bench_config(url, args, concurrency=(int(block),))


async def bench_block(block: str, url: str, args: argparse.Namespace) -> dict:
    """Warm-up, then one block's serve-bench level against a running server."""
    if MODEL_ID not in await serve_bench.resident_models(url):
        raise SystemExit(f"{url} does not serve {MODEL_ID!r}")
    await serve_bench.run_bench(bench_config(url, args, concurrency=(1,), max_tokens=8,
                                             waves=1))
    report = await serve_bench.run_bench(block_config(block, url, args))
    serve_bench.print_report(report, console)
    level = report.to_dict()["levels"][0]
    return level | {"ok": report.ok, "load_average_1m": os.getloadavg()[0]}


def run_block(name: str, block: str, args: argparse.Namespace, logs: Path) -> dict:
    plan = ServerPlan(name=args.same or name, parallel=args.parallel,
                      slot_context=args.slot_context, threads=args.threads,
                      llama_server=args.llama_server, butter_args=args.butter_args)
    with running_server(plan, logs) as url:
        return asyncio.run(bench_block(block, url, args))


def _figure(levels: list[dict], key: str) -> float | None:
    values = [level[key] for level in levels if level[key] is not None]
    return median(values) if values else None


def build_rows(results: dict[str, dict[str, list[dict]]], levels: list[int]) -> list[Row]:
    def row(metric: str, block: str, key: str, *, scale: float = 1.0,
            higher: bool = True) -> Row:
        figures = [_figure(results[name].get(block, []), key) for name in ("butter", "peer")]
        butter, peer = (None if f is None else f * scale for f in figures)
        return Row(metric, butter, peer, higher_is_better=higher)

    rows = []
    for level in levels:
        rows.append(row(f"completion tok/s @{level}", str(level), "completion_tok_s"))
        rows.append(row(f"post-TTFT tok/s @{level}", str(level), "post_ttft_tok_s"))
    rows.append(row("mixed: short TTFT p95 ms", MIXED, "ttft_p95_short", scale=1000,
                    higher=False))
    rows.append(row("mixed: long TTFT p95 ms", MIXED, "ttft_p95_long", scale=1000,
                    higher=False))
    rows.append(row("mixed: completion tok/s", MIXED, "completion_tok_s"))
    return rows


def clean(results: dict[str, dict[str, list[dict]]]) -> bool:
    """No failed request, leaked marker or invalid UTF-8 on either side."""
    return all(level["ok"] for blocks in results.values() for levels in blocks.values()
               for level in levels)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--levels", type=serve_bench.parse_levels, default=[1, 2, 4, 8])
    parser.add_argument("--waves", type=int, default=3, help="synchronized waves per level")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--parallel", type=int, default=8, help="server slots / sessions")
    parser.add_argument("--slot-context", type=int, default=3072, help="tokens per slot")
    parser.add_argument("--mixed-lanes", type=int, default=8, help="lanes in the mixed level")
    parser.add_argument("--long-tokens", type=int, default=2000, help="long prompt size")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--same", choices=("butter", "peer"),
                        help="run this server in both columns (an A/A run: the noise)")
    add_common_arguments(parser)
    args = parser.parse_args()
    logs = log_dir(args)
    blocks = [str(level) for level in args.levels] + [MIXED]
    results: dict[str, dict[str, list[dict]]] = {"butter": {}, "peer": {}}
    step = 0
    for _ in range(args.rounds):
        for block in blocks:
            for name in server_order(args, step):
                results[name].setdefault(block, []).append(run_block(name, block, args, logs))
            step += 1
    rows = build_rows(results, args.levels)
    title = f"concurrency, {args.max_tokens} tokens/request, {args.waves} waves/level"
    if args.same:  # the columns keep their slots in the alternating order
        print_rows(f"{title}, A/A: {args.same} in both columns", rows, "B", "A")
    else:
        print_rows(title, rows)
    if not clean(results):
        console.print("[red]some requests failed, leaked markers or broke UTF-8: see above[/red]")
    save_json(args.json, rows, {"results": results, "args": {
        k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}})
    return 0 if clean(results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
