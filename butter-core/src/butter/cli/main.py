"""The ``butter`` command: ``serve``, ``serve-bench``, ``plugins``."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from rich.console import Console
from rich.logging import RichHandler
from rich.table import Table

from butter.errors import ButterError

console = Console(stderr=True)
log = logging.getLogger("butter")

KV_CODECS_HELP = ("KV-cache codec: raw, affine8, affine4, aura or an auraNvM recipe "
                  "(see `butter plugins`)")
MAX_PARALLEL = 254  # llama.cpp holds 256 sequences; the pool keeps two spare sessions
MAX_THREADS = 512  # GGML_MAX_N_THREADS
MAX_BATCH = 512  # rows per model pass


class UsageError(Exception):
    """A flag that cannot work: reported in one line naming the flag, exit status 2."""

    def __init__(self, flag: str, message: str) -> None:
        super().__init__(f"{flag}: {message}")


class _Parser(argparse.ArgumentParser):
    """argparse that reports a bad flag in one line and exits 2, without usage spam."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message}\n")


DEFAULT_WINDOW_KEEP = 4  # mlx-lm's sink slots for a bounded cache (llama-server: 0)


def _integer(text: str, minimum: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < minimum:
        raise argparse.ArgumentTypeError(f"{text!r} must be at least {minimum}")
    return value


def _positive(text: str) -> int:
    return _integer(text, 1)


def _count(text: str) -> int:
    return _integer(text, 0)


def _port(text: str) -> int:
    value = _positive(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="butter", description="OpenAI- and Anthropic-compatible LLM server.")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    serve = commands.add_parser("serve", help="serve one model over HTTP")
    serve.add_argument("--model", required=True, help="GGUF path, alias (smollm2) or cached HF id")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=_port, default=8000)
    serve.add_argument("--parallel", type=_positive, default=1,
                       help=f"maximum active generation sessions, at most {MAX_PARALLEL}; "
                            "others wait FIFO")
    serve.add_argument("--max-context", type=_positive, default=None,
                       help="KV positions shared by all sessions: a multiple of 256, at most "
                            "the model's trained context (default: that context)")
    serve.add_argument("--threads", type=_positive, default=None,
                       help=f"CPU threads, at most {MAX_THREADS} (default: all)")
    serve.add_argument("--backend", default=None, help="back end name (default: by model type)")
    serve.add_argument("--prefill-chunk", type=_positive, default=256,
                       help=f"prompt tokens per prefill chunk, at most {MAX_BATCH}; chunks "
                            "start at multiples of it whatever else runs")
    serve.add_argument("--ubatch-size", type=_positive, default=None, metavar="N",
                       help=f"rows per llama.cpp micro-batch, at most {MAX_BATCH} (default 512 "
                            "per-session, 63 shared: under 64 rows a shared cache answers the "
                            "same alone or batched while it has no holes)")
    serve.add_argument("--kv-layout", choices=("per-session", "shared"), default=None,
                       help="GGUF: a KV stream per session, capacity / parallel each, answers "
                            "independent of co-runners (default), or one cache shared by all")
    serve.add_argument("--enable-thinking", action=argparse.BooleanOptionalAction, default=None)
    serve.add_argument("--reasoning-effort", choices=("low", "medium", "high"), default=None)
    serve.add_argument("--kv-cache", default="raw", help=KV_CODECS_HELP)
    serve.add_argument("--aura-decode-path", choices=("compressed", "dequant-mirror"),
                       default=None)
    serve.add_argument("--kv-window-size", type=_positive, default=None, metavar="N",
                       help="keep at most N positions per session: an answer runs past N "
                            "by dropping old positions (GGUF: llama.cpp's context shift)")
    serve.add_argument("--kv-window-keep", type=_count, default=None, metavar="S",
                       help=f"with --kv-window-size, the first S positions never leave "
                            f"(attention sinks; default {DEFAULT_WINDOW_KEEP})")
    serve.add_argument("--no-swap", action="store_true",
                       help="answer 404 to requests naming another model instead of swapping")
    serve.add_argument("--models-dir", action="append", default=[], metavar="DIR",
                       help="requests may swap in files and folders under DIR (repeatable)")
    serve.add_argument("--allow-any-path", action="store_true",
                       help="requests may swap in any model path the process can read")
    serve.add_argument("--allowed-origins", default=None, metavar="LIST",
                       help="comma-separated browser origins allowed to call the server "
                            "(default: the localhost origins; '*' allows any)")
    serve.add_argument("--api-key", default=None,
                       help="require 'Authorization: Bearer KEY' (or x-api-key) on /v1/*")
    serve.add_argument("--log-level", default="info",
                       choices=("debug", "info", "warning", "error"))

    bench = commands.add_parser("serve-bench", help="benchmark a running server")
    try:
        from butter.bench import serve_bench
    except ImportError:
        serve_bench = None
    if serve_bench is not None:
        serve_bench.add_arguments(bench)

    commands.add_parser("plugins", help="list back ends, codecs, tool formats and resolvers")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.command == "serve":
            from butter.cli.serve import run_serve

            return run_serve(args)
        if args.command == "serve-bench":
            from butter.bench import serve_bench

            return serve_bench.run(args)
        return show_plugins()
    except UsageError as error:
        sys.stderr.write(f"butter {args.command}: error: {error}\n")
        return 2
    except ButterError as error:
        sys.stderr.write(f"butter: error: {error.message}\n")
        return 1
    except KeyboardInterrupt:
        return 130


def setup_logging(level: str) -> None:
    handler = RichHandler(console=console, show_path=False, rich_tracebacks=False)
    logging.basicConfig(level=level.upper(), format="%(message)s", handlers=[handler], force=True)
    logging.getLogger("uvicorn.error").setLevel(max(logging.WARNING, logging.getLevelName(
        level.upper())))


def show_plugins() -> int:
    from butter.plugins import build_plugins

    plugins = build_plugins()
    table = Table(title="butter plugins")
    for column in ("kind", "name", "detail"):
        table.add_column(column)
    for name, backend in sorted(plugins.backends.items()):
        reason = backend.unavailable()
        detail = type(backend).__module__ if reason is None else f"unavailable: {reason}"
        table.add_row("backend", name, detail)
    for name, codec in sorted(plugins.kv_codecs.items()):
        table.add_row("kv-codec", name, _codec_detail(codec, plugins.backends.values()))
    if "aura" in plugins.kv_codecs:
        table.add_row("kv-codec", "auraNvM", "recipes: N key bits, M value bits, each 2, 3, "
                      "4, 5, 6 or 8 (aura4v2 ...)")
    for fmt in plugins.tool_formats:
        table.add_row("tool-format", fmt.name, type(fmt).__module__)
    for name in plugins.resolver_names():
        table.add_row("resolver", name, "")
    for known in plugins.missing():
        table.add_row(known.kind, known.name,
                      f"[yellow]not installed[/yellow]: {known.package} ({known.install})")
    for failure in plugins.failures:
        table.add_row("[red]failed[/red]", failure.name, failure.reason)
    Console().print(table)
    return 0


def _codec_detail(codec, backends) -> str:
    """Bits per element and how each back end stores ``codec``."""
    runs = []
    for backend in sorted(backends, key=lambda b: b.name):
        storage = getattr(backend, "kv_storage", lambda _codec: None)(codec)
        runs.append(f"{backend.name}: {storage or 'served raw'}")
    return f"{codec.bits_per_element:g} bits/element; {codec.short()}; " + "; ".join(runs)


if __name__ == "__main__":
    sys.exit(main())
