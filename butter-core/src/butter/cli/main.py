"""The ``butter`` command: ``serve``, ``serve-bench``, ``plugins``."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from typing import Sequence

from rich.console import Console
from rich.logging import RichHandler
from rich.table import Table

from butter.errors import ButterError

console = Console(stderr=True)
log = logging.getLogger("butter")

KV_CODECS_HELP = "raw, affine8, affine4, aura or an auraNvM recipe"


class _Parser(argparse.ArgumentParser):
    """argparse that reports a bad flag in one line and exits 2, without usage spam."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message}\n")


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be at least 1")
    return value


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
                       help="maximum active generation sessions; others wait FIFO")
    serve.add_argument("--max-context", type=_positive, default=None,
                       help="KV positions shared by all sessions (default: the model's context)")
    serve.add_argument("--threads", type=_positive, default=None, help="CPU threads (default: all)")
    serve.add_argument("--backend", default=None, help="back end name (default: by model type)")
    serve.add_argument("--prefill-chunk", type=_positive, default=256,
                       help="prompt tokens per session per step while others decode")
    serve.add_argument("--ubatch-size", type=_positive, default=None, metavar="N",
                       help="rows per llama.cpp micro-batch, at most 512 (default 63: under "
                            "64 rows a request answers the same alone or batched on a fresh "
                            "cache; 512 prefills long prompts about 1.5x faster)")
    serve.add_argument("--enable-thinking", action=argparse.BooleanOptionalAction, default=None)
    serve.add_argument("--reasoning-effort", choices=("low", "medium", "high"), default=None)
    serve.add_argument("--kv-cache", default="raw", help=KV_CODECS_HELP)
    serve.add_argument("--aura-decode-path", choices=("compressed", "dequant-mirror"),
                       default="compressed")
    serve.add_argument("--kv-window-size", type=_positive, default=None)
    serve.add_argument("--kv-window-keep", type=_positive, default=None)
    serve.add_argument("--no-swap", action="store_true",
                       help="answer 404 to requests naming another model instead of swapping")
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
            if args.kv_window_keep is not None and args.kv_window_size is None:
                parser.exit(2, "butter serve: error: --kv-window-keep needs --kv-window-size\n")
            from butter.cli.serve import run_serve

            return run_serve(args)
        if args.command == "serve-bench":
            from butter.bench import serve_bench

            return serve_bench.run(args)
        return show_plugins()
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
        table.add_row("backend", name, type(backend).__module__)
    for name, codec in sorted(plugins.kv_codecs.items()):
        table.add_row("kv-codec", name, type(codec).__module__)
    for fmt in plugins.tool_formats:
        table.add_row("tool-format", fmt.name, type(fmt).__module__)
    for name in plugins.resolver_names():
        table.add_row("resolver", name, "")
    for failure in plugins.failures:
        table.add_row("[red]failed[/red]", failure.name, failure.reason)
    Console().print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
