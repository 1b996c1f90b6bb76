"""Scale-out on Ray Serve: does prefix-affinity routing keep the cache working?

The workload: eight tenants, each with its own ~1,000-token system prompt, picked with a
Zipf skew (s = 1.1), multi-turn (each tenant's conversation grows by its question and
the answer), 64 tokens out (``ignore_eos``), ``--concurrency`` requests in flight.
The same request sequence (seeded) runs against:

1. ``single``: one ``butter serve`` process, ``--threads 2 --parallel 8`` (and
   ``--max-context 16384``: 2,048 cells per session, as each replica's four get);
2. ``affinity``: ``butter serve --replicas 2 --threads 1 --parallel 4`` (prefix router);
3. ``pow2``: the same under ``--ray-router pow2`` (Serve's power-of-two choices);
4. ``ray1`` vs ``single1``: one replica against one process (one thread each), both up
   at once, the same short request to each in turn: the TTFT Ray adds (paired median).

SGLang's gateway (``sglang-router``, cache_aware) in front of two plain processes is not
run here (see the README's scale-out figures for why).

Reported per setup: aggregate completion tokens/s, the prefix-hit rate (cached / prompt
tokens, from each answer's usage), TTFT p50/p99 (client side, to the first content
chunk), and the spread of requests over the replicas (from ``/metrics``).

    .venv/bin/python bench/scale_out.py [--requests 48] [--concurrency 4] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

TENANTS = 8
REQUEST_TIMEOUT = 240.0  # seconds; a request past it counts as failed, the run goes on
WORDS = ("ledger", "harbour", "copper", "meadow", "lantern", "archive", "granite", "willow",
         "saffron", "beacon", "orchard", "compass", "thistle", "quarry", "falcon", "ember")


def system_prompt(tenant: int) -> str:
    """About 1,000 SmolLM2 tokens of text nobody else shares."""
    rng = random.Random(tenant)
    rules = [f"Rule {tenant}.{i}: the {rng.choice(WORDS)} of house {tenant} meets the "
             f"{rng.choice(WORDS)} on day {rng.randrange(1, 365)} at hour {rng.randrange(24)}."
             for i in range(52)]
    return f"You are the archivist of house {tenant}. " + " ".join(rules)


def zipf_tenants(count: int, seed: int, s: float = 1.1) -> list[int]:
    rng = random.Random(seed)
    weights = [1 / (rank + 1) ** s for rank in range(TENANTS)]
    return rng.choices(range(TENANTS), weights=weights, k=count)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def server(*flags: str, log: Path):
    port = free_port()
    command = [sys.executable, "-m", "butter", "serve", "--model", "smollm2",
               "--port", str(port), *flags]
    with open(log, "wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
        root = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 300
            while True:
                if process.poll() is not None:
                    raise RuntimeError(f"{command} exited; see {log}")
                with contextlib.suppress(httpx.HTTPError):
                    if httpx.get(f"{root}/health", timeout=2).status_code == 200:
                        break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{command} never became healthy; see {log}")
                time.sleep(0.5)
            yield root
        finally:
            process.send_signal(signal.SIGINT)
            try:
                process.wait(90)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


async def one_request(client: httpx.AsyncClient, root: str, messages: list[dict],
                      max_tokens: int) -> dict:
    body = {"model": "smollm2", "messages": messages, "max_tokens": max_tokens,
            "ignore_eos": True, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    ttft, text, usage = None, [], None
    async with client.stream("POST", f"{root}/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk.get("choices", []):
                piece = choice.get("delta", {}).get("content")
                if piece:
                    if ttft is None:
                        ttft = time.perf_counter() - start
                    text.append(piece)
    return {"ttft": ttft or (time.perf_counter() - start), "text": "".join(text),
            "usage": usage, "elapsed": time.perf_counter() - start}


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
    """Requests per replica, from the cluster's /metrics (one process: itself)."""
    text = httpx.get(f"{root}/metrics", timeout=60).text
    counts = {}
    for line in text.splitlines():
        if line.startswith("butter_cluster_requests_total{") and 'replica="total"' not in line:
            replica = line.split('replica="')[1].split('"')[0]
            counts[replica] = float(line.rsplit(" ", 1)[1])
    return counts


async def paired_ttft(first: str, second: str, count: int) -> list[tuple[float, float]]:
    """TTFT of the same short request on each server in turn, ``count`` pairs (the first
    two pairs warm up and are dropped)."""
    pairs = []
    async with httpx.AsyncClient(timeout=120) as client:
        for index in range(count):
            messages = [{"role": "user", "content": f"Say hello number {index}."}]
            a = await one_request(client, first, messages, 4)
            b = await one_request(client, second, messages, 4)
            pairs.append((a["ttft"], b["ttft"]))
    return pairs[2:]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--only", default="single,affinity,pow2,overhead")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    logs = Path("/tmp/butter-scale-out")
    logs.mkdir(exist_ok=True)
    setups = {
        # 2,048 KV cells per session everywhere: a system prompt and a few turns.
        "single": ("--threads", "2", "--parallel", "8", "--max-context", "16384"),
        "affinity": ("--replicas", "2", "--threads", "1", "--parallel", "4"),
        "pow2": ("--replicas", "2", "--threads", "1", "--parallel", "4",
                 "--ray-router", "pow2"),
    }
    wanted = args.only.split(",")
    report: dict[str, dict] = {}
    for name, flags in setups.items():
        if name not in wanted:
            continue
        with server(*flags, log=logs / f"{name}.log") as root:
            result = asyncio.run(workload(root, requests=args.requests,
                                          concurrency=args.concurrency, seed=args.seed,
                                          max_tokens=args.max_tokens))
            if "--replicas" in flags:
                result["requests_per_replica"] = spread(root)
        report[name] = result
        print(name, json.dumps(result), flush=True)
    if "overhead" in wanted:
        # Both up at once, requests alternating one at a time: each pair of answers meets
        # the same background load (this machine is shared), so the paired difference is
        # Ray's path (proxy, ingress, handle, stream relay) and little else.
        with server("--threads", "1", log=logs / "single1.log") as alone, \
                server("--replicas", "1", "--threads", "1", log=logs / "ray1.log") as ray1:
            pairs = asyncio.run(paired_ttft(alone, ray1, 24))
        differences = sorted(b - a for a, b in pairs)
        overhead = {"single1_p50_ms": round(1000 * statistics.median(a for a, _ in pairs), 1),
                    "ray1_p50_ms": round(1000 * statistics.median(b for _, b in pairs), 1),
                    "ray_adds_p50_ms": round(1000 * statistics.median(differences), 1)}
        report["overhead_ttft"] = overhead
        print("overhead", json.dumps(overhead), flush=True)
    if "single" in report:
        base = report["single"]["prefix_hit_rate"]
        for name in ("affinity", "pow2"):
            if name in report and base:
                report[name]["hit_rate_vs_single"] = round(
                    report[name]["prefix_hit_rate"] / base, 3)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
