"""``bench gateway``: N semblend SGLang servers behind a real SMG gateway, placements compared.

Starts ``--instances`` semblend (exact_spans) servers and, per placement, a fresh ``smg launch``
process on loopback over them, then sends every workload through it, side by side in one run:

- ``single_instance``: every request to instance 0, no gateway (the reference hit rate);
- ``round_robin``: SMG ``--policy round_robin``;
- ``cache_aware``: SMG ``--policy cache_aware`` (its radix tree of request text);
- ``donor_aware``: SMG ``--policy round_robin --routing-key-override``, each request carrying
  the ``X-SMG-Routing-Key`` that :class:`~semblend_sglang.routing_keys.DonorRoutingKeys` chose
  from this client's earlier requests (its donor's key, or a fresh one SMG places round-robin).

Per workload the groups' requests are interleaved as independent users would send them (a
seeded random merge that keeps each group's order: donors before its probes), one request at a
time, greedy, ``max_new_tokens=1``. A probe's hit is server-confirmed: some
instance's ``materialized`` outcome count grew while it ran. Its latency stands in for TTFT
(one output token). Requests per instance come from SMG's ``x-smg-routed-worker-id`` header.
Caches are flushed, and SMG restarted, before each placement and workload.
"""

from __future__ import annotations

import json
import random
import statistics
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import click
import httpx

from ..namespace import Namespace
from ..routing_keys import ROUTED_WORKER_HEADER, DonorRoutingKeys, KeyChoice
from .smg_process import smg_binary, start_gateway
from .workloads import BenchRequest, Workload

PLACEMENTS = ("single_instance", "round_robin", "cache_aware", "donor_aware")
GATEWAY_POLICY: dict[str, tuple[str, ...]] = {
    "round_robin": ("--policy", "round_robin"),
    "cache_aware": ("--policy", "cache_aware"),
    "donor_aware": ("--policy", "round_robin", "--routing-key-override"),
}
"""SMG's own flags for each placement behind the gateway."""
DEFAULT_WORKLOADS = ("cross_instruction", "template", "rag")
NAMESPACE = Namespace(model="bench")
"""The client's namespace: one model, no salt (the client keys only its own requests)."""


@dataclass(frozen=True)
class Sent:
    """One request's answer: HTTP ``status``, ``seconds`` to the answer, the ``worker`` that
    served it (SMG's header, or the direct URL), and whether some instance reused KV for it."""

    status: int
    seconds: float
    worker: str | None
    hit: bool


def materialized(urls: Sequence[str]) -> list[int]:
    """Each instance's count of requests that reused KV (semblend's ``materialized``)."""
    from .client import semblend_snapshot

    counts = []
    for url in urls:
        snap = semblend_snapshot(url) or {}
        counts.append(int((snap.get("outcomes") or {}).get("materialized", 0)))
    return counts


def send(
    url: str,
    request: BenchRequest,
    instances: Sequence[str],
    headers: Mapping[str, str] | None = None,
    timeout: float = 900.0,
) -> Sent:
    """POST one greedy one-token ``/generate`` of ``request`` to ``url`` (SMG or an instance),
    checking every instance's reuse count before and after (server-confirmed hits)."""
    before = materialized(instances)
    body = {
        "input_ids": list(request.prompt_ids),
        "sampling_params": {"max_new_tokens": 1, "temperature": 0},
    }
    started = time.perf_counter()
    answer = httpx.post(url + "/generate", json=body, headers=dict(headers or {}), timeout=timeout)
    seconds = time.perf_counter() - started
    worker = answer.headers.get(ROUTED_WORKER_HEADER) or (url if url in instances else None)
    hit = answer.status_code == 200 and any(
        b > a for a, b in zip(before, materialized(instances), strict=True)
    )
    return Sent(answer.status_code, seconds, worker, hit)


@dataclass
class PlacementResult:
    """What one placement did with one workload."""

    probes: int = 0
    hits: int = 0
    failed: int = 0
    probe_seconds: list[float] = field(default_factory=list)
    per_instance: dict[str, int] = field(default_factory=dict)
    served: list[tuple[str, str, str | None]] = field(default_factory=list)
    """(group id, role, worker) of every answered request, in sending order."""

    @property
    def hit_rate(self) -> float:
        """Server-confirmed hits per probe."""
        return self.hits / self.probes if self.probes else 0.0

    def imbalance(self, n_instances: int) -> float:
        """Requests on the busiest instance over the mean per instance (1.0: even)."""
        total = sum(self.per_instance.values())
        return max(self.per_instance.values()) * n_instances / total if total else 0.0


def sending_order(workload: Workload, seed: int = 0) -> list[tuple[str, BenchRequest]]:
    """(group id, request) of every request, interleaved across groups as independent users
    would send them: a merge seeded by ``seed`` that keeps each group's order (donors first)."""
    rng = random.Random(f"gateway/{workload.name}/{workload.context_tokens}/{seed}")
    pending = [list(g.requests) for g in workload.groups]
    ids = [g.group_id for g in workload.groups]
    order: list[tuple[str, BenchRequest]] = []
    while any(pending):
        i = rng.choice([k for k, left in enumerate(pending) if left])
        order.append((ids[i], pending[i].pop(0)))
    return order


def run_placement(
    placement: str,
    target: str,
    instances: Sequence[str],
    workload: Workload,
    keys: DonorRoutingKeys | None,
) -> PlacementResult:
    """Send ``workload`` to ``target`` (SMG's URL, or instance 0 for ``single_instance``);
    with ``keys`` (donor_aware) each request carries its routing key."""
    result = PlacementResult(per_instance={u: 0 for u in instances})
    for group_id, request in sending_order(workload):
        choice: KeyChoice | None = None
        if keys is not None:
            choice = keys.choose(request.prompt_ids, NAMESPACE)
        sent = send(target, request, instances, None if choice is None else choice.headers)
        if keys is not None and choice is not None and sent.status == 200:
            keys.record(choice, request.prompt_ids, NAMESPACE, sent.worker)
        if sent.status != 200:
            result.failed += 1
            continue
        worker = None if sent.worker is None else sent.worker.rstrip("/")
        result.served.append((group_id, request.role, worker))
        if worker is not None:
            result.per_instance[worker] = result.per_instance.get(worker, 0) + 1
        if request.role == "probe":
            result.probes += 1
            result.hits += int(sent.hit)
            result.probe_seconds.append(sent.seconds)
    return result


def flush_all(instances: Sequence[str]) -> None:
    """Flush every instance's cache (nothing of an earlier placement or workload is left)."""
    from .client import flush_cache

    for url in instances:
        flush_cache(url)


def fleet_kv_tokens(instances: Sequence[str]) -> int | None:
    """The instances' KV pool sizes summed (``/server_info``'s ``max_total_num_tokens``), or
    None when any does not report it."""
    total = 0
    for url in instances:
        try:
            info = httpx.get(url + "/server_info", timeout=30.0).json()
            total += int(info["max_total_num_tokens"])
        except (httpx.HTTPError, ValueError, KeyError, TypeError):
            return None
    return total


def run_gateway_bench(
    instances: Sequence[str],
    workloads: Sequence[Workload],
    placements: Sequence[str],
    logs: Path,
) -> dict[str, Any]:
    """Every placement over every workload, against running ``instances``; the JSON report's
    ``rows`` (one per workload and placement) and ``summary`` (``<placement>_hit_rate`` per
    workload, and overall)."""
    rows: list[dict[str, Any]] = []
    for placement in placements:
        for workload in workloads:
            flush_all(instances)
            gateway = None
            if placement != "single_instance":
                log = logs / f"gateway-{placement}.log"
                gateway = start_gateway(instances, GATEWAY_POLICY[placement], log)
            try:
                keys = None
                if placement == "donor_aware":
                    keys = DonorRoutingKeys(fleet_kv_tokens=fleet_kv_tokens(instances))
                target = instances[0] if gateway is None else gateway.url
                got = run_placement(placement, target, instances, workload, keys)
            finally:
                if gateway is not None:
                    gateway.stop()
            rows.append(_row(placement, workload, got, len(instances)))
            click.echo(_format_row(rows[-1]), err=True)
    return {"rows": rows, "summary": summarize(rows)}


def _row(placement: str, workload: Workload, got: PlacementResult, n: int) -> dict[str, Any]:
    seconds = sorted(got.probe_seconds)
    return {
        "placement": placement,
        "workload": workload.name,
        "context_tokens": workload.context_tokens,
        "probes": got.probes,
        "hits": got.hits,
        "hit_rate": got.hit_rate,
        "failed": got.failed,
        "probe_ttft_p50_s": statistics.median(seconds) if seconds else None,
        "requests_per_instance": dict(got.per_instance),
        "imbalance": got.imbalance(n) if placement != "single_instance" else None,
    }


def summarize(rows: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """``<placement>_hit_rate`` (all probes), ``<placement>_hit_rate:<workload>`` and
    ``<placement>_imbalance`` (busiest instance over the mean, worst workload), and for
    donor_aware its hit rate and imbalance relative to single_instance and round_robin."""
    out: dict[str, Any] = {}
    by: dict[str, list[Mapping[str, Any]]] = {}
    for row in rows:
        by.setdefault(row["placement"], []).append(row)
        out[f"{row['placement']}_hit_rate:{row['workload']}"] = row["hit_rate"]
    for placement, mine in by.items():
        probes = sum(r["probes"] for r in mine)
        out[f"{placement}_hit_rate"] = sum(r["hits"] for r in mine) / probes if probes else 0.0
        out[f"{placement}_failed"] = sum(r["failed"] for r in mine)
        shares = [r["imbalance"] for r in mine if r["imbalance"] is not None]
        if shares:
            out[f"{placement}_imbalance"] = max(shares)
    single, donor = out.get("single_instance_hit_rate"), out.get("donor_aware_hit_rate")
    if single and donor is not None:
        out["donor_aware_over_single"] = donor / single
    if out.get("round_robin_imbalance") and "donor_aware_imbalance" in out:
        out["donor_aware_imbalance_over_round_robin"] = (
            out["donor_aware_imbalance"] / out["round_robin_imbalance"]
        )
    return out


def _format_row(row: Mapping[str, Any]) -> str:
    p50 = row["probe_ttft_p50_s"]
    imb = row["imbalance"]
    return (
        f"{row['workload']:>18} {row['context_tokens']:>5} {row['placement']:>16} "
        f"hit {row['hits']:>2}/{row['probes']:<2} ({row['hit_rate']:.2f}) "
        f"p50 {'-' if p50 is None else f'{p50:.3f}s'} "
        f"imbalance {'-' if imb is None else f'{imb:.2f}'} failed {row['failed']} "
        f"per instance {list(row['requests_per_instance'].values())}"
    )


@click.command("gateway")
@click.option("--instances", default=2, show_default=True, type=click.IntRange(2, 8))
@click.option("--lengths", default="1024", show_default=True, help="Comma-separated prompt tokens.")
@click.option(
    "--workloads", "workload_names", default=",".join(DEFAULT_WORKLOADS), show_default=True
)
@click.option("--groups", default=4, show_default=True, type=click.IntRange(1, 50))
@click.option(
    "--placements", default=",".join(PLACEMENTS), show_default=True, help="Comma-separated."
)
@click.option("--seed", default=0, show_default=True, type=int)
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path), default=None)
@click.option(
    "--out-dir", type=click.Path(file_okay=False, path_type=Path), default=Path("bench-results")
)
def command(
    instances: int,
    lengths: str,
    workload_names: str,
    groups: int,
    placements: str,
    seed: int,
    json_path: Path | None,
    out_dir: Path,
) -> None:
    """Semblend instances behind a real SMG gateway: hit rate, TTFT and requests per instance
    of donor_aware placement (routing keys) against SMG's cache_aware and round_robin and one
    instance alone."""
    from ..cpu_runtime import ensure_torchvision_importable

    ensure_torchvision_importable()  # transformers imports torchvision (docs/cpu.md)
    from transformers import AutoTokenizer

    from ..data import essay_texts
    from ..model_prep import prepare_model
    from .builtin_workloads import BUILTIN_WORKLOADS, build_workload
    from .e2e import parse_lengths
    from .systems import start_servers_of

    chosen = [p.strip() for p in placements.split(",") if p.strip()]
    if bad := [p for p in chosen if p not in PLACEMENTS]:
        raise click.BadParameter(f"unknown placement(s) {bad}", param_hint="'--placements'")
    names = [n.strip() for n in workload_names.split(",") if n.strip()]
    if bad := [n for n in names if n not in BUILTIN_WORKLOADS]:
        raise click.BadParameter(f"unknown workload(s) {bad}", param_hint="'--workloads'")
    length_list = parse_lengths(lengths)
    smg_binary()  # fail before starting servers when smg is missing
    model = str(prepare_model())
    tokenizer = AutoTokenizer.from_pretrained(model)
    essays = essay_texts()
    workloads = [
        build_workload(name, tokenizer, essays, n, groups, seed)
        for n in length_list
        for name in names
    ]
    started = time.monotonic()
    click.echo(f"starting {instances} semblend SGLang servers ...", err=True)
    servers = start_servers_of("exact_spans", instances, model, (), out_dir)
    try:
        report = run_gateway_bench([s.url for s in servers], workloads, chosen, out_dir)
    finally:
        for server in servers:
            server.stop()
    report["wall_s"] = time.monotonic() - started
    report["instances"] = instances
    click.echo(json.dumps(report["summary"], indent=2, sort_keys=True))
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(report, indent=2, sort_keys=True))
