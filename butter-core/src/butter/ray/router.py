"""``PrefixAffinityRouter``: a Ray Serve request router that keeps a prompt's prefix on
the replica whose KV already holds it, without letting one replica drown.

Ray's own ``PrefixCacheAffinityRouter`` (``ray.llm._internal...prefix_aware``) was read
and not used: its public import path pulls ``pyarrow`` (``ray[llm]`` pins vLLM), it keeps
its tree in a detached actor (one more process and one actor call per routed request),
it reads ``.messages`` as plain strings, and it weighs load by queue length alone with an
infinite default imbalance threshold. This router keeps its table in the handle's own
process (the ingress), keys on the rendered order of the prompt (system, tools, then the
conversation; Anthropic's top-level ``system`` arrives as the first system message), and
weighs queue length and free KV from each replica's ``record_routing_stats``.

The decision, per request:

1. Load of a replica: requests this router has in flight on it (or just chose for it);
   for a replica it has sent nothing to lately, the queue the replica last reported; plus
   ``imbalance`` when it reports less than ``min_free_kv`` of its KV free (a report no
   older than this router's own count: it has requests there, and the report shows no
   more active). Replicas more than ``imbalance`` above the least loaded are passed over.
2. Among the rest, the one holding the longest prefix of the key (in ``block_chars``
   blocks, hashed in a chain as a paged KV cache does) wins; ties go to the least
   loaded.
3. A key matching less than ``min_match`` of its blocks anywhere is a new tenant: it goes
   to the least loaded replica, ties to the one holding the least (spreads tenants).

The first choice is ranked alone, the others follow by load, so Serve's own back-off
(a full replica) falls through to the next best.
"""

from __future__ import annotations

import json
import logging
import random
import time
from collections import OrderedDict
from typing import Any

from ray.serve._private.request_router import PowerOfTwoChoicesRequestRouter
from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from butter.chat.request import ChatRequest

log = logging.getLogger("butter.ray")

# Seconds a choice counts as load before Serve confirms it (or the request went away).
CHOSEN_TTL = 2.0

# Seconds after this router's last request on a replica before that replica's reported
# queue counts again (Serve polls record_routing_stats every second).
STATS_STALE = 3.0

# The replica method whose requests fill a KV cache: the only one routed by prefix.
ROUTED_METHOD = "generate"

# The keyword a handle call carries to reach one replica by its id (stats, metrics).
TARGET = "butter_replica"


def routing_key(request: Any) -> str:
    """The prompt in the order the chat template renders it: system, tools, messages.

    Raw completions key on their prompt text (or token ids). Anything that is not a
    :class:`~butter.chat.request.ChatRequest` keys on nothing (``""``): it routes by load
    alone.
    """
    if not isinstance(request, ChatRequest):
        return ""
    if request.raw_prompt is not None:
        return request.raw_prompt
    if request.prompt_tokens is not None:
        return " ".join(map(str, request.prompt_tokens))
    system = [m for m in request.messages if m.get("role") in ("system", "developer")]
    rest = [m for m in request.messages if m.get("role") not in ("system", "developer")]
    parts = [_text(m) for m in system]
    if request.tools:
        parts.append(json.dumps(request.tools, sort_keys=True, separators=(",", ":")))
    parts.extend(_text(m) for m in rest)
    return "\x1e".join(parts)


def _text(message: dict[str, Any]) -> str:
    content = message.get("content")
    if not isinstance(content, str):
        content = json.dumps(content, sort_keys=True, separators=(",", ":"))
    calls = message.get("tool_calls")
    if calls:
        content += json.dumps(calls, sort_keys=True, separators=(",", ":"))
    return f"{message.get('role')}\x1f{content}"


def block_hashes(key: str, block_chars: int) -> list[int]:
    """Chained hashes of ``key``'s whole blocks: equal leading hashes, equal prefix."""
    hashes: list[int] = []
    previous = 0
    for start in range(0, len(key) - block_chars + 1, block_chars):
        previous = hash((previous, key[start:start + block_chars]))
        hashes.append(previous)
    return hashes


class PrefixTable:
    """The block hashes one replica is believed to hold, least recently used first."""

    def __init__(self, max_blocks: int) -> None:
        self.max_blocks = max_blocks
        self._blocks: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def matched(self, hashes: list[int]) -> int:
        """How many leading blocks of ``hashes`` this replica holds."""
        count = 0
        for value in hashes:
            if value not in self._blocks:
                break
            count += 1
        return count

    def insert(self, hashes: list[int]) -> None:
        for value in hashes:
            self._blocks[value] = None
            self._blocks.move_to_end(value)
        while len(self._blocks) > self.max_blocks:
            self._blocks.popitem(last=False)


class PrefixAffinityRouter(RequestRouter):
    """Prefix affinity with load still counting (see the module's docstring)."""

    def initialize_state(self, block_chars: int = 128, imbalance: int = 4,
                         min_match: float = 0.1, min_free_kv: float = 0.05,
                         max_blocks: int = 16384) -> None:
        self.block_chars = block_chars
        self.imbalance = imbalance
        self.min_match = min_match
        self.min_free_kv = min_free_kv
        self.max_blocks = max_blocks
        self._tables: dict[ReplicaID, PrefixTable] = {}
        self._inflight: dict[ReplicaID, int] = {}
        self._counted: dict[str, ReplicaID] = {}  # internal request id -> replica
        # Chosen but not yet dispatched (Serve confirms a choice only after the replica
        # accepted it): counted as load for a moment, so a burst does not all go to the
        # replica that looked idlest.
        self._chosen: dict[str, tuple[ReplicaID, float]] = {}
        self._last_seen: dict[ReplicaID, float] = {}  # when a request of ours last ended
        self._streams: set[str] = set()  # generate calls in flight, released by the ingress
        self._hashes: dict[str, list[int]] = {}  # internal request id -> its key's blocks
        self.decisions = {"affinity": 0, "new": 0, "imbalanced": 0, "targeted": 0}
        if self._deployment_id is not None:
            # Imported here: Serve pickles this module by value (see butter.ray.registry).
            from butter.ray.registry import ROUTERS

            ROUTERS[self._deployment_id.name] = self

    @property
    def replica_ids(self) -> list[str]:
        """The unique ids of the replicas this router may send to now."""
        return sorted(replica_id.unique_id for replica_id in self._replicas)

    @property
    def inflight(self) -> dict[str, int]:
        """Requests this router has on each replica now (the load it routes by)."""
        return {rid.unique_id: self._inflight.get(rid, 0) for rid in self._replicas}

    def load(self, replica: RunningReplica, now: float | None = None) -> int:
        """Requests on ``replica``: this router's own (exact), else what it reported.

        The reported queue (``record_routing_stats``, every second) is stale by up to a
        period: right after a burst it still shows the burst. It counts only for a replica
        this router has had nothing to do with for a while (load sent by other ingress
        replicas or handles). Little free KV adds ``imbalance``: pass it over."""
        now = time.monotonic() if now is None else now
        rid = replica.replica_id
        chosen = sum(1 for chosen_rid, at in self._chosen.values()
                     if chosen_rid == rid and now - at < CHOSEN_TTL)
        own = self._inflight.get(rid, 0) + chosen
        stats = replica.routing_stats or {}
        quiet = now - self._last_seen.get(rid, -STATS_STALE) >= STATS_STALE
        load = max(own, int(stats.get("queue", 0))) if own == 0 and quiet else own
        # Little free KV counts only while the report is no older than what this router
        # knows: it has requests there and the report shows no more active than that.
        # A report from a busier moment (Serve polls each second) would pass the
        # replica over once its requests had ended, and move its tenants off it.
        free = stats.get("free_kv")
        current = 0 < own and int(stats.get("active", 0)) <= own
        if free is not None and free < self.min_free_kv and current:
            load += self.imbalance
        return load

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None
                              ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        if len(self._tables) > len(self._replicas):
            for gone in [rid for rid in self._tables if rid not in self._replicas]:
                self._forget(gone)  # replaced: its KV went with it
        kwargs = pending_request.kwargs if pending_request is not None else {}
        if pending_request is not None:
            # Every replica worth trying is ranked below: when none takes the request,
            # Serve must back off before asking again, not spin.
            pending_request.routing_context.should_backoff = True
        target = kwargs.get(TARGET)
        if target is not None:
            self.decisions["targeted"] += 1
            return [[r for r in candidate_replicas if r.replica_id.unique_id == target]]
        now = time.monotonic()
        for request_id in [k for k, (_, at) in self._chosen.items() if now - at >= CHOSEN_TTL]:
            del self._chosen[request_id]
        loads = {r.replica_id: self.load(r, now) for r in candidate_replicas}
        # Equal loads in random order: ties must not all fall to the first replica.
        shuffled = random.sample(candidate_replicas, len(candidate_replicas))
        by_load = sorted(shuffled, key=lambda r: loads[r.replica_id])
        if (pending_request is None or not pending_request.args
                or pending_request.metadata.call_method != ROUTED_METHOD):
            return [[r] for r in by_load]  # count_tokens, the card: load alone
        hashes = block_hashes(routing_key(pending_request.args[0]), self.block_chars)
        self._hashes[pending_request.metadata.internal_request_id] = hashes
        least = loads[by_load[0].replica_id]
        eligible = [r for r in by_load if loads[r.replica_id] - least <= self.imbalance]
        matched = {r.replica_id: self._table(r.replica_id).matched(hashes) for r in eligible}
        best = max(eligible, key=lambda r: (matched[r.replica_id], -loads[r.replica_id]))
        if hashes and matched[best.replica_id] >= self.min_match * len(hashes):
            self.decisions["affinity"] += 1
            first = best
            if len(eligible) < len(by_load):
                # The busiest were passed over; note it when they held a longer prefix.
                top = max(self._table(r.replica_id).matched(hashes) for r in by_load)
                if top > matched[best.replica_id]:
                    self.decisions["imbalanced"] += 1
        else:
            self.decisions["new"] += 1
            first = min(eligible, key=lambda r: (loads[r.replica_id],
                                                 len(self._table(r.replica_id))))
        self._chosen[pending_request.metadata.internal_request_id] = (first.replica_id, now)
        log.info("route %s (%d blocks): %s; loads %s, matched %s", hashes[:1], len(hashes),
                  first.replica_id.unique_id,
                  {r.replica_id.unique_id: v for r, v in zip(by_load, map(
                      lambda r: loads[r.replica_id], by_load))},
                  {rid.unique_id: m for rid, m in matched.items()})
        return [[first], *[[r] for r in by_load if r is not first]]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID,
                          result: Any) -> None:
        request_id = pending_request.metadata.internal_request_id
        hashes = self._hashes.pop(request_id, None)
        self._chosen.pop(request_id, None)
        if TARGET in pending_request.kwargs:
            return
        self._inflight[replica_id] = self._inflight.get(replica_id, 0) + 1
        self._counted[request_id] = replica_id
        if pending_request.metadata.call_method == ROUTED_METHOD:
            # A stream counts until the ingress says it ended (release): Serve's
            # completion callback was seen to come early for streaming calls.
            self._streams.add(request_id)
        if hashes:
            self._table(replica_id).insert(hashes)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        if internal_request_id in self._streams:
            return  # released by the ingress when the stream ends
        self.release(internal_request_id)

    def release(self, internal_request_id: str) -> None:
        """The request ended (the ingress read its last record, or gave up on it)."""
        self._streams.discard(internal_request_id)
        counted = self._counted.pop(internal_request_id, None)
        self._hashes.pop(internal_request_id, None)
        self._chosen.pop(internal_request_id, None)
        if counted is not None:
            self._inflight[counted] = max(0, self._inflight.get(counted, 0) - 1)
            self._last_seen[counted] = time.monotonic()

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._forget(replica_id)

    def _forget(self, replica_id: ReplicaID) -> None:
        """A replica that died took its KV with it: route nothing by its old table."""
        self._tables.pop(replica_id, None)
        self._inflight.pop(replica_id, None)
        self._last_seen.pop(replica_id, None)

    def _table(self, replica_id: ReplicaID) -> PrefixTable:
        table = self._tables.get(replica_id)
        if table is None:
            table = self._tables[replica_id] = PrefixTable(self.max_blocks)
        return table


class TargetablePowerOfTwoRouter(PowerOfTwoChoicesRequestRouter):
    """Serve's default power-of-two router, as it is, plus calls aimed at one replica by
    id (``/metrics`` asks each): ``--ray-router pow2``, the baseline the prefix router is
    measured against. Its FIFO matching may hand an aimed call to another replica; the
    ingress then retries that replica."""

    def initialize_state(self, **_ignored: Any) -> None:
        self.decisions = {"pow2": 0, "targeted": 0}
        if self._deployment_id is not None:
            from butter.ray.registry import ROUTERS

            ROUTERS[self._deployment_id.name] = self

    @property
    def replica_ids(self) -> list[str]:
        return sorted(replica_id.unique_id for replica_id in self._replicas)

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None
                              ) -> list[list[RunningReplica]]:
        target = pending_request.kwargs.get(TARGET) if pending_request is not None else None
        if target is None:
            self.decisions["pow2"] += 1
            return await super().choose_replicas(candidate_replicas, pending_request)
        self.decisions["targeted"] += 1
        pending_request.routing_context.should_backoff = True
        return [[r for r in candidate_replicas if r.replica_id.unique_id == target]]
