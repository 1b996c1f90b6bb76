"""Aggregate throughput under concurrency: butter vs llama-server, 8 slots each.

For each server in turn (never both at once) it starts butter ``--parallel 8`` or
llama-server ``-np 8`` (each slot ``--slot-context`` tokens), sends one warm-up
request, then runs ``butter serve-bench``'s code against it:

* a sweep of synchronized waves at concurrency 1, 2, 4, 8, every request exactly
  ``--max-tokens`` completion tokens: wall-clock and post-TTFT completion tok/s;
* a mixed level: ``--mixed-lanes`` lanes per wave, one of which carries a
  ~``--long-tokens``-token prompt (unique per wave, so it really prefills); it
  compares the TTFT p95 of the short lanes, i.e. how much one long prefill stalls
  everyone else.

Ratios are butter/peer: above 1 is better for tok/s, below 1 is better for TTFT.
With ``--rounds`` > 1 the servers alternate (AB, BA, ...) and figures are medians.

    /work/venv/bin/python bench/concurrency.py [--waves 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path

from common import (MODEL_ID, Row, ServerPlan, add_common_arguments, console, log_dir,
                    median, print_rows, running_server, save_json, serve_bench,
                    server_order)

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
                "waves": args.waves, "concurrency": tuple(args.levels)} | overrides
    return serve_bench.BenchConfig(**settings)


async def bench_server(url: str, args: argparse.Namespace) -> dict:
    """Warm-up, the sweep and the mixed level against one running server."""
    if MODEL_ID not in await serve_bench.resident_models(url):
        raise SystemExit(f"{url} does not serve {MODEL_ID!r}")
    await serve_bench.run_bench(bench_config(url, args, concurrency=(1,), max_tokens=8,
                                             waves=1))
    sweep = await serve_bench.run_bench(bench_config(url, args))
    mixed = await serve_bench.run_bench(bench_config(
        url, args, concurrency=(args.mixed_lanes,), long_prompt=long_text(args.long_tokens),
        long_prompt_lanes=1))
    for report in (sweep, mixed):
        serve_bench.print_report(report, console)
    return {"sweep": sweep.to_dict(), "mixed": mixed.to_dict()}


def run_side(name: str, args: argparse.Namespace, logs: Path) -> dict:
    plan = ServerPlan(name=name, parallel=args.parallel, slot_context=args.slot_context,
                      threads=args.threads, llama_server=args.llama_server)
    with running_server(plan, logs) as url:
        return asyncio.run(bench_server(url, args))


def _figure(runs: list[dict], part: str, key: str, level: int | None = None) -> float | None:
    values = []
    for run in runs:
        for summary in run[part]["levels"]:
            if (level is None or summary["concurrency"] == level) and summary[key] is not None:
                values.append(summary[key])
    return median(values) if values else None


def build_rows(results: dict[str, list[dict]], levels: list[int]) -> list[Row]:
    def row(metric: str, part: str, key: str, level: int | None = None, *,
            scale: float = 1.0, higher: bool = True) -> Row:
        butter, peer = (_figure(results[name], part, key, level) for name in ("butter", "peer"))
        return Row(metric, None if butter is None else butter * scale,
                   None if peer is None else peer * scale, higher_is_better=higher)

    rows = []
    for level in levels:
        rows.append(row(f"completion tok/s @{level}", "sweep", "completion_tok_s", level))
        rows.append(row(f"post-TTFT tok/s @{level}", "sweep", "post_ttft_tok_s", level))
    rows.append(row("mixed: short TTFT p95 ms", "mixed", "ttft_p95_short", scale=1000,
                    higher=False))
    rows.append(row("mixed: long TTFT p95 ms", "mixed", "ttft_p95_long", scale=1000,
                    higher=False))
    rows.append(row("mixed: completion tok/s", "mixed", "completion_tok_s"))
    return rows


def clean(results: dict[str, list[dict]]) -> bool:
    """No failed request, leaked marker or invalid UTF-8 on either side."""
    return all(run[part]["ok"] for runs in results.values() for run in runs
               for part in ("sweep", "mixed"))


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
    add_common_arguments(parser)
    args = parser.parse_args()
    logs = log_dir(args)
    results: dict[str, list[dict]] = {"butter": [], "peer": []}
    for round_index in range(args.rounds):
        for name in server_order(args, round_index):
            results[name].append(run_side(name, args, logs))
    rows = build_rows(results, args.levels)
    print_rows(f"concurrency, {args.max_tokens} tokens/request, {args.waves} waves/level", rows)
    if not clean(results):
        console.print("[red]some requests failed, leaked markers or broke UTF-8: see above[/red]")
    save_json(args.json, rows, {"results": results, "args": {
        k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}})
    return 0 if clean(results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
