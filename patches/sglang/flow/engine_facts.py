"""The flow's seams with what starts with the scheduler: :class:`EngineFacts`, what one
scheduler's start-up tells its request flow, and the protocols each side calls the other by.

:func:`.scheduler_hooks.wrap_scheduler_init` builds the facts when the scheduler is built and
hands them to :meth:`.request_flow.RequestFlow.engine_started`; the flow reads them on every
batch. Until then (an engine-less cache, as in the adapter tests) the defaults hold: no model
known, no stream, no canary. The check layer reports to the flow through :class:`CheckReports`,
so it never imports the flow. Imports nothing of sglang or of the flow.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from semblend_sglang.config import Config

from .request_reuse import CheckOutcome

_T = TypeVar("_T")


class CheckReports(Protocol):
    """What a check layer (:class:`.check_layer.LayerHook`) reports to:
    :class:`.request_flow.RequestFlow` implements it. Called inside the model's forward, on the
    scheduler's thread."""

    config: Config
    """The server's settings (a request's own override them where it has some)."""

    def guarded(
        self, where: str, rid: str | None, default: _T, fn: Callable[..., _T], *args: Any
    ) -> _T:
        """``fn(*args)``, an exception counted and logged once and ``default`` returned."""
        ...

    def fail(self, where: str, exc: BaseException, rid: str | None = None) -> None:
        """An error in the semantic path of request ``rid`` (if any): a counted fallback."""
        ...

    def checked(self, outcome: CheckOutcome) -> None:
        """A check layer chose ``outcome`` for one request."""
        ...


class CheckHook(Protocol):
    """The served model's check-layer hook as the flow calls it
    (:class:`.check_layer.LayerHook`)."""

    def arm(self, batch: Any, forward_batch: Any) -> None:
        """Prepare ``forward_batch``'s forward to check ``batch``'s candidates."""
        ...


class CanaryNotes(Protocol):
    """SGLang's KV canary's recorder as the flow calls it
    (:class:`.kv_canary_record.CanaryRecorder`)."""

    batches: int
    slots: int

    def note(self, batch: Any, forward_batch: Any) -> None:
        """Note ``batch``'s sparse rows for the canary's launches of ``forward_batch``."""
        ...


@dataclass(frozen=True)
class EngineFacts:
    """``forward_stream``: the device stream the engine's forward runs on (None on CPU): the
    K/V copy is ordered after it (:mod:`.span_copy`). ``layer_check``: whether the served model's
    layers take the check-layer recompute (None while no model is known: a strategy that
    selects at a check layer then recomputes nothing; False: such plans are declined as
    ``unsupported_model``). ``check_hook``: the installed hook (None where refused).
    ``canary``: the recorder where sglang runs its KV canary (None otherwise)."""

    forward_stream: Any = None
    layer_check: bool | None = None
    check_hook: CheckHook | None = None
    canary: CanaryNotes | None = None
