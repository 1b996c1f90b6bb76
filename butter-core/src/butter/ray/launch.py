"""Deploying butter on Ray Serve: the application graph (one replica deployment per
model behind one ingress), ``butter serve --replicas N [--model M]...`` and the argument
form of ``serve run butter.ray:app model=A[,B] replicas=N``."""

from __future__ import annotations

import argparse
import copy
import logging
import os
import re
import signal
import threading
from typing import Any

import attrs

from butter.cli.common import UsageError, console
from butter.plugins import Plugins

log = logging.getLogger("butter.ray")

# The replica deployment's name when one model is served (several: one per model).
REPLICA = "ButterReplica"
APP_NAME = "butter"
# How often Serve asks each replica for its load (record_routing_stats), in seconds.
ROUTING_STATS_PERIOD = 1.0
# A replica takes requests past its engine's sessions (they wait in its FIFO, as on one
# process); past this many Serve's router holds them back.
REPLICA_MAX_ONGOING = 256


def default_threads(replicas: int) -> int:
    """This machine's cores shared by ``replicas`` engine replicas (of every model), at
    least one each."""
    return max(1, (os.cpu_count() or 1) // replicas)


@attrs.frozen
class ModelPlan:
    """One served model: its own replica deployment of ``args.replicas`` replicas."""

    args: argparse.Namespace  # the flags its replicas get (``model`` is this model)
    cpus: int  # CPUs each of its replicas takes from Ray
    model_id: str  # the id it is served as (its card's, what a request names)
    deployment: str  # its replica deployment's name


def deployment_name(model_id: str, taken: set[str]) -> str:
    """``ButterReplica-<model id>``: Serve names a deployment in its logs, actors and
    dashboard; characters it or Prometheus would trip on become ``-``."""
    name = f"{REPLICA}-{re.sub(r'[^A-Za-z0-9_.-]+', '-', model_id).strip('-')}"
    unique, n = name, 2
    while unique in taken:  # two ids that differ only in such characters
        unique, n = f"{name}-{n}", n + 1
    return unique


def prepare(args: argparse.Namespace, plugins: Plugins, *, listen: bool, local: bool
            ) -> list[ModelPlan]:
    """Check every flag as ``butter serve`` does, for each ``--model``: one plan per model,
    in the order given (the first serves requests that name no model). ``--threads`` is
    settled: this machine's cores shared by every replica when ``local``, else 1. Raises
    :class:`UsageError`."""
    from butter.cli.serve import check_flags

    args = copy.copy(args)
    args.replicas = args.replicas or 1
    models = list(args.models or (args.model,))
    if len(models) > 1 and args.alias is not None:
        raise UsageError("--alias", "names the one --model; with several, each is served "
                         "under its own id (its alias, hub id or file name)")
    plans: list[ModelPlan] = []
    for index, model in enumerate(models):
        one = copy.copy(args)
        one.model, one.models = model, (model,)
        loader, _access, _kv, _options = check_flags(one, plugins, listen=listen and not index)
        checked = loader.check(loader.find(model, trusted=True))
        if checked.backend.takes_threads and one.threads is None:
            one.threads = default_threads(args.replicas * len(models)) if local else 1
        served = one.alias or checked.model_id
        if any(plan.model_id == served for plan in plans):
            raise UsageError("--model", f"{model!r} is served as {served!r}, which an "
                             f"earlier --model already is")
        name = REPLICA if len(models) == 1 else deployment_name(
            served, {plan.deployment for plan in plans})
        plans.append(ModelPlan(one, one.threads if checked.backend.takes_threads else 1,
                               served, name))
    return plans


def cpus_needed(plans: list[ModelPlan], available: float, where: str) -> None:
    """Refuse more replica CPUs than ``where`` has (raises :class:`UsageError`)."""
    replicas = plans[0].args.replicas
    need = sum(plan.cpus * replicas for plan in plans)
    if need <= available:
        return
    if len(plans) == 1:
        asked = f"{replicas} replicas of {plans[0].cpus} CPU(s) each need {need} CPUs"
    else:
        each = sorted({plan.cpus for plan in plans})
        asked = (f"{len(plans)} models × {replicas} replicas of "
                 f"{'/'.join(map(str, each))} CPU(s) each need {need} CPUs")
    raise UsageError("--replicas", f"{asked}; {where} has {available:g}")


# Ray Serve's proxy checks (seconds) on the local cluster ``--replicas`` starts.
PROXY_PATIENCE = {"RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "30",
                  "RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S": "30"}


def build_app(plans: list[ModelPlan]) -> Any:
    """The Serve application: one ingress over one replica deployment per model (Ray
    Serve LLM's ``build_openai_app`` shape), each with its own prefix router."""
    from ray.serve.config import RequestRouterConfig

    from butter.http.protocol import MAX_CONNECTIONS
    from butter.ray.deployments import ButterIngress, ButterReplica
    from butter.ray.router import PrefixAffinityRouter, TargetablePowerOfTwoRouter

    deployments = []
    for plan in plans:
        args = plan.args
        deployments.append(ButterReplica.options(
            name=plan.deployment,
            num_replicas=args.replicas,
            ray_actor_options={"num_cpus": plan.cpus},
            max_ongoing_requests=REPLICA_MAX_ONGOING,
            health_check_period_s=2,
            request_router_config=RequestRouterConfig(
                request_router_class=(TargetablePowerOfTwoRouter if args.ray_router == "pow2"
                                      else PrefixAffinityRouter),
                request_router_kwargs={"imbalance": max(2, args.parallel)},
                request_routing_stats_period_s=ROUTING_STATS_PERIOD,
                request_routing_stats_timeout_s=5,
            ),
        ).bind(args))
    ingress = ButterIngress.options(ray_actor_options={"num_cpus": 0},
                                    max_ongoing_requests=MAX_CONNECTIONS)
    return ingress.bind(deployments, plans[0].args)


def options_argv(options: dict[str, Any]) -> list[str]:
    """``butter serve``'s command line for Serve's application arguments (see
    :func:`app_from_options`)."""
    argv = ["serve"]
    for key, value in options.items():
        flag = "--" + str(key).replace("_", "-")
        if flag == "--model" and isinstance(value, str):
            value = [part.strip() for part in value.split(",")]
        for one in value if isinstance(value, list | tuple) else [value]:
            if one is True or str(one).lower() == "true":
                argv.append(flag)
            elif one is not False and str(one).lower() != "false":
                argv += [flag, str(one)]
    return argv


def app_from_options(options: dict[str, Any]) -> Any:
    """``serve run butter.ray:app model=smollm2 replicas=2 threads=1``: each key is
    ``butter serve``'s flag without its dashes (``max_context`` or ``max-context``); a flag
    without a value takes ``true``; a list (in a config file) repeats the flag. Several
    models are one comma-separated ``model`` (``model=smollm2,/models/b.gguf``), each its
    own deployment of ``replicas`` replicas."""
    from butter.cli.main import build_parser
    from butter.plugins import build_plugins

    plugins = build_plugins()
    parser = build_parser(plugins)
    try:
        args = parser.parse_args(options_argv(options))
    except SystemExit:
        raise ValueError(f"butter.ray:app: bad arguments {options!r}") from None
    try:
        plans = prepare(args, plugins, listen=False, local=False)
    except UsageError as error:
        raise ValueError(f"butter.ray:app: {error}") from None
    return build_app(plans)


def run_replicas(args: argparse.Namespace, plugins: Plugins) -> int:
    """``butter serve --replicas N``: start (or join) Ray, deploy, serve until stopped."""
    try:
        import ray
        from ray import serve
    except ImportError:
        raise UsageError("--replicas", "needs Ray Serve: pip install 'butter-core[ray]'") \
            from None
    local = args.ray_address is None
    plans = prepare(args, plugins, listen=True, local=local)
    replicas = plans[0].args.replicas
    if local:
        cpus_needed(plans, os.cpu_count() or 1, "this machine")
    if local:
        # Serve kills a proxy not ready in 5 s or failing three 10-s health checks: on a
        # busy small machine that drops every open stream. The local cluster (its
        # processes inherit this environment) gives it longer; a cluster of one's own
        # keeps its own settings.
        for name, seconds in PROXY_PATIENCE.items():
            os.environ.setdefault(name, seconds)
    with console.status("Starting Ray…" if local else f"Joining Ray at {args.ray_address}…",
                        spinner="dots"):
        ray.init(address="local" if local else args.ray_address, include_dashboard=False,
                 logging_level=logging.WARNING, log_to_driver=args.log_level == "debug")
    try:
        if not local:
            cpus_needed(plans, ray.cluster_resources().get("CPU", 0), "the cluster")
        serve.start(http_options={"host": args.host, "port": args.port})
        names = ", ".join(f"[bold]{plan.model_id}[/bold]" for plan in plans)
        with console.status(f"Deploying {replicas} replica(s) of {names}…", spinner="dots"):
            serve.run(build_app(plans), name=APP_NAME, route_prefix="/")
        for plan in plans:
            console.print(f"Serving [bold]{plan.model_id}[/bold] on {replicas} Ray Serve "
                          f"replica(s), {plan.cpus} CPU(s) each, routed by prompt prefix",
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
