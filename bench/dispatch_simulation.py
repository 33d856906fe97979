"""Bench job ``dispatch``: replay 10,000+ requests through data-parallel dispatch logic alone.

No engine runs. Each request is made of content units (a document, RAG passages, a template, a
conversation's turns) whose tokens are drawn from a seeded generator, so donors share exact token
content with their probes the way the bench workloads' requests do. Ranks are modelled by what
decides a hit and what a dispatcher sees:

- a KV cache per rank: least-recently-used units up to ``--rank-capacity`` tokens (the truth a
  dispatcher only estimates);
- a queue per rank: each dispatched request adds its prefill work (prompt tokens minus the
  tokens reused from the rank's cache) plus ``--decode-cost`` tokens, and each rank works off
  ``service`` tokens per arrival, chosen so the cluster runs at ``--utilization`` of its cold
  capacity. The queue is the load a dispatcher reads (SGLang's ``DPBudget.total_tokens``).

A request hits when its rank's cache holds a unit of at least ``min_reuse_tokens`` of its tokens
(what one reused span needs by default); ``reused`` counts all its resident units' tokens.
Dispatchers: SGLang's ``round_robin`` and ``total_tokens`` (least queued tokens; lowest rank on a
tie), and semblend's :class:`~semblend_sglang.dispatch.DonorRouter` falling back to each of them
(``donor+rr``, ``donor+tt``). ``single`` is one rank with all N ranks' cache, the hit rate that
dispatch can at best preserve. Imbalance is the time-averaged longest queue over the time-averaged
mean queue (tokens), each method run at the same utilization of its own work. Dispatch cost is
the router's ``choose`` + ``record`` per request.
"""

from __future__ import annotations

import json
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import click
import numpy as np

from ..config import Config
from ..dispatch import DonorRouter
from ..namespace import Namespace
from .metrics import percentile

KINDS = ("cross_instruction", "template", "multi_turn", "rag")
METHODS = ("round_robin", "total_tokens", "prefix+tt", "donor+rr", "donor+tt", "donor_sticky")
"""``prefix+tt``: the rank whose cache holds the longest exact prefix (whole leading units, read
off the true caches as an event-fed indexer would: SMG cache_aware, Dynamo's KV router,
llm-d's prefix scorer), within the load margin, else total_tokens. ``donor_sticky``: the
donor's rank whatever its load (a routing key pinned by SMG's manual policy or override)."""


@dataclass
class SimRequest:
    """One request: its units (id, tokens) in prompt order and its namespace index."""

    kind: str
    units: list[tuple[str, int]]
    tenant: int

    def n_tokens(self) -> int:
        """The prompt's length in tokens."""
        return sum(n for _, n in self.units)


@dataclass
class Workload:
    """The simulated requests in arrival order and each content unit's token ids."""

    requests: list[SimRequest]
    tokens: dict[str, np.ndarray] = field(default_factory=dict)

    def token_ids(self, req: SimRequest) -> np.ndarray:
        """The prompt of ``req``: its units' tokens concatenated."""
        return np.concatenate([self.tokens[u] for u, _ in req.units])


def build_workload(n_requests: int, seed: int, tenants: int = 4) -> Workload:
    """Groups of one donor and 2-6 probes of the four kinds, interleaved by a random arrival
    order (each group's requests in order, spread over a window of ~2,000 arrivals)."""
    rng = np.random.default_rng(seed)
    tokens: dict[str, np.ndarray] = {}

    def unit(name: str, n: int) -> tuple[str, int]:
        if name not in tokens:
            sub = np.random.default_rng(abs(hash_name(name)) % (2**63))
            tokens[name] = sub.integers(0, 48_000, n, dtype=np.int64)
        return name, int(tokens[name].size)

    timed: list[tuple[float, int, SimRequest]] = []
    g = 0
    while len(timed) < n_requests:
        kind = KINDS[g % len(KINDS)]
        tenant = int(rng.integers(tenants))
        start = float(rng.uniform(0, n_requests))
        k = int(rng.integers(2, 7))
        group: list[SimRequest] = []
        if kind == "cross_instruction":
            doc = unit(f"doc{g}", int(rng.integers(512, 2048)))
            for i in range(k + 1):
                group.append(SimRequest(kind, [unit(f"ins{g}.{i}", 40), doc], tenant))
        elif kind == "template":
            body = unit(f"tpl{g}", int(rng.integers(400, 1200)))
            for i in range(k + 1):
                head = unit(f"hdr{g}.{i}", 24)
                tail = unit(f"q{g}.{i}", int(rng.integers(30, 120)))
                group.append(SimRequest(kind, [head, body, tail], tenant))
        elif kind == "multi_turn":
            turns = [unit(f"sys{g}", 300)]
            for i in range(k + 1):
                turns = [*turns, unit(f"turn{g}.{i}", int(rng.integers(100, 400)))]
                group.append(SimRequest(kind, list(turns), tenant))
        else:
            pool = [unit(f"psg{g}.{j}", 256) for j in range(6)]
            for i in range(k + 1):
                pick = rng.permutation(6)[:4]
                parts = [pool[j] for j in pick] + [unit(f"rq{g}.{i}", 40)]
                group.append(SimRequest(kind, parts, tenant))
        for i, req in enumerate(group):
            timed.append((start + i * float(rng.exponential(300)), len(timed), req))
        g += 1
    timed.sort(key=lambda t: (t[0], t[1]))
    return Workload([req for _, _, req in timed[:n_requests]], tokens)


def hash_name(name: str) -> int:
    """Deterministic 64-bit hash of a unit name (never Python's salted ``hash()``)."""
    import hashlib

    return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little")


class RankCache:
    """LRU of units up to ``capacity`` tokens (one rank's KV cache, as far as hits go)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.units: OrderedDict[tuple[int, str], int] = OrderedDict()
        self.size = 0

    def resident(self, tenant: int, units: list[tuple[str, int]]) -> list[int]:
        return [n for u, n in units if (tenant, u) in self.units]

    def use(self, tenant: int, units: list[tuple[str, int]]) -> None:
        for u, n in units:
            key = (tenant, u)
            if key in self.units:
                self.units.move_to_end(key)
            else:
                self.units[key] = n
                self.size += n
        while self.size > self.capacity and self.units:
            _, n = self.units.popitem(last=False)
            self.size -= n


@dataclass
class SimResult:
    """What one dispatch method did at one rank count (hit rate, reused fraction, imbalance,
    dispatch cost; hit rate per request kind)."""

    method: str
    ranks: int
    requests: int
    hit_rate: float
    reused_fraction: float
    imbalance: float
    dispatch_us_p50: float = 0.0
    dispatch_us_p99: float = 0.0
    dispatch_cpu_us_p99: float = 0.0
    """Thread CPU time: what one dispatch costs when the core is not shared (wall p99 on a
    shared 2-core VM is mostly waiting for the core)."""
    router_bytes: int = 0
    mean_max_queue: float = 0.0
    """Time-averaged longest queue in tokens."""
    mean_work: float = 0.0
    """Mean work per request (prefill after reuse plus decode), tokens."""
    by_kind: dict[str, float] = field(default_factory=dict)


def simulate(
    workload: Workload,
    method: str,
    n_ranks: int,
    *,
    config: Config,
    rank_capacity: int,
    utilization: float,
    decode_cost: int,
    mean_work: float | None = None,
) -> SimResult:
    """Replay ``workload`` through ``method`` over ``n_ranks`` ranks (see module docstring).

    ``mean_work``: the method's mean work per request (prefill after reuse plus decode), so
    that every method runs at the same ``utilization``; None: the cold cost."""
    reqs = workload.requests
    if mean_work is None:
        mean_work = float(np.mean([r.n_tokens() for r in reqs])) + decode_cost
    service = mean_work / utilization / n_ranks  # tokens per rank per arrival
    caches = [RankCache(rank_capacity) for _ in range(n_ranks)]
    queue = np.zeros(n_ranks)
    spaces = [Namespace(model="sim", cache_salt=f"t{t}") for t in range(8)]
    if method == "donor_sticky":
        config = replace(config, dispatch_load_margin=2**62)
    router = DonorRouter(config, n_ranks, rank_capacity) if method.startswith("donor") else None
    rr = 0
    hits = 0
    reused = 0
    total = 0
    max_q: list[float] = []
    mean_q: list[float] = []
    work = 0.0
    costs: list[float] = []
    cpu_costs: list[float] = []
    kind_hits: dict[str, list[int]] = {k: [0, 0] for k in KINDS}
    min_reuse = config.min_reuse_tokens

    def fallback(name: str) -> int:
        nonlocal rr
        if name == "round_robin":
            rank = rr % n_ranks
            rr += 1
            return rank
        return int(np.argmin(queue))  # lowest rank on a tie, like DPBudget

    base = "round_robin" if method in ("round_robin", "donor+rr") else "total_tokens"
    for req in reqs:
        rank: int | None = None
        if router is not None:
            ids = workload.token_ids(req)
            t0 = time.perf_counter()
            c0 = time.thread_time()
            route = router.choose(spaces[req.tenant], ids, queue.tolist())
            rank = route.rank
            if rank is None:
                rank = fallback(base)
            router.record(spaces[req.tenant], ids, rank, route)
            cpu_costs.append(time.thread_time() - c0)
            costs.append(time.perf_counter() - t0)
        elif method == "prefix+tt":
            lead = [0] * n_ranks
            for r in range(n_ranks):
                for u, k in req.units:
                    if (req.tenant, u) not in caches[r].units:
                        break
                    lead[r] += k
            floor = float(queue.min())
            ok = [
                r
                for r in range(n_ranks)
                if lead[r] and queue[r] <= floor + config.dispatch_load_margin
            ]
            rank = max(ok, key=lambda r: (lead[r], -r)) if ok else fallback(base)
        else:
            rank = fallback(base)
        found = caches[rank].resident(req.tenant, req.units)
        n = req.n_tokens()
        hit = any(x >= min_reuse for x in found)
        got = sum(found) if hit else 0
        hits += hit
        reused += got
        total += n
        kind_hits[req.kind][0] += hit
        kind_hits[req.kind][1] += 1
        caches[rank].use(req.tenant, req.units)
        queue[rank] += n - got + decode_cost
        work += n - got + decode_cost
        max_q.append(float(queue.max()))
        mean_q.append(float(queue.mean()))
        np.subtract(queue, service, out=queue)
        np.maximum(queue, 0.0, out=queue)
    cost_us = [c * 1e6 for c in costs]
    cpu_us = [c * 1e6 for c in cpu_costs]
    return SimResult(
        method=method,
        ranks=n_ranks,
        requests=len(reqs),
        hit_rate=hits / len(reqs),
        reused_fraction=reused / max(total, 1),
        imbalance=float(np.mean(max_q) / max(np.mean(mean_q), 1e-9)),
        mean_max_queue=float(np.mean(max_q)),
        mean_work=work / len(reqs),
        dispatch_us_p50=percentile(cost_us, 50) if cost_us else 0.0,
        dispatch_us_p99=percentile(cost_us, 99) if cost_us else 0.0,
        dispatch_cpu_us_p99=percentile(cpu_us, 99) if cpu_us else 0.0,
        router_bytes=router.charged_bytes() if router is not None else 0,
        by_kind={k: v[0] / v[1] for k, v in kind_hits.items() if v[1]},
    )


def run(
    requests: int,
    ranks: tuple[int, ...],
    *,
    seed: int = 0,
    rank_capacity: int = 131072,
    utilization: float = 0.8,
    decode_cost: int = 64,
    config: Config | None = None,
    progress: Callable[[str], None] | None = None,
) -> list[SimResult]:
    """Every method at every rank count, plus ``single`` (one rank with N ranks' cache)."""
    config = config or Config()
    workload = build_workload(requests, seed)
    out: list[SimResult] = []
    for n in ranks:
        kw = {"config": config, "utilization": utilization, "decode_cost": decode_cost}
        single = simulate(workload, "round_robin", 1, rank_capacity=rank_capacity * n, **kw)
        out.append(replace(single, method="single", ranks=n))
        for method in METHODS:
            first = simulate(workload, method, n, rank_capacity=rank_capacity, **kw)
            # again at the same utilization as every other method: a method that saves
            # work would otherwise look balanced or not only because its ranks idle
            res = simulate(
                workload, method, n, rank_capacity=rank_capacity, mean_work=first.mean_work, **kw
            )
            out.append(res)
            if progress is not None:
                progress(f"N={n} {method}: hit {res.hit_rate:.3f} imb {res.imbalance:.2f}")
    return out


def format_table(results: list[SimResult]) -> str:
    """Console table: per N, each method's hit rate (and vs single), reused fraction,
    imbalance (and vs round_robin), dispatch cost."""
    lines = [
        f"{'N':>3} {'method':<13} {'hit':>6} {'/single':>7} {'reused':>6} {'imb':>5} "
        f"{'/rr':>5} {'maxq':>6} {'p50 us':>7} {'p99 us':>7} {'cpu p99':>7}"
    ]
    for n in sorted({r.ranks for r in results}):
        rows = [r for r in results if r.ranks == n]
        single = next(r for r in rows if r.method == "single")
        rr = next(r for r in rows if r.method == "round_robin")
        for r in rows:
            lines.append(
                f"{n:>3} {r.method:<13} {r.hit_rate:>6.3f} {r.hit_rate / single.hit_rate:>7.3f} "
                f"{r.reused_fraction:>6.3f} {r.imbalance:>5.2f} "
                f"{r.imbalance / rr.imbalance:>5.2f} {r.mean_max_queue:>6.0f} "
                f"{r.dispatch_us_p50:>7.0f} {r.dispatch_us_p99:>7.0f} "
                f"{r.dispatch_cpu_us_p99:>7.0f}"
            )
    return "\n".join(lines)


@click.command(name="dispatch")
@click.option("--requests", default=10_000, show_default=True, help="Requests replayed.")
@click.option("--ranks", default="2,8,32", show_default=True, help="Rank counts, comma-separated.")
@click.option("--seed", default=0, show_default=True)
@click.option("--rank-capacity", default=131072, show_default=True, help="KV tokens per rank.")
@click.option("--utilization", default=0.8, show_default=True, help="Offered load / capacity.")
@click.option("--decode-cost", default=64, show_default=True, help="Queue tokens per request.")
@click.option(
    "--semblend-env",
    multiple=True,
    help="KEY=VALUE SemBlend setting for the router (e.g. SEMBLEND_DISPATCH_LOAD_MARGIN=4096).",
)
@click.option("--out", default="bench-results/dispatch.json", show_default=True)
def command(
    requests: int,
    ranks: str,
    seed: int,
    rank_capacity: int,
    utilization: float,
    decode_cost: int,
    semblend_env: tuple[str, ...],
    out: str,
) -> None:
    """Hit rate, load imbalance and dispatch cost of round_robin, total_tokens and donor-aware
    dispatch, simulated (no engine)."""
    env = dict(item.split("=", 1) for item in semblend_env)
    config = Config.from_env(env)
    counts = tuple(int(x) for x in ranks.split(","))
    results = run(
        requests,
        counts,
        seed=seed,
        rank_capacity=rank_capacity,
        utilization=utilization,
        decode_cost=decode_cost,
        config=config,
        progress=lambda line: click.echo(line, err=True),
    )
    click.echo(format_table(results))
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "options": {
            "requests": requests,
            "ranks": counts,
            "seed": seed,
            "rank_capacity": rank_capacity,
            "utilization": utilization,
            "decode_cost": decode_cost,
            "semblend_env": env,
        },
        "results": [r.__dict__ for r in results],
    }
    path.write_text(json.dumps(payload, indent=1))
    click.echo(f"wrote {path}")
