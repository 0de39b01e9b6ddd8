"""Which engine replica takes a request: Ray Serve request routers (engine/replicas.py).

`PrefixRouter` sends a prompt to the replica most likely to hold its KV pages: the one that
was sent the longest run of the same leading tokens, in full blocks of the engine's page size
(a chat's next turn, a shared system prompt), unless that replica runs `imbalance` requests
more than the idlest; otherwise, and for a prompt no replica has seen, Ray's probe picks the
least loaded. `RayDefaultRouter` is Ray Serve's own (two random replicas, the less loaded),
kept for comparison. Both run in the endpoint's process, inside Ray's routing, and both
honour two hints a call passes as keyword arguments: `pin` (a replica's id: a call that must
reach one replica, such as its status) and `avoid` (replicas that refused it as full).
"""

from __future__ import annotations

import importlib
from collections import OrderedDict
from typing import Any

from ray.serve._private.request_router.pow_2_router import PowerOfTwoChoicesRequestRouter
from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

# the live replicas' ids by Serve application, as Ray last told the routers (the endpoint
# asks each of them for its status); written by the routers alone
LIVE: dict[str, tuple[str, ...]] = {}

Ranks = list[list[RunningReplica]]


def live() -> dict[str, tuple[str, ...]]:
    """LIVE itself: Ray hands the handle's process the router class pickled by value, whose
    methods see a copy of this module's globals, so they reach the record through the module
    that the endpoint imported."""
    return importlib.import_module(__name__).LIVE


class PrefixIndex:
    """The prompts' leading blocks of `block` tokens and the replicas each was sent to. A
    block's key hashes its tokens and every token before it, as the engine's prefix cache
    keys its pages, so one lookup a block follows the prompt down; at most `capacity` keys,
    the least recently sent forgotten first."""

    def __init__(self, block: int, capacity: int):
        self.block, self.capacity = block, capacity
        self.holders: OrderedDict[int, dict[str, None]] = OrderedDict()  # key -> replica ids

    def keys(self, ids: list[int]) -> list[int]:
        keys, key = [], 0
        for start in range(0, len(ids) - self.block + 1, self.block):
            key = hash((key, tuple(ids[start : start + self.block])))
            keys.append(key)
        return keys

    def add(self, ids: list[int], replica: str) -> None:
        for key in self.keys(ids):
            holders = self.holders.setdefault(key, {})
            holders[replica] = None
            self.holders.move_to_end(key)
        while len(self.holders) > self.capacity:
            self.holders.popitem(last=False)

    def depths(self, ids: list[int]) -> dict[str, int]:
        """Per replica, how many leading blocks of `ids` it was sent."""
        found: dict[str, int] = {}
        for depth, key in enumerate(self.keys(ids), start=1):
            if key not in self.holders:
                break
            found.update(dict.fromkeys(self.holders[key], depth))
        return found

    def drop(self, replica: str) -> None:
        for holders in self.holders.values():
            holders.pop(replica, None)


def _id(replica: RunningReplica) -> str:
    return replica.replica_id.unique_id


def _hint(request: PendingRequest | None, name: str) -> Any:
    return None if request is None else request.kwargs.get(name)


def _prompt(request: PendingRequest | None) -> list[int]:
    """A generate call's prompt token ids (its first argument); none for other calls."""
    if request is None or not request.args or not isinstance(request.args[0], list):
        return []
    return request.args[0]


class Hints(RequestRouter):
    """The hints both routers honour, and the record of the live replicas."""

    def pinned(self, candidates: list[RunningReplica], request: PendingRequest | None) -> Ranks:
        """The pinned replica alone where a call names one that lives; else nothing."""
        pin = _hint(request, "pin")
        return [[r for r in candidates if _id(r) == pin]] if pin is not None else []

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> Ranks:
        pinned = self.pinned(candidate_replicas, pending_request)
        if pinned and pinned[0]:
            return pinned
        ranks = await self.ranked(candidate_replicas, pending_request)
        return self.spared(ranks, pending_request)

    async def ranked(
        self, candidates: list[RunningReplica], request: PendingRequest | None
    ) -> Ranks:
        """The router's own ranks of the candidates, best first."""
        raise NotImplementedError

    def spared(self, ranks: Ranks, request: PendingRequest | None) -> Ranks:
        """`ranks` without the replicas a call avoids, unless none would be left."""
        avoid = set(_hint(request, "avoid") or ())
        kept = [[r for r in rank if _id(r) not in avoid] for rank in ranks]
        return kept if any(kept) else ranks

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        live()[self.app_name] = tuple(sorted(_id(r) for r in replicas))

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        ids = live().get(self.app_name, ())
        live()[self.app_name] = tuple(i for i in ids if i != replica_id.unique_id)


class PrefixRouter(Hints):
    """To the replica holding the prompt's deepest prefix while it is not overloaded."""

    def initialize_state(self, **kwargs: Any) -> None:
        """From RequestRouterConfig.request_router_kwargs: `block`, the engine's page size,
        `imbalance` and the index's `capacity` in keys."""
        self.index = PrefixIndex(kwargs.get("block", 16), kwargs.get("capacity", 1 << 16))
        self.imbalance: int = kwargs.get("imbalance", 4)

    async def ranked(
        self, candidates: list[RunningReplica], request: PendingRequest | None
    ) -> Ranks:
        """The replicas with the deepest prefix and load within `imbalance` of the idlest
        first, then the rest; Ray takes the least loaded of a rank that is not full."""
        depths = self.index.depths(_prompt(request))
        deepest = max((depths.get(_id(r), 0) for r in candidates), default=0)
        if deepest == 0:
            return [candidates]
        load = {_id(r): self.replica_queue_len_cache.get(r.replica_id) or 0 for r in candidates}
        idlest = min(load.values())
        first = [
            r
            for r in candidates
            if depths.get(_id(r), 0) == deepest and load[_id(r)] - idlest <= self.imbalance
        ]
        return [first, [r for r in candidates if r not in first]] if first else [candidates]

    def on_request_routed(
        self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any
    ) -> None:
        if prompt := _prompt(pending_request):
            self.index.add(prompt, replica_id.unique_id)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        gone = set(live().get(self.app_name, ())) - {_id(r) for r in replicas}
        super().update_replicas(replicas)
        for replica in gone:
            self.index.drop(replica)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.index.drop(replica_id.unique_id)


class RayDefaultRouter(Hints, PowerOfTwoChoicesRequestRouter):
    """Ray Serve's default routing, with the hints."""

    async def ranked(
        self, candidates: list[RunningReplica], request: PendingRequest | None
    ) -> Ranks:
        return await PowerOfTwoChoicesRequestRouter.choose_replicas(self, candidates, request)
