"""Deploying butter on Ray Serve: the application graph, ``butter serve --replicas N``
and the argument form of ``serve run butter.ray:app model=... replicas=N``."""

from __future__ import annotations

import argparse
import copy
import logging
import os
import signal
import threading
from typing import Any

from butter.cli.common import UsageError, console
from butter.plugins import Plugins

log = logging.getLogger("butter.ray")

APP_NAME = "butter"
# How often Serve asks each replica for its load (record_routing_stats), in seconds.
ROUTING_STATS_PERIOD = 1.0
# A replica takes requests past its engine's sessions (they wait in its FIFO, as on one
# process); past this many Serve's router holds them back.
REPLICA_MAX_ONGOING = 256


def default_threads(replicas: int) -> int:
    """This machine's cores shared by the replicas, at least one each."""
    return max(1, (os.cpu_count() or 1) // replicas)


def prepare(args: argparse.Namespace, plugins: Plugins, *, listen: bool, local: bool
            ) -> tuple[argparse.Namespace, int]:
    """Check every flag as ``butter serve`` does; the flags the replicas get (``--threads``
    settled: this machine's cores shared when ``local``, else 1) and the CPUs each
    replica takes. Raises :class:`UsageError`."""
    from butter.cli.serve import check_flags

    args = copy.copy(args)
    args.replicas = args.replicas or 1
    loader, _access, _kv, _options = check_flags(args, plugins, listen=listen)
    backend = loader.check(loader.find(args.model, trusted=True)).backend
    if backend.takes_threads and args.threads is None:
        args.threads = default_threads(args.replicas) if local else 1
    return args, (args.threads if backend.takes_threads else 1)


def build_app(args: argparse.Namespace, cpus: int) -> Any:
    """The Serve application: an ingress over ``args.replicas`` engine replicas."""
    from ray.serve.config import RequestRouterConfig

    from butter.http.protocol import MAX_CONNECTIONS
    from butter.ray.deployments import ButterIngress, ButterReplica
    from butter.ray.router import PrefixAffinityRouter, TargetablePowerOfTwoRouter

    replica = ButterReplica.options(
        num_replicas=args.replicas,
        ray_actor_options={"num_cpus": cpus},
        max_ongoing_requests=REPLICA_MAX_ONGOING,
        health_check_period_s=2,
        request_router_config=RequestRouterConfig(
            request_router_class=(TargetablePowerOfTwoRouter if args.ray_router == "pow2"
                                  else PrefixAffinityRouter),
            request_router_kwargs={"imbalance": max(2, args.parallel)},
            request_routing_stats_period_s=ROUTING_STATS_PERIOD,
            request_routing_stats_timeout_s=5,
        ),
    )
    ingress = ButterIngress.options(ray_actor_options={"num_cpus": 0},
                                    max_ongoing_requests=MAX_CONNECTIONS)
    return ingress.bind(replica.bind(args), args)


def app_from_options(options: dict[str, Any]) -> Any:
    """``serve run butter.ray:app model=smollm2 replicas=2 threads=1``: each key is
    ``butter serve``'s flag without its dashes (``max_context`` or ``max-context``); a flag
    without a value takes ``true``."""
    from butter.cli.main import build_parser
    from butter.plugins import build_plugins

    argv = ["serve"]
    for key, value in options.items():
        flag = "--" + str(key).replace("_", "-")
        if value is True or str(value).lower() == "true":
            argv.append(flag)
        elif value is not False and str(value).lower() != "false":
            argv += [flag, str(value)]
    plugins = build_plugins()
    parser = build_parser(plugins)
    try:
        args = parser.parse_args(argv)
    except SystemExit:
        raise ValueError(f"butter.ray:app: bad arguments {options!r}") from None
    try:
        args, cpus = prepare(args, plugins, listen=False, local=False)
    except UsageError as error:
        raise ValueError(f"butter.ray:app: {error}") from None
    return build_app(args, cpus)


def run_replicas(args: argparse.Namespace, plugins: Plugins) -> int:
    """``butter serve --replicas N``: start (or join) Ray, deploy, serve until stopped."""
    try:
        import ray
        from ray import serve
    except ImportError:
        raise UsageError("--replicas", "needs Ray Serve: pip install 'butter-core[ray]'") \
            from None
    local = args.ray_address is None
    args, cpus = prepare(args, plugins, listen=True, local=local)
    if local and cpus * args.replicas > (os.cpu_count() or 1):
        raise UsageError("--replicas", f"{args.replicas} replicas of {cpus} CPU(s) each need "
                         f"{cpus * args.replicas} CPUs; this machine has {os.cpu_count()}")
    with console.status("Starting Ray…" if local else f"Joining Ray at {args.ray_address}…",
                        spinner="dots"):
        ray.init(address="local" if local else args.ray_address, include_dashboard=False,
                 logging_level=logging.WARNING, log_to_driver=args.log_level == "debug")
    try:
        if not local:
            available = ray.cluster_resources().get("CPU", 0)
            if cpus * args.replicas > available:
                raise UsageError("--replicas", f"{args.replicas} replicas of {cpus} CPU(s) "
                                 f"each need {cpus * args.replicas} CPUs; the cluster has "
                                 f"{available:g}")
        serve.start(http_options={"host": args.host, "port": args.port})
        with console.status(f"Deploying {args.replicas} replica(s) of "
                            f"[bold]{args.model}[/bold]…", spinner="dots"):
            serve.run(build_app(args, cpus), name=APP_NAME, route_prefix="/")
        console.print(f"Serving [bold]{args.model}[/bold] on {args.replicas} Ray Serve "
                      f"replica(s), {cpus} CPU(s) each, routed by prompt prefix",
                      highlight=False)
        console.print(f"Listening. Point an OpenAI client at "
                      f"[bold]http://{args.host}:{args.port}/v1[/bold]", highlight=False)
        _wait_for_signal()
        return 0
    finally:
        with console.status("Stopping…", spinner="dots"):
            if local:
                serve.shutdown()
            else:
                serve.delete(APP_NAME)
            ray.shutdown()


def _wait_for_signal() -> None:
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    # A timed wait: the kernel may hand the signal to one of Ray's threads, and Python runs
    # the handler only when the main thread next runs bytecode.
    while not stop.wait(0.5):
        pass
