"""``butter serve``: check every flag, load the model (with progress), serve until stopped."""

from __future__ import annotations

import argparse
import asyncio
import errno
import logging
import re
import socket
from pathlib import Path

from butter.backend import Backend, KVSpec
from butter.cli.common import (
    BACKEND_OPTION,
    DEFAULT_WINDOW_KEEP,
    MAX_BATCH,
    UsageError,
    console,
    setup_logging,
)
from butter.cli.pull import fetch_model
from butter.engine.promptcache import DEFAULT_MIB
from butter.errors import ButterError
from butter.http.access import DEFAULT_ALLOWED_ORIGINS, AccessPolicy, is_loopback
from butter.http.app import ROUTES
from butter.http.server import ServeServer
from butter.kvcodec import InvalidCodecError
from butter.library import ModelLoader
from butter.plugins import Plugins
from butter.serving import ResidentServeBackend

log = logging.getLogger("butter.serve")

_ORIGIN = re.compile(r"^[a-z][a-z0-9+.-]*://[^/\s?#]+$", re.IGNORECASE)


def run_serve(args: argparse.Namespace, plugins: Plugins) -> int:
    setup_logging(args.log_level)
    if len(args.models) > 1 and args.replicas is None and args.ray_address is None:
        raise UsageError("--model", f"{len(args.models)} models given; one process serves "
                         f"one. Serve several behind one address with --replicas N (N Ray "
                         f"Serve replicas of each)")
    if args.replicas is not None or args.ray_address is not None:
        from butter.ray.launch import run_replicas  # Ray is imported only here

        return run_replicas(args, plugins)
    if args.ray_router is not None:
        raise UsageError("--ray-router", "applies to --replicas or --ray-address")
    loader, access, kv, options = check_flags(args, plugins)
    with console.status(f"Loading [bold]{args.model}[/bold]…", spinner="dots"):
        resident = resident_backend(args, loader, kv, options)
    card = resident.model_card()
    details = card["butter"]
    console.print(
        f"Loaded [bold]{card['id']}[/bold] ({details['architecture']}, {details['backend']}) "
        f"context {card['context_length']}, parallel {details['parallel']}, "
        f"fused batching {'on' if details['fused_batching'] else 'off'}",
        highlight=False,
    )
    server = ServeServer(host=args.host, port=args.port, backend=resident,
                         close_backend_on_shutdown=True, on_listening=_announce, access=access)
    asyncio.run(server.run_forever())
    return server.exit_code


def resident_backend(args: argparse.Namespace, loader: ModelLoader, kv: KVSpec,
                     options: dict[str, dict[str, object]], *,
                     allow_swap: bool | None = None) -> ResidentServeBackend:
    """The engine ``butter serve`` runs, built from its checked flags (one process, or
    each Ray Serve replica, which passes ``allow_swap=False``)."""
    return ResidentServeBackend(
        loader, args.model,
        allow_swap=not args.no_swap if allow_swap is None else allow_swap,
        alias=args.alias,
        maximum_concurrent_requests=args.parallel,
        max_context=args.max_context,
        prefill_chunk=args.prefill_chunk,
        speculation=args.speculation,
        cache_ram=DEFAULT_MIB if args.cache_ram is None else args.cache_ram,
        kv=kv,
        backend_options=options,
        enable_thinking=args.enable_thinking,
        reasoning_effort=args.reasoning_effort,
    )


def check_flags(args: argparse.Namespace, plugins: Plugins, *, listen: bool = True
                ) -> tuple[ModelLoader, AccessPolicy, KVSpec, dict[str, dict[str, object]]]:
    """Refuse any flag that cannot work, before anything loads (raises :class:`UsageError`).

    Returns the loader, the access policy, the KV spec and the chosen back end's own
    settings (keyed by its name, as ``ResidentServeBackend`` takes them). ``listen=False``
    skips the check that ``--host``/``--port`` are free (a Ray Serve replica listens on
    nothing; Serve's proxy holds the port)."""
    if args.kv_window_keep is not None and args.kv_window_size is None:
        raise UsageError("--kv-window-keep", "needs --kv-window-size")
    window, keep = args.kv_window_size, args.kv_window_keep
    if keep is None:
        keep = min(DEFAULT_WINDOW_KEEP, window - 1) if window else 0
    if window is not None and keep >= window:
        raise UsageError("--kv-window-keep", f"{keep} positions kept leave nothing of a "
                         f"{window}-position window to shift")
    try:
        codec = plugins.kv_codec(args.kv_cache)
    except InvalidCodecError as error:
        raise UsageError("--kv-cache", str(error)) from None
    if args.aura_decode_path is not None and codec.family != "aura":
        raise UsageError("--aura-decode-path", f"applies to AURA codecs, not {codec.name!r}")
    kv = KVSpec(codec=codec, decode_path=args.aura_decode_path or "compressed",
                window=window, keep=keep)
    if args.backend is not None and args.backend not in plugins.backends:
        raise UsageError("--backend", plugins.unknown_backend(args.backend))
    _at_most("--prefill-chunk", args.prefill_chunk, MAX_BATCH)
    for directory in args.models_dir:
        if not Path(directory).expanduser().is_dir():
            raise UsageError("--models-dir", f"{directory} is not a directory")
    if args.allow_downloads and args.no_swap:
        raise UsageError("--allow-downloads", "a request cannot swap in what it pulls with "
                         "--no-swap")
    if args.alias is not None and not args.alias.strip():
        raise UsageError("--alias", "the name is empty")
    if args.api_key is not None and not args.api_key.strip():
        raise UsageError("--api-key", "the key is empty")
    access = AccessPolicy(allowed_origins=parse_origins(args.allowed_origins),
                          api_key=args.api_key, loopback_only=is_loopback(args.host))
    if listen:
        check_listen(args.host, args.port)
    loader = ModelLoader(backend=args.backend, threads=args.threads,
                         models_dirs=args.models_dir, allow_any_path=args.allow_any_path,
                         allow_downloads=args.allow_downloads, plugins=plugins)
    fetch_model(loader, args.model)  # the last check: no flag above costs a download
    try:
        checked = loader.check(loader.find(args.model, trusted=True))
    except ButterError as error:
        raise UsageError("--model", error.message) from None
    backend = checked.backend
    if args.speculation == "mtp" and checked.facts.no_draft_head:
        raise UsageError("--speculation", f"mtp drafts with the checkpoint's own multi-token-"
                         f"prediction head, and {backend.name} cannot: "
                         f"{checked.facts.no_draft_head}")
    options = _backend_options(args, backend, plugins)
    limits = backend.limits
    _at_most("--parallel", args.parallel, limits.max_parallel)
    if args.threads is not None and not backend.takes_threads:
        raise UsageError("--threads", f"the {backend.name} back end sets no thread count")
    _at_most("--threads", args.threads, limits.max_threads)
    granule = limits.context_granule
    if args.max_context is not None and args.max_context % granule:
        raise UsageError("--max-context", f"{args.max_context} is not a multiple of {granule}")
    if kv.decode_path not in backend.decode_paths:
        raise UsageError("--aura-decode-path", f"the {backend.name} back end attends on its "
                         f"cache as stored; it has no {kv.decode_path} path")
    if window is not None and not backend.kv_windows:
        raise UsageError("--kv-window-size", f"the {backend.name} back end has no KV window "
                         "in this build")
    trained = checked.facts.context_length
    # A KV stream per session (the GGUF default) gives each --max-context / --parallel.
    layout = backend.session_layout(options, args.parallel)
    streams = layout.streams
    if args.max_context is not None and trained and args.max_context > trained * streams:
        each = " per session" if streams > 1 else ""
        raise UsageError("--max-context", f"{args.max_context} gives more{each} than the "
                         f"model's trained context ({trained})")
    if window is not None:
        _check_window(args, window, trained, streams)
    if args.cache_ram and (window is not None or not layout.prompt_cache):
        raise UsageError("--cache-ram", f"the {backend.name} back end keeps no prompt cache "
                         "in host memory with these settings (GGUF: per-session KV streams; "
                         "no KV window)")
    return loader, access, kv, {backend.name: options}


def _backend_options(args: argparse.Namespace, backend: Backend,
                     plugins: Plugins) -> dict[str, object]:
    """The settings given for ``backend``, each checked; another back end's cannot work."""
    options: dict[str, object] = {}
    for dest, value in vars(args).items():
        if not dest.startswith(BACKEND_OPTION) or value is None:
            continue
        owner, name = dest[len(BACKEND_OPTION):].split(":", 1)
        option = next(o for o in plugins.backends[owner].options if o.name == name)
        if owner != backend.name:
            raise UsageError(option.flag, f"is a setting of the {owner} back end; this model "
                             f"runs on {backend.name}")
        reason = option.check(value)
        if reason is not None:
            raise UsageError(option.flag, reason)
        options[name] = value
    return options


def _check_window(args: argparse.Namespace, window: int, trained: int | None,
                  streams: int) -> None:
    if trained and window > trained:
        raise UsageError("--kv-window-size", f"{window} is more than the model's trained "
                         f"context ({trained})")
    total = args.max_context or trained  # the engine's default context: the trained one
    cells = total // streams if total else None
    if cells is not None and window > cells:
        each = " per session" if streams > 1 else ""
        raise UsageError("--kv-window-size", f"{window} is more than the {cells} cells{each} "
                         "--max-context gives")


def _at_most(flag: str, value: int | None, limit: int | None) -> None:
    if value is not None and limit is not None and value > limit:
        raise UsageError(flag, f"{value} is more than {limit}")


def parse_origins(text: str | None) -> tuple[str, ...]:
    """``--allowed-origins``: comma-separated origins, ``scheme://host:*`` or ``*``."""
    if text is None:
        return DEFAULT_ALLOWED_ORIGINS
    origins = tuple(item.strip() for item in text.split(",") if item.strip())
    for origin in origins:
        if origin != "*" and not _ORIGIN.match(origin):
            raise UsageError("--allowed-origins", f"{origin!r} is not an origin like "
                             "http://host:port")
    return origins


def check_listen(host: str, port: int) -> None:
    """Fail now, not after loading, when ``host:port`` cannot be listened on."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (socket.gaierror, UnicodeError):
        raise UsageError("--host", f"cannot resolve {host!r}") from None
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(address)
        except OSError as exc:
            flag = "--port" if exc.errno in (errno.EADDRINUSE, errno.EACCES) else "--host"
            raise UsageError(flag, f"cannot listen on {host}:{port}: {exc.strerror}") from None


def _announce(server: ServeServer) -> None:
    for method, path in ROUTES:
        console.print(f"  {method:<5}{path}", highlight=False)
    console.print(f"Listening. Point an OpenAI client at [bold]{server.base_url}[/bold]",
                  highlight=False)
