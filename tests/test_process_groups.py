"""Nothing left behind: the process groups a process started (SGLang servers run in their own
sessions) are stopped when it ends, on SIGTERM, SIGINT and normal exit
(semblend_sglang.process_groups).

First on stand-in process trees (a leader in its own session, with a member that ignores SIGINT
and outlives it, both holding a listening port), which pin each rule in about a second; then on
the real entry points with the real SGLang server: the bench ended by SIGTERM while it measures and
the bench's ttft job interrupted (SIGINT) while its server loads. ``semblend-sglang serve`` goes
through the same registry; tests/test_cli.py stops a served server with SIGINT and finds its
group gone (a SIGTERM test here would cost another server start and check the same path:
serve's handler runs after the registry's, as the stand-in "handler" test shows).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

from semblend_sglang.server import free_port

GONE_WITHIN_S = 30.0
"""How long after the signal the starting process and every process of its groups may take to
be gone (the handler gives the servers 5 s to stop, then kills their groups)."""


def _sigint_as_a_terminal_gives_it() -> None:
    """``preexec_fn`` of every process these tests signal: SIGINT back to its default, as a
    terminal's Ctrl-C finds it. Ignored SIGINT is inherited through exec, and the suite may run as
    a shell's background job (SIGINT ignored), where every SIGINT test here would wait out
    :data:`GONE_WITHIN_S`; the ignored case has its own test ("ignore-int")."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _members(groups: Sequence[int]) -> list[int]:
    """Pids of live processes (zombies excluded) whose process group is one of ``groups``."""
    out = []
    for proc in psutil.process_iter(["status"]):
        try:
            if proc.info["status"] != psutil.STATUS_ZOMBIE and os.getpgid(proc.pid) in groups:
                out.append(proc.pid)
        except (ProcessLookupError, psutil.NoSuchProcess):
            continue
    return out


def _port_free(port: int) -> bool:
    """True when a new server could listen on ``port`` (no socket is listening there)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
            s.listen()
        except OSError:
            return False
    return True


def _assert_nothing_left(groups: Sequence[int], ports: Sequence[int]) -> float:
    """Wait up to :data:`GONE_WITHIN_S` for every process of ``groups`` to be gone; assert it and
    that every port in ``ports`` is free. Returns the seconds it took."""
    start = time.monotonic()
    while _members(groups) and time.monotonic() - start < GONE_WITHIN_S:
        time.sleep(0.2)
    assert _members(groups) == [], f"left running: {_members(groups)}"
    held = [port for port in ports if not _port_free(port)]
    assert held == [], f"ports still held: {held}"
    return time.monotonic() - start


@contextmanager
def _cleanup(groups: list[int], proc: subprocess.Popen[str] | None = None) -> Iterator[None]:
    """Kill what a failed test left: ``proc`` and the process groups it started (``groups``,
    filled in by the test as it learns them)."""
    try:
        yield
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()
        for group in groups:
            try:
                os.killpg(group, signal.SIGKILL)
            except ProcessLookupError:
                pass


# -- stand-in trees -------------------------------------------------------------------------

LEADER = """
import os, signal, socket, subprocess, sys, time
signal.signal(signal.SIGINT, signal.default_int_handler)  # also under a parent ignoring it
listener = socket.socket()
listener.bind(("127.0.0.1", int(sys.argv[1])))
listener.listen()
# A member that ignores SIGINT and holds the port too, like a scheduler outliving its launcher.
member = subprocess.Popen(
    [sys.executable, "-c",
     "import signal, time; signal.signal(signal.SIGINT, signal.SIG_IGN); time.sleep(600)"],
    pass_fds=[listener.fileno()],
)
print(member.pid, flush=True)
time.sleep(600)
"""

PARENT = """
import json, os, signal, subprocess, sys, time
from semblend_sglang import process_groups
mode, port = sys.argv[1], sys.argv[2]
if mode == "ignore-int":
    signal.signal(signal.SIGINT, signal.SIG_IGN)
if mode == "handler":
    def handler(signum, frame):
        left = process_groups.tracked_pids()
        print(json.dumps({"handler": signum, "tracked_then": left}), flush=True)
        sys.exit(3)
    signal.signal(signal.SIGTERM, handler)
leader = subprocess.Popen(
    [sys.executable, "-c", sys.argv[3], port], stdout=subprocess.PIPE, text=True,
    start_new_session=True,
)
process_groups.track(leader, own_group=True, polite=signal.SIGINT)
member = int(leader.stdout.readline())
print(json.dumps({"leader": leader.pid, "member": member}), flush=True)
if mode == "raise":
    raise RuntimeError("the bench failed")
if mode == "fork":
    child = os.fork()
    if child == 0:
        sys.exit(0)  # a normal interpreter exit: atexit runs in the forked child
    os.waitpid(child, 0)
    alive = all(os.path.exists(f"/proc/{pid}") for pid in (leader.pid, member))
    print(json.dumps({"alive_after_fork_exit": alive}), flush=True)
if mode in ("sleep", "ignore-int", "handler"):
    time.sleep(600)
"""


@dataclass
class Tree:
    """A running PARENT and the stand-in tree it started."""

    parent: subprocess.Popen[str]
    leader: int
    member: int
    port: int


@contextmanager
def _stand_in(mode: str) -> Iterator[Tree]:
    port = free_port()
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, mode, str(port), LEADER],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=_sigint_as_a_terminal_gives_it,
    )
    groups: list[int] = []
    with _cleanup(groups, parent):
        assert parent.stdout is not None
        line = parent.stdout.readline()
        assert line, parent.stderr.read() if parent.stderr else ""
        pids = json.loads(line)
        groups.append(pids["leader"])
        yield Tree(parent, pids["leader"], pids["member"], port)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_stop_signal_stops_the_groups_then_takes_its_usual_effect(sig: signal.Signals) -> None:
    """SIGTERM: the groups are stopped, then the process ends by SIGTERM as it did before.
    SIGINT: the groups are stopped, then KeyboardInterrupt is raised as before (uncaught, it ends
    Python by SIGINT)."""
    with _stand_in("sleep") as tree:
        assert not _port_free(tree.port)
        tree.parent.send_signal(sig)
        code = tree.parent.wait(timeout=GONE_WITHIN_S)
        _assert_nothing_left([tree.leader], [tree.port])
        if sig == signal.SIGTERM:
            assert code == -signal.SIGTERM
        else:
            # An uncaught KeyboardInterrupt ends Python by SIGINT.
            assert code == -signal.SIGINT
            assert "KeyboardInterrupt" in (tree.parent.stderr or "").read()


@pytest.mark.parametrize("mode", ["exit", "raise"])
def test_exit_stops_the_groups(mode: str) -> None:
    """Returning from the program, or dying of an exception, stops the groups (atexit)."""
    with _stand_in(mode) as tree:
        code = tree.parent.wait(timeout=GONE_WITHIN_S)
        assert code == (0 if mode == "exit" else 1)
        _assert_nothing_left([tree.leader], [tree.port])


def test_an_ignored_sigint_stays_ignored() -> None:
    """A process that ignores SIGINT (a shell's background job) goes on with its servers; they
    are stopped when it ends."""
    with _stand_in("ignore-int") as tree:
        tree.parent.send_signal(signal.SIGINT)
        time.sleep(1.0)
        assert tree.parent.poll() is None
        assert sorted(_members([tree.leader])) == sorted([tree.leader, tree.member])
        tree.parent.send_signal(signal.SIGTERM)
        assert tree.parent.wait(timeout=GONE_WITHIN_S) == -signal.SIGTERM
        _assert_nothing_left([tree.leader], [tree.port])


def test_the_handler_installed_before_is_called_after_the_groups_are_stopped() -> None:
    """A Python handler installed before the first server started (``semblend-sglang serve``'s)
    runs after the groups are stopped, and its exit code stands."""
    with _stand_in("handler") as tree:
        tree.parent.send_signal(signal.SIGTERM)
        assert tree.parent.wait(timeout=GONE_WITHIN_S) == 3
        assert tree.parent.stdout is not None
        seen = json.loads(tree.parent.stdout.readline())
        assert seen == {"handler": signal.SIGTERM, "tracked_then": []}
        _assert_nothing_left([tree.leader], [tree.port])


def test_a_forked_child_does_not_stop_its_parents_groups() -> None:
    """A forked child inherits the registry and the atexit hook, but the groups are not its."""
    with _stand_in("fork") as tree:
        assert tree.parent.stdout is not None
        assert json.loads(tree.parent.stdout.readline()) == {"alive_after_fork_exit": True}
        assert tree.parent.wait(timeout=GONE_WITHIN_S) == 0
        _assert_nothing_left([tree.leader], [tree.port])


# -- the real entry points, the real server -------------------------------------------------

UP_WITHIN_S = 600.0
"""How long the servers may take to come up (a loaded 2-core CI box)."""


def _launchers(proc: subprocess.Popen[str]) -> list[psutil.Process]:
    """``sglang.launch_server`` children of ``proc``."""
    try:
        children = psutil.Process(proc.pid).children()
    except psutil.NoSuchProcess:
        return []
    out = []
    for child in children:
        try:
            if "sglang.launch_server" in " ".join(child.cmdline()):
                out.append(child)
        except psutil.NoSuchProcess:
            continue
    return out


def _port_of(launcher: psutil.Process) -> int:
    args = launcher.cmdline()
    return int(args[args.index("--port") + 1])


def _loading(launcher: psutil.Process) -> bool:
    """The launcher has spawned its scheduler and detokenizer (they load the model next)."""
    try:
        spawned = [c for c in launcher.children() if "spawn_main" in " ".join(c.cmdline())]
    except psutil.NoSuchProcess:
        return False
    return len(spawned) >= 2


def _healthy(launcher: psutil.Process) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{_port_of(launcher)}/health", timeout=5):
            return True
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
        return False


def _signal_when_up(
    command: list[str], cwd: Path, count: int, healthy: bool, sig: signal.Signals
) -> tuple[int, str]:
    """Start ``command``, wait until it has ``count`` servers and each is loading (``healthy``:
    answers /health), send ``sig`` to it alone, and assert that it exits and nothing of its
    servers is left (no process of their groups, every port free). Returns its exit code and
    its output."""
    log = cwd / "command.log"
    with log.open("w") as out:
        proc = subprocess.Popen(
            command,
            cwd=cwd,
            stdout=out,
            stderr=subprocess.STDOUT,
            text=True,
            preexec_fn=_sigint_as_a_terminal_gives_it,
        )
    groups: list[int] = []
    with _cleanup(groups, proc):
        ready = _loading if not healthy else _healthy
        deadline = time.monotonic() + UP_WITHIN_S
        while True:
            launchers = _launchers(proc)
            groups[:] = [launcher.pid for launcher in launchers]
            if len(launchers) >= count and all(ready(launcher) for launcher in launchers):
                break
            assert proc.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.5)
        ports = [_port_of(launcher) for launcher in launchers]
        assert len(_members(groups)) >= 3 * count  # launcher, scheduler, detokenizer each
        proc.send_signal(sig)
        code = proc.wait(timeout=GONE_WITHIN_S)
        _assert_nothing_left(groups, ports)
        return code, log.read_text()


@pytest.mark.e2e
def test_bench_ended_by_sigterm_while_measuring_leaves_no_server(
    smollm2_model_dir: Path, tmp_path: Path
) -> None:
    """``python -m semblend_sglang.bench --quick`` ended by SIGTERM (as ``timeout`` and CI limits
    end it) once its server answers: the server's whole group is gone and its port is free, and
    the bench still ends by SIGTERM. One system, so one server start (--quick's two behave
    alike: one registry stops every started server)."""
    command = [sys.executable, "-m", "semblend_sglang.bench", "--quick"]
    command += ["--systems", "exact_spans", "--workloads", "cross_instruction", "--repeats", "1"]
    command += ["--model-path", str(smollm2_model_dir), "--out", str(tmp_path / "out")]
    code, output = _signal_when_up(command, tmp_path, 1, True, signal.SIGTERM)
    assert code == -signal.SIGTERM, output[-3000:]


@pytest.mark.e2e
def test_bench_interrupted_while_its_server_loads_leaves_no_server(tmp_path: Path) -> None:
    """``bench ttft`` interrupted (SIGINT, Ctrl-C) while its server is loading, before the job's
    own try/finally around the measurement: nothing is left; click reports the abort."""
    command = [sys.executable, "-m", "semblend_sglang.bench", "ttft", "--lengths", "64"]
    code, output = _signal_when_up(command, tmp_path, 1, False, signal.SIGINT)
    assert code == 1 and "Aborted!" in output, output[-3000:]
