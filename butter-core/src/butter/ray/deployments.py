"""The Ray Serve deployments of a butter application.

- :class:`ButterReplica`: one of N replicas, each running butter's own engine in-process
  (the ``ResidentServeBackend`` of ``butter serve``, built from the same checked flags)
  with request-driven swaps off: a request naming another model is a 404. Several models
  are several deployments of it, one per model, each under its own name.
- :class:`ButterIngress`: the thin HTTP ingress. Serve's proxy routes before it reads a
  body, so the prompt-aware choice happens here: the ingress runs butter's own litestar
  app (:func:`butter.http.app.create_app`) over a
  :class:`~butter.ray.remote.RemoteBackend`, which picks the deployment by the request's
  ``model`` and calls its replicas through a streaming ``DeploymentHandle`` routed by
  that deployment's :class:`~butter.ray.router.PrefixAffinityRouter`.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
from typing import Any

from ray import serve
from ray.serve.handle import DeploymentHandle

from butter.chat.request import ChatRequest
from butter.errors import ButterError
from butter.ray.launch import REPLICA
from butter.ray.remote import (
    Deployment,
    Failure,
    RemoteBackend,
    replica_stats,
    stream_generation,
)
from butter.ray.router import TARGET

log = logging.getLogger("butter.ray")

INGRESS = "ButterIngress"


def _plugins():
    from butter.plugins import build_plugins

    return build_plugins()


@serve.deployment(name=REPLICA)
class ButterReplica:
    """One engine. ``args`` are ``butter serve``'s parsed flags, already checked once by
    whoever deployed (the CLI or :func:`butter.ray.app`); checked again here, on the node
    that loads the model."""

    def __init__(self, args: argparse.Namespace) -> None:
        from butter.cli.common import setup_logging
        from butter.cli.serve import check_flags, resident_backend

        setup_logging(args.log_level)
        loader, _access, kv, options = check_flags(args, _plugins(), listen=False)
        self.backend = resident_backend(args, loader, kv, options, allow_swap=False)
        self.replica = serve.get_replica_context().replica_id.unique_id
        log.info("replica %s serving %s", self.replica, self.backend.model_id)

    async def generate(self, request: ChatRequest):
        async for item in stream_generation(self.backend, request, self.replica):
            yield item

    async def count_tokens(self, request: ChatRequest) -> int | Failure:
        try:
            return await self.backend.count_tokens(request)
        except ButterError as error:
            return Failure.of(error)

    def card(self) -> dict:
        return self.backend.model_card()

    def stats(self, **target: Any) -> dict[str, Any]:
        """This replica's counters and exposition (the ingress asks each by id)."""
        return replica_stats(self.backend, self.replica)

    def record_routing_stats(self) -> dict[str, Any]:
        """Load for the router: queue length and free KV (Serve polls this)."""
        stats = replica_stats(self.backend, self.replica)
        stats.pop("exposition")
        return stats

    def check_health(self) -> None:
        """A dead engine fails Serve's health check: Serve replaces the replica."""
        if not self.backend.healthy:
            raise RuntimeError("the engine thread has stopped")

    async def __del__(self) -> None:
        await self.backend.aclose()


@serve.deployment(name=INGRESS)
@serve.ingress()
class ButterIngress:
    """The HTTP surface: butter's app over each model's replica deployment."""

    async def __init__(self, models: list[DeploymentHandle], args: argparse.Namespace
                       ) -> None:
        """``models``: one replica deployment's handle per model, the first answering
        requests that name no model."""
        from butter.cli.serve import parse_origins
        from butter.http.access import AccessPolicy, is_loopback

        self.access = AccessPolicy(allowed_origins=parse_origins(args.allowed_origins),
                                   api_key=args.api_key, loopback_only=is_loopback(args.host))
        # Each first call creates that handle's router in this process (and waits for a
        # replica to be up): the cards every /v1/models answer is built from.
        cards = await asyncio.gather(*(handle.card.remote() for handle in models))
        self.backend = RemoteBackend([Deployment(handle, card)
                                      for handle, card in zip(models, cards)])

    def __serve_build_asgi_app__(self):
        from butter.http.app import create_app

        return create_app(self.backend, access=self.access)


__all__ = ["INGRESS", "REPLICA", "TARGET", "ButterIngress", "ButterReplica"]
