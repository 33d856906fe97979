"""Donor-aware placement behind SMG, the SGLang gateway: a client-side routing key.

SMG pins a *routing key* to one worker (``--policy manual``, or any policy with
``--routing-key-override``) and places a new key by its own policy; it sends the key's later
requests to that worker while it is available and re-places the key when it is not (health
checks, circuit breaker). :class:`DonorRoutingKeys` chooses the key of each request an
application sends: the key of the earlier request (of this client) that shares the most of its
tokens, when one shares at least ``min_candidate_tokens``, else a fresh key. A probe then lands
on the instance that served its donor, and SMG does the placement; nothing here routes.

It keeps a :class:`~semblend_sglang.dispatch.DonorRouter` over the requests this client sent
(content-defined chunks, namespace-salted: never matches across model, LoRA, ``extra_key`` or
``cache_salt``; bounded in bytes). Staleness: an entry expires once this client has sent
``dispatch_expire_ratio`` x ``fleet_kv_tokens`` prompt tokens since (the fleet's KV pools,
summed: no instance can have kept it longer); and when SMG's answer names another worker for a
key than before (``x-smg-routed-worker-id``: the key moved, its instance died or restarted), the
key's earlier requests are forgotten: their KV is on the old worker.

Limits: it sees only this client's requests (several application replicas each see part of the
traffic, and a donor sent by another replica is not found); a key, once pinned, follows its
worker regardless of load (SMG's assignment balances new keys only). Deterministic; not
thread-safe (one per client thread, or a lock around it).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from .config import Config
from .dispatch import DonorRouter, Route
from .namespace import Namespace

ROUTING_KEY_HEADER = "X-SMG-Routing-Key"
"""The request header SMG's ``manual`` policy and its routing-key override read the key from."""
ROUTED_WORKER_HEADER = "x-smg-routed-worker-id"
"""The response header in which SMG names the worker (its URL) that served the request."""


@dataclass(frozen=True)
class KeyChoice:
    """:meth:`DonorRoutingKeys.choose`'s answer: the routing ``key`` to send, whether it is a
    donor's (``donor``; else fresh), and the tokens the donor shares (``shared_tokens``)."""

    key: str
    donor: bool
    shared_tokens: int
    route: Route = field(repr=False, compare=False)

    @property
    def headers(self) -> dict[str, str]:
        """The request headers that carry the key to SMG."""
        return {ROUTING_KEY_HEADER: self.key}


class DonorRoutingKeys:
    """Chooses SMG routing keys from the donors among this client's earlier requests.

    Call :meth:`choose` before sending a request and :meth:`record` once SMG answered (with
    the worker it named). ``fleet_kv_tokens``: the instances' KV pool sizes summed, for the
    expiry rule (None: entries expire only by the byte bound). ``config``: the dispatch
    settings (chunk size, byte bound, expiry ratio) and ``min_span_tokens`` /
    ``min_candidate_tokens``; defaults otherwise."""

    def __init__(
        self,
        config: Config | None = None,
        *,
        fleet_kv_tokens: int | None = None,
        key_prefix: str = "semblend-",
    ) -> None:
        self.router = DonorRouter(config or Config(), 1, fleet_kv_tokens)
        self._prefix = key_prefix
        self._next_key = 0
        self._key_of: dict[int, str] = {}  # remembered request -> its key
        self._handles: dict[str, list[int]] = {}  # key -> remembered requests
        self._worker: dict[str, str] = {}  # key -> the worker SMG last named
        self.moved_keys = 0
        """Keys whose worker changed (their earlier requests were forgotten)."""

    def choose(self, token_ids: Sequence[int] | np.ndarray, namespace: Namespace) -> KeyChoice:
        """The key for a request of ``token_ids`` in ``namespace``: its best donor's, or a fresh
        one. Changes nothing but the expiry of stale entries it meets."""
        route = self.router.choose(namespace, token_ids, [0.0])
        if route.donor is not None and route.donor in self._key_of:
            return KeyChoice(self._key_of[route.donor], True, route.shared_tokens, route)
        key = f"{self._prefix}{self._next_key}"
        self._next_key += 1
        return KeyChoice(key, False, 0, route)

    def record(
        self,
        choice: KeyChoice,
        token_ids: Sequence[int] | np.ndarray,
        namespace: Namespace,
        worker: str | None = None,
    ) -> None:
        """The request ``choice`` was made for was sent with its key and served by ``worker``
        (SMG's ``x-smg-routed-worker-id``; None: not known): remember it as a donor under the
        key. A key that SMG now serves on another worker first forgets its earlier requests."""
        key = choice.key
        if worker is not None:
            before = self._worker.get(key)
            if before is not None and before != worker:
                for handle in self._handles.pop(key, []):
                    self.router.forget(handle)
                    self._key_of.pop(handle, None)
                self.moved_keys += 1
            self._worker[key] = worker
        handle = self.router.record(namespace, token_ids, 0, choice.route)
        if handle is None:
            return
        self._key_of[handle] = key
        self._handles.setdefault(key, []).append(handle)
        if len(self._key_of) > 2 * len(self.router) + 64:
            self._prune()

    def _prune(self) -> None:
        """Drop the handles the router no longer remembers (expired or evicted by its byte
        bound) from the key maps, so that they stay within twice the router's size."""
        router = self.router
        self._key_of = {h: k for h, k in self._key_of.items() if h in router}
        self._handles = {}
        for handle, key in self._key_of.items():
            self._handles.setdefault(key, []).append(handle)
