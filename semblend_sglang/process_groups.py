"""The child processes this process must not leave behind, stopped when it ends.

An SGLang server runs in its own session (:func:`semblend_sglang.server.start_server` starts it
with ``start_new_session``, so that a Ctrl-C meant for the bench does not reach it half-way and
so that its scheduler and detokenizer can be stopped as one process group). The price: a signal
that ends this process never reaches the server either, and a bench ended by ``timeout`` or a CI
limit (SIGTERM) left its servers running, each holding GBs and its port.

So every such process is registered here when it starts (:func:`track`) and stopped when this
process ends, by one mechanism for every entry point (the bench and its jobs, ``semblend-sglang
serve``, the test harness, the scripts):

- normal exit, an uncaught exception, ``sys.exit`` and a ``KeyboardInterrupt`` that ends the
  program: an :mod:`atexit` hook;
- SIGTERM and SIGINT: a handler, installed by the first :func:`track` from the main thread, that
  stops every registered process (:func:`stop_all`) and then does what the signal did before it
  was installed: a Python handler is called (the default SIGINT handler raises
  ``KeyboardInterrupt``; ``semblend-sglang serve``'s handler too), the default action is taken
  again (SIGTERM ends the process, by that signal). A signal this process ignores (a shell's
  background job ignores SIGINT) stays ignored: the process goes on, and stops its servers when
  it ends. A handler installed later replaces this one; the next :func:`track` puts it back in
  front, calling the newer one afterwards.

SIGKILL cannot be caught: a process killed by it still leaves its servers behind. Stopping is
the same everywhere (:func:`stop`): the process's polite signal, up to a grace period for it to
exit, then SIGKILL to its whole group (what outlived the leader included).
"""

from __future__ import annotations

import atexit
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from types import FrameType
from typing import Any

STOP_SIGNALS: tuple[signal.Signals, ...] = (signal.SIGTERM, signal.SIGINT)
"""The signals on which every registered process is stopped before the signal takes effect."""

SIGNAL_GRACE_S = 5.0
"""How long the registered processes get, all together, to exit on their polite signal when this
process got a stop signal: a CI runner that cancels a job sends SIGKILL some seconds after its
first signal (GitHub Actions: 7.5 s after SIGINT), and an SGLang launcher that has not finished
loading ignores SIGINT, so the SIGKILL that follows must come sooner than that."""

EXIT_GRACE_S = 10.0
"""The same, when this process exits without a signal (atexit)."""

_Handler = Callable[[int, FrameType | None], Any] | int | None


@dataclass(frozen=True)
class _Child:
    process: subprocess.Popen[Any]
    own_group: bool
    polite: signal.Signals


_children: dict[int, _Child] = {}
_owner_pid = os.getpid()
_previous: dict[int, _Handler] = {}
_atexit_registered = False


def track(
    process: subprocess.Popen[Any],
    *,
    own_group: bool,
    polite: signal.Signals = signal.SIGINT,
) -> None:
    """Register ``process`` to be stopped (:func:`stop`) when this process ends: on normal exit
    and on SIGTERM and SIGINT (see the module). ``own_group``: ``process`` leads its own process
    group (started with ``start_new_session``), and whatever is left of the group after it is
    killed too; else only ``process`` is. ``polite``: the signal that asks it to shut down (an
    SGLang launcher stops its scheduler and detokenizer on SIGINT). Installs the signal handlers
    when called from the main thread (only there can Python install them)."""
    global _atexit_registered, _owner_pid
    if not _children:
        _owner_pid = os.getpid()
    _children[process.pid] = _Child(process, own_group, polite)
    if not _atexit_registered:
        atexit.register(_stop_at_exit)
        _atexit_registered = True
    if threading.current_thread() is threading.main_thread():
        _install_handlers()


def tracked_pids() -> list[int]:
    """The pids of the registered processes not yet stopped, in registration order."""
    return list(_children)


def stop(processes: Iterable[subprocess.Popen[Any]], grace: float) -> None:
    """Stop ``processes`` together and unregister them: each registered one still running gets
    its polite signal; whatever has not exited ``grace`` seconds later (one deadline for all) is
    killed, with its whole group when it leads one (members that outlived the leader too, at
    once); each is reaped. Processes not registered (never, or already stopped) are left alone.
    Safe inside a signal handler that interrupted a :meth:`subprocess.Popen.wait` on the same
    processes: it only polls."""
    children = [c for p in processes if (c := _children.get(p.pid)) is not None]
    for child in children:
        if not _exited(child.process):
            _send(child, child.polite, group=False)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and not all(_exited(c.process) for c in children):
        time.sleep(0.1)
    for child in children:
        _send(child, signal.SIGKILL, group=child.own_group)
    for child in children:
        try:
            child.process.wait(timeout=1.0)
        except subprocess.TimeoutExpired:
            pass  # a wait() this signal handler interrupted holds Popen's lock; it reaps
        _children.pop(child.process.pid, None)


def _exited(process: subprocess.Popen[Any]) -> bool:
    """True once ``process`` has exited, without reaping it: Popen's own poll() reports a
    running process while a wait() that a signal handler interrupted holds its lock."""
    if process.returncode is not None:
        return True
    try:
        state = os.waitid(os.P_PID, process.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return True  # reaped by someone else
    return state is not None


def stop_all(grace: float) -> None:
    """:func:`stop` every registered process of this process (none in a forked child, which
    inherited the registry but does not own the processes)."""
    if os.getpid() == _owner_pid:
        stop([c.process for c in list(_children.values())], grace)


def _send(child: _Child, sig: int, group: bool) -> None:
    """Send ``sig`` to ``child``'s process group when ``group``, else to ``child`` while it is
    unreaped (a reaped pid may be another process's). A group id outlives its reaped leader while
    any member is left (Linux does not hand out a pid still in use as a group id), so members
    that outlived the leader are reached. A process or group already gone is not an error."""
    try:
        if group:
            os.killpg(child.process.pid, sig)
        elif child.process.returncode is None:
            os.kill(child.process.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _install_handlers() -> None:
    """Put :func:`_on_signal` in front of each stop signal's current handler, unless it is
    there already or the signal is ignored."""
    for sig in STOP_SIGNALS:
        current = signal.getsignal(sig)
        if current is _on_signal or current == signal.SIG_IGN:
            continue
        _previous[sig] = current
        signal.signal(sig, _on_signal)


def _on_signal(signum: int, frame: FrameType | None) -> None:
    """Stop every registered process, then do what ``signum`` did before."""
    stop_all(SIGNAL_GRACE_S)
    previous = _previous.get(signum)
    if callable(previous):
        previous(signum, frame)
        return
    # SIG_DFL, or a handler set outside Python (None): the default action, by the same signal.
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)
    raise SystemExit(128 + signum)  # only if the default action did not end the process


def _stop_at_exit() -> None:
    stop_all(EXIT_GRACE_S)
