"""How busy the machine was with work that is not the bench's own, while the bench measured.

A TTFT measured while another process runs on the same cores is not the server's TTFT. The bench
reads, around each request it times, the machine's busy CPU time (``/proc/stat``: user, nice,
system, irq, softirq and steal, i.e. everything but idle and iowait) and the CPU time of its own
process tree (this process, the servers it started and their schedulers and detokenizers). The
difference, per second of wall time, is the *foreign load* in cores: 0 on a quiet machine, about
1 with a busy loop on one core. Steal time counts as foreign: the hypervisor gave the core to
someone else.

The load average is recorded too, but it does not tell a quiet machine from a loaded one here:
the measured server's own threads keep it near the core count during prefills.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable
from dataclasses import dataclass

FOREIGN_LOAD_LIMIT = 0.25
"""Foreign load (cores) above which a measurement is flagged noisy: a quarter of a core taken by
another process for as long as the requests ran (docs/bench.md, "Noise")."""

_CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


@dataclass(frozen=True)
class LoadSample:
    """One reading: monotonic wall seconds, the machine's busy CPU seconds (all cores), the
    bench tree's CPU seconds, and the 1-minute load average."""

    wall_s: float
    busy_s: float
    own_s: float
    loadavg: float


@dataclass(frozen=True)
class LoadWindow:
    """What happened between two :class:`LoadSample` s: ``foreign_cores`` (mean cores used by
    processes outside the bench tree, steal included) and ``loadavg`` (the larger reading)."""

    foreign_cores: float
    loadavg: float


def _machine_busy_s() -> float | None:
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu":
        return None
    values = [int(v) for v in fields[1:9]] + [0] * max(0, 9 - len(fields))
    user, nice, system, _idle, _iowait, irq, softirq, steal = values[:8]
    return (user + nice + system + irq + softirq + steal) / _CLOCK_TICKS


def _process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of ``pid`` and of its children it has waited for; 0 when the
    process is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except OSError:
        return 0.0
    fields = text[text.rfind(")") + 2 :].split()
    # fields[11..14]: utime, stime, cutime, cstime (proc(5), counted from field 3)
    return sum(int(v) for v in fields[11:15]) / _CLOCK_TICKS


def _children(pid: int) -> list[int]:
    out: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                out.extend(int(c) for c in f.read().split())
        except OSError:
            continue
    return out


def process_tree(roots: Iterable[int]) -> list[int]:
    """``roots`` and every live descendant of each (``/proc/PID/task/*/children``)."""
    seen: list[int] = []
    stack = list(roots)
    while stack:
        pid = stack.pop()
        if pid in seen:
            continue
        seen.append(pid)
        stack.extend(_children(pid))
    return seen


def tree_peak_rss_bytes(roots: Iterable[int]) -> int:
    """The sum of each live process's peak resident set (``VmHWM``) over ``roots`` and their
    descendants: an upper bound of the tree's peak memory (each process peaks on its own). 0 for
    processes already gone."""
    total = 0
    for pid in process_tree(roots):
        try:
            with open(f"/proc/{pid}/status") as f:
                for line in f:
                    if line.startswith("VmHWM:"):
                        total += int(line.split()[1]) * 1024
                        break
        except (OSError, ValueError):
            continue
    return total


class LoadMeter:
    """Reads :class:`LoadSample` s for the bench process and the server processes it names
    (``server_pids``: each server's launcher; their descendants are found at every reading).
    Without ``/proc`` (not Linux) every window reads 0 foreign cores."""

    def __init__(self, server_pids: Iterable[int] = ()) -> None:
        self.roots = [os.getpid(), *server_pids]

    def sample(self) -> LoadSample:
        """The readings now."""
        busy = _machine_busy_s()
        own = sum(_process_cpu_s(pid) for pid in process_tree(self.roots))
        try:
            load = os.getloadavg()[0]
        except OSError:
            load = 0.0
        return LoadSample(time.monotonic(), busy if busy is not None else own, own, load)

    @staticmethod
    def window(start: LoadSample, end: LoadSample) -> LoadWindow:
        """The foreign load between ``start`` and ``end`` (never below 0: the tree's time and
        the machine's are read a moment apart)."""
        wall = end.wall_s - start.wall_s
        foreign = (end.busy_s - start.busy_s) - (end.own_s - start.own_s)
        cores = max(0.0, foreign / wall) if wall > 0 else 0.0
        return LoadWindow(foreign_cores=cores, loadavg=max(start.loadavg, end.loadavg))


LOCAL_HOSTS = frozenset({"127.0.0.1", "localhost", "::1", "0.0.0.0"})
"""Hosts of a ``--url`` that name this machine."""


def listening_pid(url: str) -> int | None:
    """The process listening on ``url``'s port when ``url``'s host is this machine
    (:data:`LOCAL_HOSTS`), found with psutil; None for another host, a port nobody here
    listens on, or sockets psutil may not read. The bench calls it for the servers ``--url``
    names, so that their CPU time is counted as the bench's own and not as foreign load."""
    from urllib.parse import urlsplit

    import psutil

    parts = urlsplit(url)
    if parts.hostname not in LOCAL_HOSTS or parts.port is None:
        return None
    try:
        connections = psutil.net_connections(kind="tcp")
    except psutil.Error:
        return None
    for conn in connections:
        if conn.status == psutil.CONN_LISTEN and conn.laddr and conn.laddr.port == parts.port:
            return conn.pid
    return None
