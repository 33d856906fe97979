"""Benchmark ``load``: concurrent clients against vanilla and semblend SGLang servers, side by side.

For each mix, the same schedule runs on each system in turn (vanilla, then semblend, alternating
over ``--passes`` passes): requests arrive as a Poisson process at ``--rate`` per second (seeded,
bounded by ``--requests`` and ``--max-seconds``) and at most ``--clients`` run at once, over
loopback only. Mixes: ``miss`` (prompts no earlier request shares) and ``mixed`` (the built-in
workloads' donors and probes in group order, with misses in between). During each pass every
``--abort-every``-th request is dropped by its client after its first token (SGLang aborts it),
from halfway on a ``/flush_cache`` is asked for until SGLang applies it (it flushes only when no
request runs), and the servers run with a small ``--max-total-tokens`` so the caches evict.
After each pass the bench waits for the servers to idle (SGLang runs its pool and tree checks
then; a leak stops the scheduler) and checks ``/health_generate``; it records the resident
memory of each server's processes after every pass, so that a second identical pass shows
whether memory stays flat.

JSON: per mix and system, ``throughput_rps``, ``tokens_per_s`` (prompt + output), ``ttft_ms_p50``,
``ttft_ms_p99``, ``errors``, ``aborted``, ``flushes``, ``rss_mib`` per pass and ``healthy``.
"""

from __future__ import annotations

import math
import random
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import click

from .client import NoTokenStreamed, health_generate, stream_generate, try_flush
from .metrics import percentile
from .report import write_json

LOAD_SYSTEMS = ("vanilla", "exact_spans")
MIXES = ("miss", "mixed")
MIXED_WORKLOADS = ("cross_instruction", "template", "rag", "rag_corpus", "multi_turn")
MAX_NEW_TOKENS = 8


@dataclass(frozen=True)
class Scheduled:
    """One request of a pass: when it arrives (s after the start), its prompt, whether its
    client drops it after the first token."""

    at_s: float
    prompt_ids: tuple[int, ...]
    drop: bool


def poisson_schedule(
    prompts: Sequence[tuple[int, ...]], rate: float, abort_every: int, seed: int
) -> list[Scheduled]:
    """Arrival times of ``prompts`` (in order) as a Poisson process of ``rate`` per second;
    every ``abort_every``-th request (0: none) is dropped after its first token."""
    rng = random.Random(seed)
    at = 0.0
    out: list[Scheduled] = []
    for i, ids in enumerate(prompts):
        at += rng.expovariate(rate)
        out.append(Scheduled(at, ids, abort_every > 0 and (i + 1) % abort_every == 0))
    return out


@dataclass
class PassResult:
    """What one pass of one system measured."""

    ttft_ms: list[float] = field(default_factory=list)
    tokens: int = 0
    errors: int = 0
    aborted: int = 0
    flushes: int = 0
    flushed_after_drain: bool = False
    """No flush was applied while requests ran (the server never idled); one was after."""
    seconds: float = 0.0
    error_samples: list[str] = field(default_factory=list)


def _one_request(url: str, item: Scheduled, result: PassResult, lock: threading.Lock) -> None:
    """Send one scheduled request and count its outcome in ``result`` (under ``lock``)."""
    try:
        got = stream_generate(
            url, item.prompt_ids, MAX_NEW_TOKENS, stop_after_first_token=item.drop
        )
    except NoTokenStreamed:
        with lock:
            if item.drop:
                result.aborted += 1
            else:
                result.errors += 1
                result.error_samples.append("no token streamed")
        return
    except Exception as exc:  # counted: the target is zero
        with lock:
            result.errors += 1
            if len(result.error_samples) < 5:
                result.error_samples.append(f"{type(exc).__name__}: {exc}")
        return
    with lock:
        if item.drop:  # the client closed the stream at the first token: SGLang aborts it
            result.aborted += 1
        else:
            result.ttft_ms.append(got.ttft_s * 1e3)
            result.tokens += len(item.prompt_ids) + got.completion_tokens


def _flush_when_idle(url: str, stop: threading.Event, result: PassResult) -> None:
    """Ask ``/flush_cache`` every 0.2 s until it is applied or ``stop`` is set: SGLang flushes
    only when no request is running, so a flush lands in a gap between arrivals."""
    import httpx

    while not stop.is_set():
        try:
            if try_flush(url):
                result.flushes += 1
                return
        except httpx.HTTPError:
            pass
        stop.wait(0.2)


def run_pass(
    url: str, schedule: Sequence[Scheduled], clients: int, max_seconds: float
) -> PassResult:
    """Send ``schedule`` to ``url`` with at most ``clients`` in flight; from halfway on, one
    ``/flush_cache`` is asked for until SGLang applies it; stops admitting after
    ``max_seconds``."""
    result = PassResult()
    lock = threading.Lock()
    half = len(schedule) // 2
    stop = threading.Event()
    flusher = threading.Thread(target=_flush_when_idle, args=(url, stop, result), daemon=True)
    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=clients) as pool:
        for i, item in enumerate(schedule):
            wait = item.at_s - (time.perf_counter() - start)
            if wait > 0:
                time.sleep(wait)
            if time.perf_counter() - start > max_seconds:
                break
            if i == half:
                flusher.start()
            pool.submit(_one_request, url, item, result, lock)
    result.seconds = time.perf_counter() - start
    stop.set()
    if flusher.ident is not None:
        flusher.join(timeout=60.0)
        if not result.flushes:  # saturated: no idle moment came while requests ran
            result.flushed_after_drain = _flush_when_drained(url)
    return result


def _flush_when_drained(url: str, seconds: float = 30.0) -> bool:
    """One ``/flush_cache`` once the pass's requests are done (True when SGLang applied it)."""
    import httpx

    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            if try_flush(url):
                return True
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    return False


def rss_mib(pid: int) -> float:
    """Resident memory of process ``pid`` and its descendants, in MiB (Linux /proc)."""
    import psutil

    proc = psutil.Process(pid)
    total = proc.memory_info().rss
    for child in proc.children(recursive=True):
        try:
            total += child.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total / 2**20


def healthy_after_idle(url: str, idle_s: float) -> bool:
    """Wait ``idle_s`` (SGLang checks its pools and tree when idle), then one forward."""
    time.sleep(idle_s)
    return health_generate(url)


def build_mixes(
    tokenizer: Any, essays: Sequence[str], length: int, requests: int, seed: int
) -> dict[str, list[tuple[int, ...]]]:
    """Prompts of each mix: ``miss`` (control probes only) and ``mixed`` (the workloads' groups in
    order, a miss after every group), each cut to ``requests``."""
    from .builtin_workloads import build_workload

    per = max(1, requests // (len(MIXED_WORKLOADS) + 1) + 1)
    misses = [
        r.prompt_ids
        for g in build_workload("control", tokenizer, essays, length, requests, seed).groups
        for r in g.requests
    ]
    groups = [
        build_workload(name, tokenizer, essays, length, per, seed).groups
        for name in MIXED_WORKLOADS
    ]
    mixed: list[tuple[int, ...]] = []
    spare = iter(misses[::-1])
    for k in range(per):
        for built in groups:
            mixed.extend(r.prompt_ids for r in built[k].requests)
            mixed.append(next(spare, misses[k % len(misses)]))
    return {"miss": misses[:requests], "mixed": mixed[:requests]}


def summarize(result: PassResult) -> dict[str, Any]:
    """The JSON fields of one pass."""
    done = len(result.ttft_ms)
    return {
        "completed": done,
        "throughput_rps": done / result.seconds if result.seconds else 0.0,
        "tokens_per_s": result.tokens / result.seconds if result.seconds else 0.0,
        "ttft_ms_p50": percentile(result.ttft_ms, 50) if done else math.nan,
        "ttft_ms_p99": percentile(result.ttft_ms, 99) if done else math.nan,
        "errors": result.errors,
        "aborted": result.aborted,
        "flushes": result.flushes,
        "flushed_after_drain": result.flushed_after_drain,
        "seconds": result.seconds,
        "error_samples": result.error_samples,
    }


@click.command()
@click.option("--clients", default=4, show_default=True, help="Requests in flight at most.")
@click.option("--rate", default=1.0, show_default=True, help="Poisson arrivals per second.")
@click.option("--requests", default=40, show_default=True, help="Requests per pass and mix.")
@click.option("--max-seconds", default=300.0, show_default=True, help="Admission time per pass.")
@click.option("--length", default=512, show_default=True, help="Prompt tokens.")
@click.option("--passes", default=2, show_default=True, help="Identical passes per system.")
@click.option("--abort-every", default=10, show_default=True, help="Drop every n-th (0: none).")
@click.option("--max-total-tokens", default=8192, show_default=True, help="KV pool per server.")
@click.option("--mixes", default=",".join(MIXES), show_default=True)
@click.option("--idle-seconds", default=8.0, show_default=True)
@click.option("--seed", default=0, show_default=True)
@click.option("--out", "out_dir", default="bench-results", show_default=True, type=Path)
def command(
    clients: int,
    rate: float,
    requests: int,
    max_seconds: float,
    length: int,
    passes: int,
    abort_every: int,
    max_total_tokens: int,
    mixes: str,
    idle_seconds: float,
    seed: int,
    out_dir: Path,
) -> None:
    """Throughput, TTFT p50/p99 and errors of vanilla and semblend under concurrent load, with
    aborts, a cache flush and eviction pressure; idle checks and memory after every pass."""
    from ..cpu_runtime import ensure_torchvision_importable

    ensure_torchvision_importable()
    from transformers import AutoTokenizer

    from ..data import essay_texts
    from ..model_prep import prepare_model
    from .systems import start_servers

    chosen = [m.strip() for m in mixes.split(",") if m.strip()]
    if [m for m in chosen if m not in MIXES]:
        raise click.BadParameter(f"mixes are {MIXES}", param_hint="'--mixes'")
    model = str(prepare_model())
    tokenizer = AutoTokenizer.from_pretrained(model)
    prompts = build_mixes(tokenizer, essay_texts(), length, requests, seed)
    out_dir.mkdir(parents=True, exist_ok=True)
    flags = ["--max-total-tokens", str(max_total_tokens)]
    started = time.monotonic()
    servers = start_servers(LOAD_SYSTEMS, model, flags, out_dir)
    report: dict[str, Any] = {
        "options": {
            "clients": clients,
            "rate": rate,
            "requests": requests,
            "length": length,
            "passes": passes,
            "abort_every": abort_every,
            "max_total_tokens": max_total_tokens,
            "seed": seed,
        },
        "mixes": {},
    }
    try:
        for mix in chosen:
            schedule = poisson_schedule(prompts[mix], rate, abort_every, seed)
            per_system: dict[str, Any] = {s: {"passes": [], "rss_mib": []} for s in LOAD_SYSTEMS}
            for p in range(passes):
                order = LOAD_SYSTEMS if p % 2 == 0 else LOAD_SYSTEMS[::-1]
                for system in order:
                    server = servers[system]
                    result = run_pass(server.url, schedule, clients, max_seconds)
                    entry = summarize(result)
                    entry["healthy"] = healthy_after_idle(server.url, idle_seconds)
                    entry["leak_logged"] = "memory leak" in server.log_tail(4000)
                    per_system[system]["passes"].append(entry)
                    per_system[system]["rss_mib"].append(rss_mib(server.process.pid))
                    click.echo(
                        f"{mix:6} pass {p} {system:12} {entry['throughput_rps']:.3f} req/s  "
                        f"TTFT p50 {entry['ttft_ms_p50']:.0f} p99 {entry['ttft_ms_p99']:.0f} ms  "
                        f"errors {entry['errors']} aborted {entry['aborted']} healthy "
                        f"{entry['healthy']}"
                    )
            report["mixes"][mix] = per_system
    finally:
        for server in servers.values():
            server.stop()
    report["wall_s"] = time.monotonic() - started
    path = write_json(out_dir / "load.json", report)
    click.echo(f"wrote {path} ({report['wall_s']:.0f} s)")
