"""``butter serve``: load the model (with progress), then serve it until stopped."""

from __future__ import annotations

import argparse
import asyncio
import logging

from butter.cli.main import console, setup_logging
from butter.http.app import ROUTES
from butter.http.server import ServeServer
from butter.library import Model, check_loadable, default_plugins
from butter.resolve import ResolvedModel
from butter.serving import ResidentServeBackend

log = logging.getLogger("butter.serve")


class Loader:
    """Loads a model id the way the CLI was told to (back end, threads)."""

    def __init__(self, *, backend: str | None, threads: int | None) -> None:
        self.backend = backend
        self.threads = threads

    def __call__(self, model_id: str) -> Model:
        return Model.load(model_id, backend=self.backend, threads=self.threads)

    def precheck(self, model_id: str) -> ResolvedModel:
        return check_loadable(model_id)


def run_serve(args: argparse.Namespace) -> int:
    setup_logging(args.log_level)
    if args.kv_cache != "raw":
        codecs = default_plugins().kv_codecs
        log.warning("KV codec %r is not available on this back end (known: %s); using raw",
                    args.kv_cache, ", ".join(sorted(codecs)) or "raw")
    with console.status(f"Loading [bold]{args.model}[/bold]…", spinner="dots"):
        resident = ResidentServeBackend(
            Loader(backend=args.backend, threads=args.threads), args.model,
            allow_swap=not args.no_swap,
            maximum_concurrent_requests=args.parallel,
            max_context=args.max_context,
            prefill_chunk=args.prefill_chunk,
            micro_batch=args.ubatch_size,
            enable_thinking=args.enable_thinking,
            reasoning_effort=args.reasoning_effort,
        )
    card = resident.model_card()
    details = card["butter"]
    console.print(
        f"Loaded [bold]{card['id']}[/bold] ({details['architecture']}, {details['backend']}) "
        f"context {card['context_length']}, parallel {details['parallel']}, "
        f"fused batching {'on' if details['fused_batching'] else 'off'}",
        highlight=False,
    )
    server = ServeServer(host=args.host, port=args.port, backend=resident,
                         close_backend_on_shutdown=True, on_listening=_announce)
    asyncio.run(server.run_forever())
    return 0


def _announce(server: ServeServer) -> None:
    for method, path in ROUTES:
        console.print(f"  {method:<5}{path}", highlight=False)
    console.print(f"Listening. Point an OpenAI client at [bold]{server.base_url}[/bold]",
                  highlight=False)
