"""Speculation: butter's prompt lookup on and off against llama-server's --spec-type.

Each setting is a server started alone (the machine has two cores), asked every workload
of ``bench/data/speculation.json`` (quote, edit, tool, plain) at each lane count: the
lanes send their request together, greedy, streamed. The settings run in one pass in the
order given, butter's default first and again last (``--aa``): the two butter-on rows are
an A/A pair whose spread is the noise of the run.

Reported per workload, setting and lanes: completion tokens/s (every lane's tokens over
the wave's wall time), TTFT p50, and where the server says so, drafted and accepted
tokens, the acceptance rate and the tokens each verify produced (butter: /metrics;
llama-server: the ``timings`` of its streams), and the rate after TTFT: every lane's tokens
but its first over the wall time less the TTFT p50, the decode-only figure llama-server
reports as ``predicted_per_second``. ``--plot DIR`` draws one chart per workload
(``butter.bench.plot``): tokens/s and TTFT against lanes, one line per setting.

``--rounds N`` runs the whole list of settings N times, in reverse order every other
round (so load that drifts lands on both sides), and reports each figure as its median
over the rounds, then the ratios that the issue's targets name, each the median of its
per-round ratios: butter on/off, butter on/llama-server default, the A/A pair, and
butter on (and its A/A copy) against each llama-server ``--spec-type`` run.

``--interleave`` starts every setting's server at once (an idle one waits, taking no
CPU) and runs each row (workload, lane count) on each server in turn, in the round's
order: a row is seconds to a minute, so drift in the machine's speed, which a server's
block of rows takes minutes to show, lands on every setting alike. The servers then live
through every round, so each round numbers its repeats on from the last ("(4) " and on
in the second round of four repeats): llama-server keeps the prompts it has read in host
memory (``--cache-ram``, 8 GiB by default) and would answer a round's prompt from the
read of an earlier round.

``--repeats N`` runs each workload and lane count N times in a row on the same server
and reports them as one row (tokens over the summed wall time, TTFT p50 over every
request): a one-lane quote is a single request of about a second, so one wave is mostly
noise. Every repeat after the first starts its user message with its number, "(2) ",
so that neither server answers it from the prompt it read for an earlier one.

    .venv/bin/python bench/speculation.py --plot bench/results --json bench/results/spec.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path

import common
import httpx
from rich import box
from rich.table import Table

from butter.bench.plot import Point, plot
from butter.library import default_plugins
from butter_backend_gguf.kvtypes import cache_types

DATA = common.REPO / "bench" / "data" / "speculation.json"
LLAMA_SPEC_TYPES = ("ngram-simple", "ngram-cache", "ngram-map-k", "ngram-mod")


def peer_cache_flags(codec_name: str) -> list[str]:
    """llama-server's flags for the cache types the GGUF back end stores ``codec_name``
    in (its ``kvtypes`` mapping); a usage error for a codec llama.cpp cannot store."""
    try:
        types = cache_types(default_plugins().kv_codec(codec_name))
    except ValueError as exc:
        raise SystemExit(f"--kv-cache: {exc}") from None
    if types is None:
        raise SystemExit(f"--kv-cache {codec_name}: llama.cpp has no cache type for it")
    if not types.quantized:
        return []
    return ["--cache-type-k", types.key, "--cache-type-v", types.value, "--flash-attn", "on"]


def settings(args: argparse.Namespace) -> list[tuple[str, str, list[str]]]:
    """(label, server, extra flags) in run order; both servers on the same cache types."""
    ours = ["--kv-cache", args.kv_cache] if args.kv_cache != "raw" else []
    theirs = peer_cache_flags(args.kv_cache)
    runs = [("butter spec on", "butter", ours),
            ("butter spec off", "butter", ours + ["--speculation", "none"]),
            ("llama-server default", "peer", theirs)]
    runs += [(f"llama-server {kind}", "peer", theirs + ["--spec-type", kind])
             for kind in args.spec_types]
    if args.aa:
        runs.append(("butter spec on (A/A)", "butter", ours))
    return runs


def workload_messages(workload: str, lane: int, data: dict, repeat: int = 0) -> list[dict]:
    """The lane's messages; a repeat after the first starts its user message with its
    number, so that no server answers it from the cached read of an earlier one."""
    messages = data["workloads"][workload]
    if workload == "plain":  # each lane its own question
        messages = messages[lane % len(messages)]
    if not repeat:
        return messages
    first = next(i for i, m in enumerate(messages) if m["role"] == "user")
    tagged = {**messages[first], "content": f"({repeat}) {messages[first]['content']}"}
    return [*messages[:first], tagged, *messages[first + 1:]]


async def wave(url: str, workload: str, lanes: int, data: dict, max_tokens: int,
               repeat: int = 0) -> dict:
    limits = httpx.Limits(max_connections=lanes + 1)
    async with httpx.AsyncClient(timeout=900, limits=limits) as client:
        bodies = [{"model": common.MODEL_ID,
                   "messages": workload_messages(workload, lane, data, repeat),
                   "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
                   "stream_options": {"include_usage": True}} for lane in range(lanes)]
        started = time.perf_counter()
        results = await asyncio.gather(
            *(common.stream_chat(client, f"{url}/chat/completions", body) for body in bodies))
        wall = time.perf_counter() - started
    return {"lanes": lanes, "tokens": sum((r.usage or {}).get("completion_tokens", 0)
                                          for r in results),
            "wall_s": wall, "ttfts": [r.ttft for r in results if r.ttft is not None],
            "peer_drafted": sum(r.timings.get("draft_n", 0) for r in results),
            "peer_accepted": sum(r.timings.get("draft_n_accepted", 0) for r in results)}


async def waves(url: str, workload: str, lanes: int, data: dict, max_tokens: int,
                repeats: int, first: int = 0) -> dict:
    """``repeats`` waves one after another (``--repeats``), as one row: tokens over the
    waves' summed wall time, TTFT p50 over every request. Their prompts are numbered
    from ``first``."""
    done = [await wave(url, workload, lanes, data, max_tokens, repeat)
            for repeat in range(first, first + repeats)]
    tokens, wall = sum(w["tokens"] for w in done), sum(w["wall_s"] for w in done)
    ttft = common.median([t for w in done for t in w["ttfts"]])
    # The rate after the first token (what llama-server's timings call predicted tokens
    # per second): every lane's tokens but its first over the wall time after TTFT p50.
    after = wall - repeats * ttft if ttft is not None else 0.0
    decode = (tokens - lanes * repeats) / after if after > 0 else None
    return {"lanes": lanes, "tokens": tokens, "wall_s": wall, "tok_s": tokens / wall,
            "decode_tok_s": decode, "ttft_p50": ttft, "repeats": repeats,
            "peer_drafted": sum(w["peer_drafted"] for w in done),
            "peer_accepted": sum(w["peer_accepted"] for w in done)}


COUNTERS = ("butter_speculative_verifies_total", "butter_speculative_drafted_tokens_total",
            "butter_speculative_accepted_tokens_total", "butter_model_passes_total")


def butter_counters(root: str) -> dict[str, float]:
    return common.butter_counters(root, COUNTERS)


@contextlib.contextmanager
def started(label: str, server: str, flags: list[str], args: argparse.Namespace,
            data: dict, logs: Path) -> Iterator[str]:
    """The setting's server, started and warmed up: yields its root URL."""
    plan = common.ServerPlan(name=server, parallel=max(args.lanes), slot_context=2048,
                             threads=args.threads, llama_server=args.llama_server)

    def command(port: int) -> list[str]:
        return plan.command(port) + flags

    name = "".join(c if c.isalnum() else "-" for c in label)  # a log file's name
    with common.spawned(name, command, logs) as (root, _, _):
        asyncio.run(wave(f"{root}/v1", "plain", 1, data, 8))  # warm-up: first-pass costs
        yield root


def measure_row(label: str, server: str, root: str, workload: str, lanes: int,
                args: argparse.Namespace, data: dict, round_index: int = 0) -> dict:
    """One row: ``--repeats`` waves of ``workload`` at ``lanes`` on a running server,
    their prompts numbered on from the rounds before ``round_index``."""
    before = butter_counters(root) if server == "butter" else {}
    row = asyncio.run(waves(f"{root}/v1", workload, lanes, data, args.max_tokens,
                            args.repeats, round_index * args.repeats))
    if server == "butter":
        after = butter_counters(root)
        delta = {k: after.get(k, 0) - before.get(k, 0) for k in after}
        row["drafted"] = delta.get("butter_speculative_drafted_tokens_total", 0)
        row["accepted"] = delta.get("butter_speculative_accepted_tokens_total", 0)
        row["verifies"] = delta.get("butter_speculative_verifies_total", 0)
    else:
        row["drafted"], row["accepted"] = row["peer_drafted"], row["peer_accepted"]
        row["verifies"] = None
    row.update(setting=label, workload=workload, load=round(os.getloadavg()[0], 2))
    common.console.print(
        f"{label:28} {workload:6} {lanes} lanes: {row['tok_s']:7.1f} tok/s, "
        f"TTFT p50 {1000 * (row['ttft_p50'] or 0):7.0f} ms, "
        f"drafted {row['drafted']:.0f} accepted {row['accepted']:.0f} "
        f"(load {row['load']})")
    return row


def run_setting(label: str, server: str, flags: list[str], args: argparse.Namespace,
                data: dict, logs: Path) -> list[dict]:
    with started(label, server, flags, args, data, logs) as root:
        return [measure_row(label, server, root, workload, lanes, args, data)
                for workload in args.workloads for lanes in args.lanes]


def table(rows: list[dict], workload: str) -> Table:
    out = Table(title=f"{workload}: greedy, tokens/s and TTFT by lanes", box=box.SIMPLE_HEAD)
    for column in ("setting", "lanes", "tok/s", "after TTFT", "TTFT p50 ms", "accept",
                   "tok/verify"):
        out.add_column(column, justify="left" if column == "setting" else "right")
    for row in rows:
        if row["workload"] != workload:
            continue
        rate = row["accepted"] / row["drafted"] if row["drafted"] else None
        per = (row["accepted"] + row["verifies"]) / row["verifies"] \
            if row.get("verifies") else None
        decode = row.get("decode_tok_s")
        out.add_row(row["setting"], str(row["lanes"]), f"{row['tok_s']:.1f}",
                    "-" if decode is None else f"{decode:.1f}",
                    f"{1000 * (row['ttft_p50'] or 0):.0f}",
                    "-" if rate is None else f"{rate:.2f}",
                    "-" if per is None else f"{per:.2f}")
    return out


# (label, numerator setting, denominator setting) of the ratios --rounds reports.
RATIOS = (("on / off", "butter spec on", "butter spec off"),
          ("on / llama-server default", "butter spec on", "llama-server default"),
          ("A/A: on / on again", "butter spec on", "butter spec on (A/A)"))
MEDIAN_FIELDS = ("tokens", "wall_s", "tok_s", "decode_tok_s", "ttft_p50", "drafted",
                 "accepted", "verifies")


def medians(rows: list[dict]) -> list[dict]:
    """One row per workload, setting and lanes: each figure's median over the rounds."""
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        groups.setdefault((row["workload"], row["setting"], row["lanes"]), []).append(row)
    merged = []
    for group in groups.values():
        row = dict(group[0])
        for field in MEDIAN_FIELDS:
            values = [r[field] for r in group if r.get(field) is not None]
            row[field] = common.median(values) if values else None
        row["rounds"] = len(group)
        merged.append(row)
    return merged


def ratio_table(rows: list[dict], workload: str) -> Table:
    """Tokens/s ratios, each the median of its per-round ratios, with every round's."""
    by = {(r["setting"], r["lanes"], r.get("round", 0)): r["tok_s"] for r in rows
          if r["workload"] == workload}
    lanes = sorted({lanes for _, lanes, _ in by})
    rounds = sorted({round_ for _, _, round_ in by})
    out = Table(title=f"{workload}: tok/s ratios, median of per-round ratios",
                box=box.SIMPLE_HEAD)
    for column in ("ratio", "lanes", "median", "rounds"):
        out.add_column(column, justify="left" if column in ("ratio", "rounds") else "right")
    peers = sorted({setting for setting, _, _ in by if setting.startswith("llama-server ")}
                   - {"llama-server default"})
    named = [*RATIOS, *((f"on / {peer}", "butter spec on", peer) for peer in peers),
             *((f"A/A copy / {peer}", "butter spec on (A/A)", peer) for peer in peers)]
    for name, top, bottom in named:
        for n in lanes:
            per = [by[top, n, r] / by[bottom, n, r] for r in rounds
                   if (top, n, r) in by and by.get((bottom, n, r))]
            if per:
                out.add_row(name, str(n), f"{common.median(per):.3f}",
                            " ".join(f"{x:.2f}" for x in per))
    return out


def measure(args: argparse.Namespace) -> list[dict]:
    """Every setting in turn (``--rounds`` times, every other round in reverse order);
    with ``--interleave`` every setting's server at once, each row of a round on each
    server in turn. With ``--json`` the rows are saved as they come."""
    data = json.loads(DATA.read_text())
    logs = common.log_dir(args)
    rows: list[dict] = []
    chosen = [(label, server, flags) for label, server, flags in settings(args)
              if not (args.only and server != args.only
                      or args.settings and label not in args.settings)]
    if args.interleave:
        with contextlib.ExitStack() as stack:
            roots = {label: stack.enter_context(started(label, server, flags, args, data,
                                                        logs))
                     for label, server, flags in chosen}
            for round_index, workload, lanes in itertools.product(
                    range(args.rounds), args.workloads, args.lanes):
                order = chosen if round_index % 2 == 0 else chosen[::-1]
                for label, server, _ in order:
                    row = measure_row(label, server, roots[label], workload, lanes, args,
                                      data, round_index)
                    rows.append({**row, "round": round_index})
                    _save(args, rows)
        return rows
    for round_index in range(args.rounds):
        order = chosen if round_index % 2 == 0 else chosen[::-1]
        for label, server, flags in order:
            ran = run_setting(label, server, flags, args, data, logs)
            if args.rounds > 1:
                for row in ran:
                    row["round"] = round_index
            rows += ran
            _save(args, rows)
    return rows


def _save(args: argparse.Namespace, rows: list[dict]) -> None:
    if args.json:  # after each setting: a late failure keeps what ran
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"max_tokens": args.max_tokens,
                                         "kv_cache": args.kv_cache, "rows": rows},
                                        indent=1) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--llama-server", type=Path, default=common.default_llama_server())
    parser.add_argument("--lanes", type=lambda t: [int(x) for x in t.split(",")],
                        default=[1, 4, 8])
    parser.add_argument("--workloads", type=lambda t: t.split(","),
                        default=["quote", "edit", "tool", "plain"])
    parser.add_argument("--spec-types", type=lambda t: [x for x in t.split(",") if x],
                        default=list(LLAMA_SPEC_TYPES),
                        help="llama-server --spec-type values to run (comma-separated)")
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--kv-cache", default="raw",
                        help="butter's --kv-cache (raw, affine8, affine4, an auraNvM recipe); "
                             "llama-server gets the cache types butter stores it in")
    parser.add_argument("--aa", action=argparse.BooleanOptionalAction, default=True,
                        help="run butter's default again last (the A/A pair)")
    parser.add_argument("--only", choices=("butter", "peer"), help="one server's settings")
    parser.add_argument("--settings", type=lambda t: t.split(","), default=None,
                        help="run only these settings (labels, comma-separated)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="run every setting this many times (alternating order); "
                             "report medians")
    parser.add_argument("--interleave", action="store_true",
                        help="start every setting's server at once and run each row "
                             "(workload, lanes) on each in turn, so drift in the machine's "
                             "speed lands on every setting alike; idle servers wait")
    parser.add_argument("--repeats", type=int, default=1,
                        help="waves per workload and lane count, one after another, each "
                             "with its own prompt (a short one-lane wave is mostly noise)")
    parser.add_argument("--log-dir", type=Path)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--plot", type=Path, metavar="DIR", help="charts, one per workload")
    parser.add_argument("--replot", type=Path, metavar="JSON",
                        help="run nothing: print and draw the rows a --json run saved")
    args = parser.parse_args()
    if args.replot:
        saved = json.loads(args.replot.read_text())
        rows = saved["rows"]
        args.max_tokens = saved["max_tokens"]
        args.kv_cache = saved.get("kv_cache", "raw")
        args.workloads = list(dict.fromkeys(row["workload"] for row in rows))
    else:
        rows = measure(args)
    rounds = max((row.get("round", 0) for row in rows), default=0) + 1
    if rounds > 1:
        for workload in args.workloads:
            common.console.print(ratio_table(rows, workload))
        rows = medians(rows)
    for workload in args.workloads:
        common.console.print(table(rows, workload))
        if args.plot:
            series: dict[str, list[Point]] = {}
            for row in rows:
                if row["workload"] == workload:
                    series.setdefault(row["setting"], []).append(
                        Point(row["lanes"], row["tok_s"], row["ttft_p50"]))
            path = plot(series, args.plot / f"speculation-{workload}.png",
                        title=f"{workload} workload, SmolLM2 Q4_1, greedy, "
                              f"{args.max_tokens} tokens at most, {args.threads} threads"
                              + ("" if args.kv_cache == "raw" else f", KV {args.kv_cache}"))
            common.console.print(f"[dim]chart: {path}[/dim]")


if __name__ == "__main__":
    main()
