"""Hostile input, at benchmark size: the bad-input matrix, a hang-up storm and a schema fuzz.

Starts ``butter serve --model smollm2 --parallel 4`` on a free port (alone: no peer,
there is nothing to compare) and runs, against that one server:

* the bad-input matrix, every case of ``bad_input_cases(full=True)`` in
  ``tests/support/hostile.py``
  (every bad value in every field, ~4,400 cases; ``--matrix small`` runs the test
  suite's ~2,000): the answers by status, and the number of 5xx, which must be 0;
* the hang-up storm, ``--storm`` requests (default 1,000) dropped by the client at
  random moments, after a warm-up storm: the gauges afterwards (active, queued, busy
  sessions, reserved KV cells, all of which must be 0) and the server's RSS before
  and after, whose growth must stay under 10 MB;
* with ``--fuzz-seconds`` > 0, a hypothesis fuzz of the published request schemas:
  cases tried and 5xx (must be 0).

The server runs ``--threads 1`` by default: ggml's two-thread pool stalls at every
barrier when anything else runs on a two-core machine. The exit status is 0 only if
every figure is within its bound. ``--json FILE`` saves every number, the server log
goes to ``--log-dir`` (default: a temp dir) and is checked for tracebacks.

    .venv/bin/python bench/hostile.py [--storm 1000] [--fuzz-seconds 300] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from common import MODEL_ID, REPO, console, log_dir, spawned
from rich import box
from rich.progress import Progress
from rich.table import Table

sys.path.insert(0, str(REPO / "tests"))  # the drills are test support, not shipped
from support import hostile  # noqa: E402

RSS_GROWTH_LIMIT_MB = 10.0


@dataclass(frozen=True, slots=True)
class Server:
    root: str
    pid: int
    log: Path


@contextlib.contextmanager
def butter_server(args: argparse.Namespace, logs: Path) -> Iterator[Server]:
    def command(port: int) -> list[str]:
        return [sys.executable, "-m", "butter", "serve", "--model", MODEL_ID, "--port",
                str(port), "--parallel", str(args.parallel), "--threads", str(args.threads)]

    with spawned("butter", command, logs) as (root, process, log):
        yield Server(root, process.pid, log)


def with_progress(label: str, total: int, run):
    """Run ``run(advance)`` under a progress bar of ``total`` steps."""
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task(label, total=total)
        return run(lambda steps: progress.advance(task, steps))


def run_matrix(server: Server, args: argparse.Namespace) -> dict:
    cases = hostile.bad_input_cases(full=args.matrix == "full")
    report = with_progress(f"matrix ({len(cases)} cases)", len(cases), lambda advance: (
        asyncio.run(hostile.run_matrix(server.root, cases, args.concurrency,
                                       progress=advance))))
    for name in ("server_errors", "bad_errors", "not_refused", "broken_streams"):
        for failure in getattr(report, name)[:20]:
            console.print(f"[red]{name}: {failure.case}: {failure.status} {failure.problem}: "
                          f"{failure.excerpt[:160]}[/red]")
    return report.to_dict() | {"clean": report.clean}


def run_storm(server: Server, args: argparse.Namespace) -> dict:
    seed = args.seed if args.seed is not None else random.randrange(1 << 30)
    with_progress("warm-up storm", args.warm_up, lambda advance: asyncio.run(
        hostile.hangup_storm(server.root, args.warm_up, args.storm_concurrency, seed=-seed,
                             progress=advance)))
    before = hostile.server_rss(server.pid)
    report = with_progress(f"storm ({args.storm} hang-ups)", args.storm, lambda advance: (
        asyncio.run(hostile.hangup_storm(server.root, args.storm, args.storm_concurrency,
                                         seed=seed, progress=advance))))
    after = hostile.server_rss(server.pid)
    for error in report.server_errors[:20]:
        console.print(f"[red]storm: {error}[/red]")
    growth = (after - before) / 2**20
    return report.to_dict() | {
        "seed": seed, "rss_before_mb": before / 2**20, "rss_after_mb": after / 2**20,
        "rss_growth_mb": growth,
        "clean": report.idle and not report.server_errors and report.failed_requests == 0
        and growth < RSS_GROWTH_LIMIT_MB}


def run_fuzz(server: Server, args: argparse.Namespace) -> dict:
    console.print(f"[dim]fuzzing for up to {args.fuzz_seconds:.0f} s[/dim]")
    report = hostile.fuzz(server.root, max_examples=args.fuzz_examples,
                          seconds=args.fuzz_seconds, seed=args.seed)
    for error in report.server_errors[:20]:
        console.print(f"[red]fuzz: {json.dumps(error)[:400]}[/red]")
    return report.to_dict() | {"clean": not report.server_errors}


def print_results(results: dict) -> None:
    table = Table(title="butter under hostile input", box=box.SIMPLE_HEAD)
    table.add_column("drill")
    table.add_column("figure")
    table.add_column("value", justify="right")
    table.add_column("bound", justify="right")
    if matrix := results.get("matrix"):
        table.add_row("matrix", "cases", str(matrix["cases"]), ">= 900")
        table.add_row("", "answers by status", json.dumps(matrix["by_status"]), "")
        table.add_row("", "5xx", str(matrix["five_xx"]), "0")
        table.add_row("", "bad error bodies / not refused / broken streams",
                      f"{len(matrix['bad_errors'])} / {len(matrix['not_refused'])} / "
                      f"{len(matrix['broken_streams'])}", "0 / 0 / 0")
        table.add_row("", "seconds", f"{matrix['seconds']:.0f}", "")
    if storm := results.get("storm"):
        table.add_row("storm", "hang-ups", str(storm["hang_ups"]), ">= 1000")
        for name, value in storm["gauges"].items():
            table.add_row("", f"{name} after", f"{value:g}", "0")
        table.add_row("", "cancelled queued / prefill / decode",
                      " / ".join(f"{storm['cancellations'][p]:g}"
                                 for p in ("queued", "prefill", "decode")), "")
        table.add_row("", "errors seen by clients", str(len(storm["server_errors"])), "0")
        table.add_row("", "RSS before / after MB",
                      f"{storm['rss_before_mb']:.1f} / {storm['rss_after_mb']:.1f}", "")
        table.add_row("", "RSS growth MB", f"{storm['rss_growth_mb']:.1f}",
                      f"< {RSS_GROWTH_LIMIT_MB:.0f}")
        table.add_row("", "seconds", f"{storm['seconds']:.0f}", "")
    if fuzz := results.get("fuzz"):
        table.add_row("fuzz", "cases tried", str(fuzz["tried"]), "")
        table.add_row("", "answers by class", json.dumps(fuzz["by_class"]), "")
        table.add_row("", "5xx", str(fuzz["five_xx"]), "0")
    if "server" in results:
        table.add_row("server", "healthy afterwards", str(results["server"]["healthy"]), "True")
        table.add_row("", "tracebacks in the log", str(results["server"]["tracebacks"]), "0")
    console.print(table)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--matrix", choices=("full", "small", "off"), default="full",
                        help="every bad value in every field, the test suite's set, or none")
    parser.add_argument("--concurrency", type=int, default=4, help="matrix requests at once")
    parser.add_argument("--storm", type=int, default=1000, help="hang-ups (0: no storm)")
    parser.add_argument("--storm-concurrency", type=int, default=12,
                        help="storm clients at once (above --parallel, so some queue)")
    parser.add_argument("--warm-up", type=int, default=60,
                        help="hang-ups before the RSS baseline")
    parser.add_argument("--fuzz-seconds", type=float, default=0.0,
                        help="time for the schema fuzz (0: no fuzz)")
    parser.add_argument("--fuzz-examples", type=int, default=100_000,
                        help="at most this many fuzz cases")
    parser.add_argument("--seed", type=int, help="storm and fuzz seed (default: random)")
    parser.add_argument("--parallel", type=int, default=4, help="server sessions")
    parser.add_argument("--threads", type=int, default=1, help="server CPU threads")
    parser.add_argument("--log-dir", type=Path, help="server log (default: a temp dir)")
    parser.add_argument("--json", type=Path, metavar="FILE", help="save the results here")
    args = parser.parse_args()
    results: dict = {"args": {k: str(v) if isinstance(v, Path) else v
                              for k, v in vars(args).items()}}
    start = time.monotonic()
    with butter_server(args, log_dir(args)) as server:
        if args.matrix != "off":
            results["matrix"] = run_matrix(server, args)
        if args.storm > 0:
            results["storm"] = run_storm(server, args)
        if args.fuzz_seconds > 0:
            results["fuzz"] = run_fuzz(server, args)
        log = server.log.read_text(errors="replace")
        results["server"] = {"healthy": hostile.health_ok(server.root),
                             "tracebacks": log.count("Traceback"), "log": str(server.log)}
    results["seconds"] = time.monotonic() - start
    print_results(results)
    clean = (all(results[drill]["clean"] for drill in ("matrix", "storm", "fuzz")
                 if drill in results)
             and results["server"]["healthy"] and not results["server"]["tracebacks"])
    if not clean:
        console.print(f"[red]hostile input got through: see above and {server.log}[/red]")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2, default=str) + "\n")
        console.print(f"[dim]saved {args.json}[/dim]")
    return 0 if clean else 1


if __name__ == "__main__":
    raise SystemExit(main())
