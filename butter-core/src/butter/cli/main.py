"""The ``butter`` command: ``serve``, ``pull``, ``serve-bench``, ``plugins``."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from rich.console import Console
from rich.table import Table

from butter.cli.common import (
    BACKEND_OPTION,
    DEFAULT_WINDOW_KEEP,
    MAX_BATCH,
    ModelsAction,
    Parser,
    UsageError,
    count,
    port,
    positive,
)
from butter.engine.planner import PREFILL_CHUNK
from butter.engine.promptcache import DEFAULT_MIB
from butter.errors import ButterError

if TYPE_CHECKING:
    from butter.plugins import Plugins

log = logging.getLogger("butter")

KV_CODECS_HELP = ("KV-cache codec: raw, affine8, affine4, aura or an auraNvM recipe "
                  "(see `butter plugins`)")


def build_parser(plugins: Plugins | None = None) -> argparse.ArgumentParser:
    parser = Parser(prog="butter", description="OpenAI- and Anthropic-compatible LLM server.")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=Parser)

    serve = commands.add_parser("serve", help="serve one model over HTTP")
    serve.add_argument("--model", required=True, action=ModelsAction,
                       help="GGUF path, alias (smollm2), or a Hugging Face id (owner/repo, "
                            "owner/repo:QUANT, owner/repo/file.gguf), downloaded if not "
                            "cached; repeatable with --replicas (one Ray Serve deployment "
                            "per model behind one address)")
    serve.set_defaults(models=())
    serve.add_argument("--alias", default=None, metavar="NAME",
                       help="the id /v1/models shows for --model (default: the alias or hub "
                            "id given, or a path's file name without extension); requests "
                            "may name either")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=port, default=8000)
    serve.add_argument("--parallel", type=positive, default=1,
                       help="maximum active generation sessions (the back end's limit: "
                            "GGUF 254); others wait FIFO")
    serve.add_argument("--max-context", type=positive, default=None,
                       help="KV positions shared by all sessions (GGUF: a multiple of 256), "
                            "at most the model's trained context (default: that context)")
    serve.add_argument("--threads", type=positive, default=None,
                       help="CPU threads for back ends that set them (default: all)")
    serve.add_argument("--backend", default=None, help="back end name (default: by model type)")
    serve.add_argument("--prefill-chunk", type=positive, default=PREFILL_CHUNK,
                       help=f"prompt tokens per prefill chunk, at most {MAX_BATCH}; chunks "
                            "start at multiples of it whatever else runs")
    serve.add_argument("--speculation", choices=("none", "ngram", "mtp"), default="ngram",
                       help="ngram (default): answers that repeat their context draft those "
                            "tokens (prompt lookup) and verify them in one pass, the same "
                            "tokens as without; mtp: the checkpoint's own multi-token-"
                            "prediction head drafts (Qwen3.5 folders with mtp.* weights, "
                            "MLX back end); none: never (a request's `speculation: "
                            "false` turns it off for that request)")
    serve.add_argument("--cache-ram", type=count, default=None, metavar="MIB",
                       help="host memory for the caches of prompts whose session another "
                            "prompt took; a later prompt that starts the same loads its "
                            "cache back instead of reading it (llama-server's --cache-ram; "
                            f"default {DEFAULT_MIB} where the back end can, 0: none)")
    serve.add_argument("--enable-thinking", action=argparse.BooleanOptionalAction, default=None)
    serve.add_argument("--reasoning-effort", choices=("low", "medium", "high"), default=None)
    serve.add_argument("--kv-cache", default="raw", help=KV_CODECS_HELP)
    serve.add_argument("--aura-decode-path", choices=("compressed", "dequant-mirror"),
                       default=None)
    serve.add_argument("--kv-window-size", type=positive, default=None, metavar="N",
                       help="keep at most N positions per session: an answer runs past N "
                            "by dropping old positions (GGUF: llama.cpp's context shift)")
    serve.add_argument("--kv-window-keep", type=count, default=None, metavar="S",
                       help=f"with --kv-window-size, the first S positions never leave "
                            f"(attention sinks; default {DEFAULT_WINDOW_KEEP})")
    serve.add_argument("--no-swap", action="store_true",
                       help="answer 404 to requests naming another model instead of swapping")
    serve.add_argument("--models-dir", action="append", default=[], metavar="DIR",
                       help="requests may swap in files and folders under DIR (repeatable)")
    serve.add_argument("--allow-any-path", action="store_true",
                       help="requests may swap in any model path the process can read")
    serve.add_argument("--allow-downloads", action="store_true",
                       help="requests may name a Hugging Face id not cached yet: it downloads "
                            "while the resident model serves, then swaps in (trusted clients)")
    serve.add_argument("--allowed-origins", default=None, metavar="LIST",
                       help="comma-separated browser origins allowed to call the server "
                            "(default: the localhost origins; '*' allows any)")
    serve.add_argument("--api-key", default=None,
                       help="require 'Authorization: Bearer KEY' (or x-api-key) on /v1/*")
    serve.add_argument("--log-level", default="info",
                       choices=("debug", "info", "warning", "error"))
    ray = serve.add_argument_group("scale-out on Ray Serve (pip install 'butter-core[ray]')")
    ray.add_argument("--replicas", type=positive, default=None, metavar="N",
                     help="serve N replicas of the model behind one address on Ray Serve, "
                          "routed by prompt prefix (each takes --threads CPUs)")
    ray.add_argument("--ray-address", default=None, metavar="ADDRESS",
                     help="join this Ray cluster (e.g. auto, or ray://host:10001) instead of "
                          "starting a local one; implies --replicas 1 unless given")
    ray.add_argument("--ray-router", choices=("prefix", "pow2"), default=None,
                     help="how the ingress picks a replica: prefix affinity with load "
                          "(default), or Serve's power-of-two choices (a baseline)")
    add_backend_options(serve, plugins)

    from butter.cli.pull import hub_id_argument

    pull = commands.add_parser("pull", help="download a Hugging Face model into the HF cache "
                               "without serving it")
    pull.add_argument("id", metavar="ID", type=hub_id_argument,
                      help="owner/repo, owner/repo:QUANT (a GGUF quant) or owner/repo/file.gguf")

    bench = commands.add_parser("serve-bench", help="benchmark a running server")
    try:
        from butter.bench import serve_bench
    except ImportError:
        serve_bench = None
    if serve_bench is not None:
        serve_bench.add_arguments(bench)

    commands.add_parser("plugins", help="list back ends, codecs, tool formats and resolvers")
    return parser


def add_backend_options(serve: argparse.ArgumentParser, plugins: Plugins | None) -> None:
    """Each back end's own settings, in a group under its name (``Backend.options``)."""
    for name, backend in sorted((plugins.backends if plugins else {}).items()):
        if not backend.options:
            continue
        group = serve.add_argument_group(f"{name} back end")
        for option in backend.options:
            kind = {"choices": option.choices} if option.choices else {"metavar": "VALUE"}
            default = f" (default {option.default})" if option.default is not None else ""
            try:
                group.add_argument(option.flag, dest=f"{BACKEND_OPTION}{name}:{option.name}",
                                   type=_parsed(option), default=None,
                                   help=option.help + default, **kind)
            except argparse.ArgumentError as error:  # two back ends claim one flag
                log.warning("back end %s: %s", name, error)


def _parsed(option):
    def parse(text: str) -> object:
        try:
            return option.parse(text)
        except (TypeError, ValueError) as error:
            raise argparse.ArgumentTypeError(str(error) or f"{text!r} is not valid") from None

    return parse


def main(argv: Sequence[str] | None = None) -> int:
    from butter.plugins import build_plugins

    plugins = build_plugins()
    parser = build_parser(plugins)
    args = parser.parse_args(argv)
    try:
        if args.command == "serve":
            from butter.cli.serve import run_serve

            return run_serve(args, plugins)
        if args.command == "pull":
            from butter.cli.pull import run_pull

            return run_pull(args)
        if args.command == "serve-bench":
            from butter.bench import serve_bench

            return serve_bench.run(args)
        return show_plugins(plugins)
    except UsageError as error:
        sys.stderr.write(f"butter {args.command}: error: {error}\n")
        return 2
    except ButterError as error:
        sys.stderr.write(f"butter: error: {error.message}\n")
        return 1
    except KeyboardInterrupt:
        return 130


def show_plugins(plugins: Plugins) -> int:
    table = Table(title="butter plugins")
    for column in ("kind", "name", "detail"):
        table.add_column(column)
    for name, backend in sorted(plugins.backends.items()):
        reason = backend.unavailable()
        detail = type(backend).__module__ if reason is None else f"unavailable: {reason}"
        table.add_row("backend", name, detail)
        for option in backend.options:
            table.add_row("", f"  {option.flag}", option.help)
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
        storage = backend.kv_storage(codec)
        runs.append(f"{backend.name}: {storage or 'served raw'}")
    return f"{codec.bits_per_element:g} bits/element; {codec.short()}; " + "; ".join(runs)


if __name__ == "__main__":
    sys.exit(main())
