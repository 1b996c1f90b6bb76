"""``butter serve-bench``: synchronized request waves against a running server.

The command never loads a model: it talks to an OpenAI-compatible server that is
already serving ``--model`` (it refuses to start if ``GET /models`` does not list
that id, because a swap-on-request server would otherwise load a second model).

For every concurrency level it runs ``--waves`` synchronized waves: all lanes of a
wave start together and the next wave starts when every lane has finished. Each
lane of each wave carries a unique prompt marker, so a response that contains
another lane's marker is a leak between sessions. Every request is a streaming chat
completion with ``include_usage``, asks for exactly ``--max-tokens`` tokens
(``ignore_eos`` / ``min_tokens``, honoured by butter, llama-server and vLLM) and is
sent on its lane's own HTTP/1.1 connection.

Timing is read off the event stream only. TTFT starts at the first non-empty
content or tool-call delta (a role-only chunk does not count). The post-TTFT rate
drops one first token per response and divides the rest by the span from the
wave's earliest first output to its latest completion; it separates the prefill
window from aggregate decode without claiming per-token timing the stream cannot
give. The wall-clock rates include the whole request lifetime.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import json
import secrets
import sys
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
from rich import box
from rich.console import Console
from rich.table import Table
from rich.text import Text

DEFAULT_URL = "http://127.0.0.1:8000/v1"
# Long prompts on a busy CPU can take minutes to prefill; never time a lane out early.
REQUEST_TIMEOUT = httpx.Timeout(900.0, connect=30.0)

# With --shared-prompt every lane starts with this system text, so a server with
# prefix reuse can serve it from cache; the lane's marker comes after it.
SHARED_PREAMBLE = (
    "You are a careful assistant taking part in a load test. Every request carries a "
    "tag in square brackets that identifies it. When asked, repeat the tag exactly as "
    "written, character for character, and then continue with the task. Keep answers "
    "plain: no lists, no headings, no code. Stay on the topic of the request, write "
    "complete sentences, and do not mention these instructions. If the task asks for a "
    "story, give it a beginning, a middle and an end, and name at least one character."
)


# --------------------------------------------------------------------------- config


@dataclass(frozen=True, slots=True, kw_only=True)
class BenchConfig:
    """What to send. ``long_prompt_lanes`` is 0 unless ``long_prompt`` is set."""

    model: str
    url: str = DEFAULT_URL
    concurrency: tuple[int, ...] = (1, 2, 4, 8)
    max_tokens: int = 128
    temperature: float = 0.7
    top_p: float = 0.9
    shared_prompt: bool = False
    long_prompt: str | None = None
    long_prompt_lanes: int = 0
    waves: int = 1
    seed: int | None = 0  # None: requests carry no seed

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> BenchConfig:
        """Build and cross-check a config; raises ``ValueError`` with a one-line reason."""
        lanes = args.long_prompt_lanes
        if lanes is not None and not args.long_prompt:
            raise ValueError("--long-prompt-lanes needs --long-prompt")
        if args.long_prompt and lanes is None:
            lanes = 1
        if lanes is not None and lanes < 1:
            raise ValueError("--long-prompt-lanes must be at least 1")
        for flag, value in (("--max-tokens", args.max_tokens), ("--waves", args.waves)):
            if value < 1:
                raise ValueError(f"{flag} must be at least 1")
        return cls(
            model=args.model,
            url=args.url.rstrip("/"),
            concurrency=tuple(args.concurrency),
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            shared_prompt=args.shared_prompt,
            long_prompt=args.long_prompt or None,
            long_prompt_lanes=lanes or 0,
            waves=args.waves,
            seed=args.seed,
        )

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["long_prompt"] = None
        data["long_prompt_chars"] = len(self.long_prompt or "")
        return data


def parse_levels(text: str) -> list[int]:
    """``"1,2,4,8"`` -> ``[1, 2, 4, 8]``; an argparse type."""
    try:
        levels = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"not a comma-separated list of integers: {text!r}") from None
    if not levels or min(levels) < 1:
        raise argparse.ArgumentTypeError("concurrency levels must be positive integers")
    return levels


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``serve-bench`` flags to ``parser``."""
    parser.add_argument("--model", required=True, metavar="RESIDENT_ID",
                        help="id the server already serves (checked on GET /models)")
    parser.add_argument("--url", default=DEFAULT_URL, help="base URL of the OpenAI API")
    parser.add_argument("--concurrency", type=parse_levels, default=[1, 2, 4, 8],
                        metavar="1,2,4,8", help="comma-separated lane counts, one level each")
    parser.add_argument("--max-tokens", type=int, default=128,
                        help="completion tokens per request (EOS is ignored)")
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--top-p", type=float, default=0.9)
    parser.add_argument("--seed", type=int, default=0, help="lane N sends seed + N")
    parser.add_argument("--shared-prompt", action="store_true",
                        help="start every lane with the same system text (prefix reuse)")
    parser.add_argument("--long-prompt", metavar="TEXT",
                        help="text the long-prompt lanes carry in their request")
    parser.add_argument("--long-prompt-lanes", type=int, metavar="N",
                        help="lanes per wave that carry --long-prompt (default 1)")
    parser.add_argument("--waves", type=int, default=1, help="synchronized waves per level")
    parser.add_argument("--json", type=Path, metavar="FILE", help="also write every number here")
    parser.add_argument("--plot", type=Path, metavar="FILE",
                        help="also draw tokens/s and TTFT against lanes into FILE (.png or "
                             ".svg; needs matplotlib: pip install 'butter-core[bench]')")
    parser.add_argument("--label", default=None,
                        help="the chart's name for this run (default: the model id)")


# -------------------------------------------------------------------------- requests


@dataclass(frozen=True, slots=True)
class LaneRequest:
    """One lane's request in one wave."""

    lane: int
    wave: int
    marker: str
    is_long: bool
    body: dict[str, Any]


def _marker(lane: int, wave: int) -> str:
    return f"[lane-{lane}-wave-{wave}-{secrets.token_hex(4)}]"


def _messages(marker: str, *, shared_prompt: bool, long_text: str | None) -> list[dict]:
    # The marker opens the user turn so lanes diverge right there: only the chat
    # template (and the shared preamble, when asked for) is a common prefix.
    if long_text:
        ask = (f"{marker}\n{long_text}\n\nRepeat the tag {marker} exactly once, "
               "then summarize the text above.")
    else:
        ask = f"{marker} Repeat the tag {marker} exactly once, then tell a story about it."
    messages = [{"role": "user", "content": ask}]
    if shared_prompt:
        messages.insert(0, {"role": "system", "content": SHARED_PREAMBLE})
    return messages


def plan_wave(config: BenchConfig, *, lanes: int, wave: int) -> list[LaneRequest]:
    """The requests of one synchronized wave; the first lanes carry the long prompt."""
    requests = []
    for lane in range(lanes):
        marker = _marker(lane, wave)
        is_long = lane < config.long_prompt_lanes
        body = {
            "model": config.model,
            "messages": _messages(marker, shared_prompt=config.shared_prompt,
                                  long_text=config.long_prompt if is_long else None),
            "stream": True,
            "stream_options": {"include_usage": True},
            "max_tokens": config.max_tokens,
            "temperature": config.temperature,
            "top_p": config.top_p,
            # Every lane generates exactly max_tokens, so levels compare equal work.
            "ignore_eos": True,
            "min_tokens": config.max_tokens,
        }
        if config.seed is not None:
            body["seed"] = config.seed + lane
        requests.append(LaneRequest(lane, wave, marker, is_long, body))
    return requests


# ------------------------------------------------------------------------- streaming


@dataclass(slots=True)
class StreamRecord:
    """What one streamed chat completion produced, with ``perf_counter`` times."""

    started: float
    finished: float = 0.0
    first_output: float | None = None
    last_output: float | None = None
    text: str = ""
    output_chunks: int = 0
    usage: dict[str, Any] | None = None
    finish_reason: str | None = None
    raw_utf8_ok: bool = True
    error: str | None = None

    @property
    def valid_utf8(self) -> bool:
        """Raw bytes decoded, no lone surrogates, and no U+FFFD from a split character."""
        if not self.raw_utf8_ok or "\ufffd" in self.text:
            return False
        try:
            self.text.encode("utf-8")
        except UnicodeEncodeError:
            return False
        return True


def _delta_output(delta: dict[str, Any]) -> str:
    """The visible output of one delta: content plus tool-call names and arguments."""
    pieces = [delta.get("content") or ""]
    for call in delta.get("tool_calls") or []:
        function = call.get("function") or {}
        pieces.append(function.get("name") or "")
        pieces.append(function.get("arguments") or "")
    return "".join(pieces)


def _apply_event(record: StreamRecord, payload: bytes) -> bool:
    """Fold one ``data:`` payload into ``record``; False once the stream is over."""
    if payload == b"[DONE]":
        return False
    try:
        text = payload.decode("utf-8")
    except UnicodeDecodeError:
        record.raw_utf8_ok = False
        text = payload.decode("utf-8", "replace")
    try:
        chunk = json.loads(text)
    except json.JSONDecodeError:
        record.error = f"malformed event: {text[:120]!r}"
        return False
    if "error" in chunk:
        record.error = f"error event: {json.dumps(chunk['error'])[:200]}"
        return False
    if chunk.get("usage"):
        record.usage = chunk["usage"]
    for choice in chunk.get("choices") or []:
        piece = _delta_output(choice.get("delta") or {})
        if piece:
            now = time.perf_counter()
            if record.first_output is None:
                record.first_output = now
            record.last_output = now
            record.text += piece
            record.output_chunks += 1
        if choice.get("finish_reason"):
            record.finish_reason = choice["finish_reason"]
    return True


async def _sse_payloads(response: httpx.Response) -> AsyncIterator[bytes]:
    """``data:`` payloads as raw bytes, so invalid UTF-8 is seen, not replaced."""
    buffer = b""
    async for block in response.aiter_bytes():
        buffer += block
        *lines, buffer = buffer.split(b"\n")
        for line in lines:
            if line.startswith(b"data:"):
                yield line[5:].strip()


async def stream_chat(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> StreamRecord:
    """POST one streaming chat completion and record what came back and when."""
    record = StreamRecord(started=time.perf_counter())
    try:
        async with client.stream("POST", f"{url}/chat/completions", json=body) as response:
            if response.status_code != 200:
                await response.aread()
                record.error = f"HTTP {response.status_code}: {response.text[:200]}"
            else:
                async for payload in _sse_payloads(response):
                    if not _apply_event(record, payload):
                        break
    except httpx.HTTPError as exc:
        record.error = f"{type(exc).__name__}: {exc}"
    record.finished = time.perf_counter()
    return record


def lane_client() -> httpx.AsyncClient:
    """One HTTP/1.1 connection per lane, kept alive across waves."""
    limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)
    return httpx.AsyncClient(timeout=REQUEST_TIMEOUT, limits=limits, http2=False)


# --------------------------------------------------------------------------- results


@dataclass(frozen=True, slots=True)
class Wave:
    """One synchronized wave: its requests, their records and its wall-clock span."""

    requests: list[LaneRequest]
    records: list[StreamRecord]
    started: float
    finished: float


def usage_tokens(record: StreamRecord) -> tuple[int, int, int]:
    """(prompt, cached, completion) from the usage chunk; chunk count if it is missing."""
    usage = record.usage or {}
    cached = usage.get("cached_tokens")
    if cached is None:
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    completion = usage.get("completion_tokens")
    if completion is None:
        completion = record.output_chunks
    return int(usage.get("prompt_tokens") or 0), int(cached), int(completion)


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear-interpolated percentile (q in 0..100); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def _rate(tokens: float, seconds: float) -> float | None:
    return tokens / seconds if seconds > 0 else None


@dataclass(slots=True, kw_only=True)
class LevelSummary:
    """Every number reported for one concurrency level (times in seconds)."""

    concurrency: int
    waves: int
    requests: int = 0
    long_lanes: int = 0
    errors: int = 0
    usage_missing: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    uncached_tokens: int = 0
    completion_tokens: int = 0
    marker_leaks: int = 0
    empty_responses: int = 0
    invalid_utf8: int = 0
    wall_seconds: float = 0.0
    completion_tok_s: float | None = None
    uncached_prompt_tok_s: float | None = None
    post_ttft_tokens: int = 0
    post_ttft_seconds: float = 0.0
    post_ttft_tok_s: float | None = None
    ttft_p50: float | None = None
    ttft_p95: float | None = None
    request_p95: float | None = None
    ttft_p95_long: float | None = None
    ttft_p95_short: float | None = None
    error_samples: list[str] = field(default_factory=list)
    problem_samples: list[str] = field(default_factory=list)


def _count_request(summary: LevelSummary, request: LaneRequest, record: StreamRecord,
                   markers: set[str]) -> None:
    summary.requests += 1
    if record.error:
        summary.errors += 1
        if len(summary.error_samples) < 3:
            summary.error_samples.append(record.error)
        return
    prompt, cached, completion = usage_tokens(record)
    summary.usage_missing += record.usage is None
    summary.prompt_tokens += prompt
    summary.cached_tokens += cached
    summary.uncached_tokens += prompt - cached
    summary.completion_tokens += completion
    summary.empty_responses += not record.text
    leaked = [marker for marker in markers - {request.marker} if marker in record.text]
    summary.marker_leaks += bool(leaked)
    summary.invalid_utf8 += not record.valid_utf8
    problems = [f"leaked {marker}" for marker in leaked[:1]]
    if not record.valid_utf8:
        problems.append(f"invalid UTF-8 in {_invalid_excerpt(record.text)!r}")
    if problems and len(summary.problem_samples) < 3:
        where = f"lane {request.lane} wave {request.wave}"
        summary.problem_samples.append(f"{where}: {'; '.join(problems)}")


def _invalid_excerpt(text: str) -> str:
    """A few characters around the first replacement character or lone surrogate."""
    for index, char in enumerate(text):
        if char == "\ufffd" or "\ud800" <= char <= "\udfff":
            return text[max(index - 20, 0):index + 20]
    return text[:40]  # the raw bytes did not decode; the text shows replacements


def _post_ttft_window(wave: Wave) -> tuple[int, float]:
    """Tokens after each response's first, and the wave's first-output-to-last-end span."""
    done = [r for r in wave.records if r.first_output is not None and not r.error]
    if not done:
        return 0, 0.0
    tokens = sum(max(usage_tokens(r)[2] - 1, 0) for r in done)
    span = max(r.finished for r in done) - min(r.first_output for r in done)
    return tokens, span


def _latency_stats(summary: LevelSummary, waves: Sequence[Wave], long_prompt: bool) -> None:
    pairs = [(q, r) for w in waves for q, r in zip(w.requests, w.records) if not r.error]
    ttfts = {(q.lane, q.wave): r.first_output - r.started
             for q, r in pairs if r.first_output is not None}
    summary.ttft_p50 = percentile(list(ttfts.values()), 50)
    summary.ttft_p95 = percentile(list(ttfts.values()), 95)
    summary.request_p95 = percentile([r.finished - r.started for _, r in pairs], 95)
    if long_prompt:
        by_class = {True: [], False: []}
        for q, _ in pairs:
            if (q.lane, q.wave) in ttfts:
                by_class[q.is_long].append(ttfts[(q.lane, q.wave)])
        summary.ttft_p95_long = percentile(by_class[True], 95)
        summary.ttft_p95_short = percentile(by_class[False], 95)


def summarize_level(concurrency: int, waves: Sequence[Wave], *, markers: set[str],
                    long_prompt: bool) -> LevelSummary:
    """Fold a level's waves into its report; ``markers`` are all markers issued so far."""
    summary = LevelSummary(concurrency=concurrency, waves=len(waves))
    for wave in waves:
        for request, record in zip(wave.requests, wave.records):
            _count_request(summary, request, record, markers)
            summary.long_lanes += request.is_long
        tokens, span = _post_ttft_window(wave)
        summary.post_ttft_tokens += tokens
        summary.post_ttft_seconds += span
        summary.wall_seconds += wave.finished - wave.started
    summary.completion_tok_s = _rate(summary.completion_tokens, summary.wall_seconds)
    summary.uncached_prompt_tok_s = _rate(summary.uncached_tokens, summary.wall_seconds)
    summary.post_ttft_tok_s = _rate(summary.post_ttft_tokens, summary.post_ttft_seconds)
    _latency_stats(summary, waves, long_prompt)
    return summary


@dataclass(slots=True)
class BenchReport:
    """A whole run: the config and one summary per level, in the order run."""

    config: BenchConfig
    levels: list[LevelSummary] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """No failed request, no leaked marker and no invalid UTF-8 anywhere."""
        return all(not (s.errors or s.marker_leaks or s.invalid_utf8) for s in self.levels)

    def to_dict(self) -> dict[str, Any]:
        return {"config": self.config.to_dict(), "ok": self.ok,
                "levels": [asdict(level) for level in self.levels]}


# --------------------------------------------------------------------------- running


async def resident_models(url: str) -> list[str]:
    """Ids listed by ``GET {url}/models``; raises ``httpx.HTTPError`` if unreachable."""
    async with httpx.AsyncClient(timeout=30.0) as client:
        response = await client.get(f"{url}/models")
        response.raise_for_status()
        return [entry.get("id") for entry in response.json().get("data", [])]


async def run_wave(clients: Sequence[httpx.AsyncClient], url: str,
                   requests: list[LaneRequest]) -> Wave:
    """Start every lane together and return when the last one has finished."""
    started = time.perf_counter()
    records = await asyncio.gather(
        *(stream_chat(client, url, request.body) for client, request in zip(clients, requests))
    )
    return Wave(requests, list(records), started, time.perf_counter())


async def run_level(config: BenchConfig, concurrency: int, markers: set[str],
                    on_wave: Callable[[int, int, int], None] | None = None) -> LevelSummary:
    """All waves of one level on ``concurrency`` warm lane connections."""
    async with contextlib.AsyncExitStack() as stack:
        clients = [await stack.enter_async_context(lane_client()) for _ in range(concurrency)]
        # Open every lane's connection before the first wave so it starts together.
        await asyncio.gather(*(client.get(f"{config.url}/models") for client in clients))
        waves = []
        for wave_index in range(config.waves):
            if on_wave:
                on_wave(concurrency, wave_index + 1, config.waves)
            requests = plan_wave(config, lanes=concurrency, wave=wave_index)
            markers.update(request.marker for request in requests)
            waves.append(await run_wave(clients, config.url, requests))
    return summarize_level(concurrency, waves, markers=markers,
                           long_prompt=config.long_prompt is not None)


async def run_bench(config: BenchConfig,
                    on_wave: Callable[[int, int, int], None] | None = None) -> BenchReport:
    """Every level of ``config`` in order; the caller checks residency first."""
    report = BenchReport(config)
    markers: set[str] = set()
    for concurrency in config.concurrency:
        report.levels.append(await run_level(config, concurrency, markers, on_wave))
    return report


# -------------------------------------------------------------------------- printing


def _num(value: float | None, fmt: str = "{:.1f}") -> str:
    return "-" if value is None else fmt.format(value)


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.0f}"


def token_table(report: BenchReport) -> Table:
    table = Table(title="serve-bench: tokens and correctness", box=box.SIMPLE_HEAD)
    for column in ("lanes", "reqs", "prompt", "cached", "uncached", "completion",
                   "leaks", "empty", "bad utf-8", "errors"):
        table.add_column(column, justify="right")
    for s in report.levels:
        table.add_row(str(s.concurrency), str(s.requests), str(s.prompt_tokens),
                      str(s.cached_tokens), str(s.uncached_tokens), str(s.completion_tokens),
                      str(s.marker_leaks), str(s.empty_responses), str(s.invalid_utf8),
                      str(s.errors))
    return table


def speed_table(report: BenchReport) -> Table:
    long_prompt = report.config.long_prompt is not None
    table = Table(title="serve-bench: speed (tok/s; times in ms)", box=box.SIMPLE_HEAD)
    columns = ["lanes", "completion tok/s", "post-TTFT tok/s", "uncached tok/s",
               "TTFT p50", "TTFT p95", "request p95"]
    if long_prompt:
        columns += ["TTFT p95 long", "TTFT p95 short"]
    for column in columns:
        table.add_column(column, justify="right")
    for s in report.levels:
        row = [str(s.concurrency), _num(s.completion_tok_s), _num(s.post_ttft_tok_s),
               _num(s.uncached_prompt_tok_s), _ms(s.ttft_p50), _ms(s.ttft_p95),
               _ms(s.request_p95)]
        if long_prompt:
            row += [_ms(s.ttft_p95_long), _ms(s.ttft_p95_short)]
        table.add_row(*row)
    return table


def print_report(report: BenchReport, console: Console) -> None:
    console.print(token_table(report))
    console.print(speed_table(report))
    for level in report.levels:
        for sample in level.error_samples + level.problem_samples:
            console.print(Text(f"lanes={level.concurrency}: {sample}", style="red"))
    if any(level.usage_missing for level in report.levels):
        console.print("[yellow]some streams had no usage chunk; their completion "
                      "tokens were counted as output chunks[/yellow]")


# ------------------------------------------------------------------------------- run


async def _checked_run(config: BenchConfig, console: Console) -> BenchReport | str:
    """Run the bench, or return a one-line reason it cannot run."""
    try:
        ids = await resident_models(config.url)
    except (httpx.HTTPError, ValueError) as exc:
        return f"cannot list models at {config.url}/models: {exc}"
    if config.model not in ids:
        return (f"model {config.model!r} is not resident at {config.url} "
                f"(serving: {', '.join(map(str, ids)) or 'nothing'}); serve-bench never "
                "loads a model")

    def on_wave(lanes: int, wave: int, waves: int) -> None:
        console.print(f"[dim]lanes={lanes} wave {wave}/{waves}[/dim]")

    return await run_bench(config, on_wave)


def make_console() -> Console:
    console = Console()
    if not console.is_terminal:  # a pipe or a log file: do not squeeze the tables
        console.width = max(console.width, 160)
    return console


def run(args: argparse.Namespace) -> int:
    """Entry point of ``butter serve-bench``: 0 if clean, 1 on failures, 2 on bad flags."""
    console = make_console()
    try:
        config = BenchConfig.from_args(args)
    except ValueError as exc:
        print(f"butter serve-bench: {exc}", file=sys.stderr)
        return 2
    if args.plot and importlib.util.find_spec("matplotlib") is None:  # before any request
        print("butter serve-bench: --plot needs matplotlib: pip install 'butter-core[bench]'",
              file=sys.stderr)
        return 2
    outcome = asyncio.run(_checked_run(config, console))
    if isinstance(outcome, str):
        print(f"butter serve-bench: {outcome}", file=sys.stderr)
        return 1
    print_report(outcome, console)
    if args.json:
        args.json.write_text(json.dumps(outcome.to_dict(), indent=2) + "\n")
    if args.plot:
        from butter.bench.plot import plot

        plot({args.label or config.model: chart_points(outcome)}, args.plot,
             title=f"butter serve-bench, {config.max_tokens} tokens out")
    return 0 if outcome.ok else 1


def chart_points(report: BenchReport) -> list:
    """``report``'s levels as chart points (``butter.bench.plot``)."""
    from butter.bench.plot import Point

    return [Point(level.concurrency, level.completion_tok_s, level.ttft_p50)
            for level in report.levels]
