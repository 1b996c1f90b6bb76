"""Scale-out on Ray Serve: does prefix-affinity routing keep the cache working?

The workload: eight tenants, each with its own ~1,000-token system prompt, picked with a
Zipf skew (s = 1.1), multi-turn (each tenant's conversation grows by its question and
the answer), 64 tokens out (``ignore_eos``), ``--concurrency`` requests in flight.
The same request sequence (seeded) runs against:

1. ``single``: one ``butter serve`` process, ``--threads 2 --parallel 8`` (and
   ``--max-context 16384``: 2,048 cells per session, as each replica's four get);
2. ``affinity``: ``butter serve --replicas 2 --threads 1 --parallel 4`` (prefix router;
   each replica's context is SmolLM2's trained 8,192: 2,048 cells per session);
3. ``pow2``: the same under ``--ray-router pow2`` (Serve's power-of-two choices);
4. ``sglang``: SGLang's gateway (``smg launch --policy cache_aware``, from the
   ``sglang-router`` package: ``pip install --group bench``) in front of two plain
   ``butter serve --threads 1 --parallel 4 --max-context 8192`` processes;
5. ``overhead``: ``ray1`` (one replica) against ``single1`` (one process), one thread
   each, plus ``single1'``, a second such process: all three up at once, the same short
   request to each in turn (the order rotating), ``--pairs`` times. The TTFT Ray adds is
   the paired median of ray1 - single1; single1' - single1 is its A/A: the noise alone.

``--same affinity`` (any setups, comma-separated) runs that setup again at the end of the
run, as ``affinity'``, and reports the second run's figures over the first's: how far
the machine's noise alone moves each figure (an A/A run).

Reported per setup: aggregate completion tokens/s, the prefix-hit rate (cached / prompt
tokens, from each answer's usage) and its ratio to the single process's, TTFT p50/p99
(client side, to the first content chunk), and the spread of requests over the replicas
(from ``/metrics``: the cluster's per-replica counters, or each plain process's own).

    .venv/bin/python bench/scale_out.py [--requests 48] [--concurrency 4] [--only SETUPS]
        [--same affinity,sglang] [--pairs 22] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import common
import httpx

TENANTS = 8
REQUEST_TIMEOUT = 240.0  # seconds; a request past it counts as failed, the run goes on


def system_prompt(tenant: int) -> str:
    """About 1,000 SmolLM2 tokens of text nobody else shares."""
    rng, words = random.Random(tenant), common.WORDS
    rules = [f"Rule {tenant}.{i}: the {rng.choice(words)} of house {tenant} meets the "
             f"{rng.choice(words)} on day {rng.randrange(1, 365)} at hour {rng.randrange(24)}."
             for i in range(52)]
    return f"You are the archivist of house {tenant}. " + " ".join(rules)


def zipf_tenants(count: int, seed: int, s: float = 1.1) -> list[int]:
    rng = random.Random(seed)
    weights = [1 / (rank + 1) ** s for rank in range(TENANTS)]
    return rng.choices(range(TENANTS), weights=weights, k=count)


@contextlib.contextmanager
def started(command: list[str], log: Path, ready: Callable[[], bool]) -> Iterator[None]:
    """Run ``command`` until the block ends, once ``ready()`` says it serves; SIGINT then
    (butter stops its Ray cluster on it), SIGKILL if it lingers past 90 s."""
    with open(log, "wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT,
                                   stdin=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 300
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"{command} exited; see {log}")
            with contextlib.suppress(httpx.HTTPError):
                if ready():
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(f"{command} never became ready; see {log}")
            time.sleep(0.5)
        yield
    finally:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(90)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@contextlib.contextmanager
def server(*flags: str, log: Path) -> Iterator[str]:
    """``butter serve`` with ``flags`` on a free port; yields its root URL once healthy."""
    root = f"http://127.0.0.1:{common.free_port()}"
    command = [sys.executable, "-m", "butter", "serve", "--model", common.MODEL_ID,
               "--port", root.rsplit(":", 1)[1], *flags]
    with started(command, log, lambda: httpx.get(f"{root}/health", timeout=2).is_success):
        yield root


def smg_command(port: int, workers: list[str]) -> list[str]:
    """SGLang's gateway (``sglang-router``'s ``smg``) with its cache_aware policy at its
    defaults, on loopback only (its own and its Prometheus port default to 0.0.0.0)."""
    smg = Path(sys.executable).parent / "smg"
    if not smg.exists():
        raise SystemExit(f"{smg} is missing: pip install --group bench (sglang-router)")
    return [str(smg), "launch", "--host", "127.0.0.1", "--port", str(port),
            "--worker-urls", *workers, "--policy", "cache_aware",
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(common.free_port())]


@contextlib.contextmanager
def sglang_gateway(logs: Path, label: str) -> Iterator[tuple[str, list[str]]]:
    """Two plain ``butter serve`` processes, each as one replica of ``--replicas 2``
    (one thread, four sessions, the trained 8,192-token context), behind SGLang's
    gateway; yields the gateway's root URL and the two processes' root URLs."""
    flags = ("--threads", "1", "--parallel", "4", "--max-context", "8192")
    with server(*flags, log=logs / f"{label}-process0.log") as first, \
            server(*flags, log=logs / f"{label}-process1.log") as second:
        workers = [first, second]
        port = common.free_port()
        root = f"http://127.0.0.1:{port}"

        def ready() -> bool:
            # The gateway answers /health at once and registers its workers after.
            listed = httpx.get(f"{root}/workers", timeout=2)
            return listed.is_success and len(listed.json().get("workers", ())) == 2

        with started(smg_command(port, workers), logs / f"{label}-gateway.log", ready):
            yield root, workers


async def one_request(client: httpx.AsyncClient, root: str, messages: list[dict],
                      max_tokens: int) -> dict:
    body = {"model": common.MODEL_ID, "messages": messages, "max_tokens": max_tokens,
            "ignore_eos": True, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    answer = await common.stream_chat(client, f"{root}/v1/chat/completions", body)
    return {"ttft": answer.ttft if answer.ttft is not None else answer.elapsed,
            "text": answer.text, "usage": answer.usage, "elapsed": answer.elapsed}


async def workload(root: str, *, requests: int, concurrency: int, seed: int,
                   max_tokens: int) -> dict:
    order = zipf_tenants(requests, seed)
    histories = {t: [{"role": "system", "content": system_prompt(t)}] for t in range(TENANTS)}
    locks = {t: asyncio.Lock() for t in range(TENANTS)}  # one turn at a time per tenant
    queue: asyncio.Queue = asyncio.Queue()
    for index, tenant in enumerate(order):
        queue.put_nowait((index, tenant))
    results: list[dict] = []
    failures: list[str] = []

    async def worker(client: httpx.AsyncClient) -> None:
        while not queue.empty():
            index, tenant = queue.get_nowait()
            async with locks[tenant]:
                history = histories[tenant]
                history.append({"role": "user", "content": f"Question {index}: which day?"})
                try:
                    answer = await asyncio.wait_for(
                        one_request(client, root, list(history), max_tokens), REQUEST_TIMEOUT)
                except (TimeoutError, httpx.HTTPError) as exc:
                    failures.append(f"request {index} (tenant {tenant}): {exc!r}")
                    history.pop()
                    continue
                if answer["usage"] is None:
                    failures.append(f"request {index} (tenant {tenant}): no usage (error event)")
                    history.pop()
                    continue
                history.append({"role": "assistant", "content": answer["text"]})
                # Keep each conversation inside a session's 2,048 cells.
                if len(history) > 9:
                    del history[1:3]
                results.append(answer)

    start = time.perf_counter()
    async with httpx.AsyncClient(timeout=600) as client:
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
    wall = time.perf_counter() - start
    prompt = sum(r["usage"]["prompt_tokens"] for r in results)
    cached = sum(r["usage"]["prompt_tokens_details"]["cached_tokens"] for r in results)
    completion = sum(r["usage"]["completion_tokens"] for r in results)
    ttfts = sorted(r["ttft"] for r in results)
    return {"requests": len(results), "failed": failures, "wall_s": round(wall, 2),
            "completion_tok_s": round(completion / wall, 2),
            "prefix_hit_rate": round(cached / prompt, 4) if prompt else 0.0,
            "ttft_p50_ms": round(1000 * statistics.median(ttfts), 1),
            "ttft_p99_ms": round(1000 * ttfts[min(len(ttfts) - 1,
                                                   int(0.99 * len(ttfts)))], 1)}


def spread(root: str) -> dict[str, float]:
    """Requests per replica, from the cluster's /metrics."""
    text = httpx.get(f"{root}/metrics", timeout=60).text
    counts = {}
    for line in text.splitlines():
        if line.startswith("butter_cluster_requests_total{") and 'replica="total"' not in line:
            replica = line.split('replica="')[1].split('"')[0]
            counts[replica] = float(line.rsplit(" ", 1)[1])
    return counts


def requests_served(root: str) -> float:
    """Requests one plain process admitted, from its own /metrics."""
    text = httpx.get(f"{root}/metrics", timeout=60).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("butter_requests_total{"))


async def rotated_ttft(roots: list[str], count: int) -> list[list[float]]:
    """TTFT of the same short request on each server in turn, ``count`` rounds; the
    order rotates each round so that no server always goes first. Rows follow ``roots``;
    the first two rounds warm up and are dropped."""
    rounds = []
    async with httpx.AsyncClient(timeout=120) as client:
        for index in range(count):
            messages = [{"role": "user", "content": f"Say hello number {index}."}]
            ttft = {}
            shift = index % len(roots)
            for root in roots[shift:] + roots[:shift]:
                ttft[root] = (await one_request(client, root, messages, 4))["ttft"]
            rounds.append([ttft[root] for root in roots])
    return rounds[2:]


def overhead(pairs: int, logs: Path) -> dict[str, float]:
    """The TTFT Ray adds at one replica, and the same paired figure between two identical
    plain processes (its A/A: what the noise alone makes of such a difference)."""
    # All three up at once, requests one at a time: each pair of answers meets the same
    # background load (this machine is shared), so the paired difference is Ray's path
    # (proxy, ingress, handle, stream relay) and little else.
    with server("--threads", "1", log=logs / "single1.log") as alone, \
            server("--threads", "1", log=logs / "single1-again.log") as again, \
            server("--replicas", "1", "--threads", "1", log=logs / "ray1.log") as ray1:
        rounds = asyncio.run(rotated_ttft([alone, ray1, again], pairs + 2))

    def ms(values) -> float:
        return round(1000 * statistics.median(values), 1)

    return {"pairs": len(rounds),
            "single1_p50_ms": ms(r[0] for r in rounds),
            "ray1_p50_ms": ms(r[1] for r in rounds),
            "single1_again_p50_ms": ms(r[2] for r in rounds),
            "ray_adds_p50_ms": ms(r[1] - r[0] for r in rounds),
            "aa_single1_again_minus_single1_p50_ms": ms(r[2] - r[0] for r in rounds)}


SETUPS = {
    # 2,048 KV cells per session everywhere: a system prompt and a few turns.
    "single": ("--threads", "2", "--parallel", "8", "--max-context", "16384"),
    "affinity": ("--replicas", "2", "--threads", "1", "--parallel", "4"),
    "pow2": ("--replicas", "2", "--threads", "1", "--parallel", "4", "--ray-router", "pow2"),
    "sglang": None,  # sglang_gateway(): two plain processes behind SGLang's gateway
}
COMPARED = ("tok/s", "completion_tok_s"), ("hit rate", "prefix_hit_rate"), \
    ("TTFT p50", "ttft_p50_ms"), ("TTFT p99", "ttft_p99_ms")


def run_setup(name: str, args: argparse.Namespace, logs: Path) -> dict:
    """One pass of the workload through setup ``name`` (``name'`` is its A/A repeat)."""
    setup = name.rstrip("'")
    label = setup + ("-again" if name.endswith("'") else "")  # a log file's name

    def measure(root: str) -> dict:
        return asyncio.run(workload(root, requests=args.requests,
                                    concurrency=args.concurrency, seed=args.seed,
                                    max_tokens=args.max_tokens))

    if setup == "sglang":
        with sglang_gateway(logs, label) as (root, workers):
            result = measure(root)
            result["requests_per_replica"] = {f"process{i}": requests_served(worker)
                                              for i, worker in enumerate(workers)}
        return result
    flags = SETUPS[setup]
    with server(*flags, log=logs / f"{label}.log") as root:
        result = measure(root)
        if "--replicas" in flags:
            result["requests_per_replica"] = spread(root)
    return result


def ratios(report: dict, same: list[str]) -> None:
    """Each setup's hit rate over the single process's, its tokens/s over power-of-two
    routing's (the issue's two targets), and each A/A pair's figures (second run over
    first); written into ``report``."""
    base = report.get("single", {}).get("prefix_hit_rate")
    pow2 = report.get("pow2", {}).get("completion_tok_s")
    for name, result in report.items():
        if base and name != "single" and "prefix_hit_rate" in result:
            result["hit_rate_vs_single"] = round(result["prefix_hit_rate"] / base, 3)
        if pow2 and name not in ("single", "pow2") and "completion_tok_s" in result:
            result["tok_s_vs_pow2"] = round(result["completion_tok_s"] / pow2, 3)
    for name in same:
        first, second = report.get(name), report.get(f"{name}'")
        if first and second:
            report[f"aa_{name}"] = {label: round(second[key] / first[key], 3)
                                    for label, key in COMPARED if first[key]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--only", default="single,affinity,pow2,sglang,overhead",
                        help="setups to run, comma-separated, in this order: "
                             "single, affinity, pow2, sglang, overhead")
    parser.add_argument("--same", default="", metavar="SETUPS",
                        help="run these setups (comma-separated) again at the end of the "
                             "run and report the second run over the first (A/A)")
    parser.add_argument("--pairs", type=int, default=22,
                        help="overhead: measured rounds, after two warm-up rounds")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--plot", type=Path, default=None, metavar="FILE",
                        help="a chart of the setups side by side (PNG or SVG)")
    parser.add_argument("--replot", type=Path, default=None, metavar="JSON",
                        help="run nothing: draw the chart of a run --json saved")
    args = parser.parse_args()
    if args.replot:
        if not args.plot:
            parser.error("--replot needs --plot FILE")
        chart(json.loads(args.replot.read_text()), args)
        return 0
    wanted = [name for name in args.only.split(",") if name]
    same = [name for name in args.same.split(",") if name]
    unknown = set(wanted + same) - {*SETUPS, "overhead"} | set(same) - set(SETUPS)
    if unknown:
        parser.error(f"unknown setups: {', '.join(sorted(unknown))}")
    if "sglang" in wanted + same:
        smg_command(0, [])  # fails now, not after an hour of other setups, if smg is missing
    logs = Path("/tmp/butter-scale-out")
    logs.mkdir(exist_ok=True)
    report: dict[str, dict] = {}
    # A setup named by --same runs (first) even where --only leaves it out.
    runs = [name for name in SETUPS if name in wanted + same] + [f"{name}'" for name in same]
    for name in runs:
        report[name] = run_setup(name, args, logs)
        print(name, json.dumps(report[name]), flush=True)
        save(report, same, args.json)  # after each setup: a late failure keeps what ran
    if "overhead" in wanted:
        report["overhead_ttft"] = overhead(args.pairs, logs)
        print("overhead", json.dumps(report["overhead_ttft"]), flush=True)
    save(report, same, args.json)
    print(json.dumps(report, indent=2))
    if args.plot:
        chart(report, args)
    return 0


LABELS = {"single": "one process, 2 threads", "affinity": "2 replicas, prefix affinity",
          "pow2": "2 replicas, power of two", "sglang": "SGLang gateway, 2 processes"}
PANELS = (("completion_tok_s", "completion tokens/s (higher is better)"),
          ("prefix_hit_rate", "prefix-hit rate (higher is better)"),
          ("ttft_p50_s", "TTFT p50, s (lower is better)"),
          ("ttft_p99_s", "TTFT p99, s (lower is better)"))


def chart(report: dict, args: argparse.Namespace) -> None:
    """The setups side by side (an A/A repeat beside its first run, marked ')."""
    from butter.bench.plot import bars

    setups = {}
    for name, result in report.items():
        if name.rstrip("'") in LABELS and "completion_tok_s" in result:
            setups[LABELS[name.rstrip("'")] + (" (again)" if name.endswith("'") else "")] = {
                **result, "ttft_p50_s": result["ttft_p50_ms"] / 1000,
                "ttft_p99_s": result["ttft_p99_ms"] / 1000}
    path = bars(setups, PANELS, args.plot,
                title=f"eight tenants, ~1,000-token system prompts, Zipf, multi-turn, "
                      f"{args.max_tokens} tokens out, {args.concurrency} in flight "
                      f"(SmolLM2 Q4_1)")
    print(f"chart: {path}", flush=True)


def save(report: dict, same: list[str], path: Path | None) -> None:
    ratios(report, same)
    if path:
        path.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    raise SystemExit(main())
