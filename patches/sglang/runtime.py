"""Per-process semblend state shared by the SGLang hooks: the provider, the counters and the
settings learned at start-up. A request's reuse state is the request flow's
(:mod:`.request_flow`), donors are its :class:`~.donor_kv.DonorKV`'s.

One :class:`SemblendRuntime` per scheduler process (TP ranks each have their own and, fed the same
calls, decide the same). It imports no sglang module; the adapter passes sglang objects in.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from semblend_sglang.config import Config
from semblend_sglang.kernels import RopeSpec
from semblend_sglang.lookup_params import LookupParams
from semblend_sglang.once_log import OnceLog
from semblend_sglang.plan import Decision, Reason
from semblend_sglang.provider import SemanticProvider

from .attention.hook_kit import sparse_batch_counts
from .flow.request_reuse import CheckOutcome

logger = logging.getLogger(__name__)


@dataclass
class RecomputeCounts:
    """Counters of the recompute budget (process lifetime).

    ``checks``: request chunks that reached a check layer; ``gated``: of those, refused by the
    quality gate; ``rechecks``: of those, selected again at the second check layer
    (``recompute_recheck_depth``); ``residual_deviation_sum``: the sum over checks of the mean
    relative K/V deviation the first check's budget left unrecomputed (divide by ``checks``
    for the mean)."""

    checks: int = 0
    gated: int = 0
    rechecks: int = 0
    residual_deviation_sum: float = 0.0


SETTINGS_COUNTERS = ("planned", "materialized", "reused_tokens", "recomputed_tokens")
PASSAGE_OUTCOMES = ("reordered", "kept", "declined")
"""What the arrival hook did with a request that declared passages (:mod:`.passage_order`):
put them in another order, kept the request's own (nothing held, or held in that order), or
left them alone (a malformed declaration, input logprobs over them)."""
"""What the snapshot's ``by_settings`` counts per settings label
(:attr:`~semblend_sglang.request_settings.RequestSettings.label`): plans started, plans that
reused KV, the tokens they kept and the reused positions they recomputed."""


class SemblendRuntime:
    """Holds one scheduler process's provider, counters and the settings learned at start-up.

    The request flow and the hooks call it. By request id it keeps only (in the provider) a
    request's first decision, until the flow's release; the rest of a request's reuse state is
    the request flow's.
    :meth:`log_failure` logs an error once per place and exception type.
    """

    def __init__(self, config: Config, *, registry: Any = None) -> None:
        self._config = config
        self._provider = SemanticProvider(
            config, None, registry=registry, detokenize=self.detokenize
        )
        self._rope_spec: RopeSpec | None = None
        self._rope_error: str | None = None
        self._failures = OnceLog(logger)
        self._tokenizer: Any = None
        self._flow_part: Callable[[], dict[str, Any]] = dict
        self._recompute = RecomputeCounts()
        self._by_settings: dict[str, dict[str, int]] = {}
        """:data:`SETTINGS_COUNTERS` per settings label (:meth:`count_settings`)."""
        self._passage_orders: dict[str, int] = dict.fromkeys(PASSAGE_OUTCOMES, 0)
        """Requests that declared passages, by :data:`PASSAGE_OUTCOMES`; ``held_tokens``: the
        passage tokens the chosen orders put behind an exact prefix; ``joins``: places where they
        put a passage after the one it follows in a donor."""
        self._passage_orders["held_tokens"] = 0
        self._passage_orders["joins"] = 0
        self._refused: tuple[str, ...] = ()
        """Server options that rule reuse out (:meth:`refuse`); empty while reuse may run."""
        self._reuse_off: tuple[str, ...] = ()
        """Every reason known at start-up why no request of this scheduler will reuse KV (the
        refused options, an attention backend that declines every plan): :meth:`note_reuse_off`;
        ``reuse_off`` of the snapshot."""

    @property
    def config(self) -> Config:
        """The server's settings (fixed at construction)."""
        return self._config

    @property
    def provider(self) -> SemanticProvider:
        """The process's one :class:`~semblend_sglang.provider.SemanticProvider`."""
        return self._provider

    # ----------------------------------------------------------------- start-up
    def report_flow(self, part: Callable[[], dict[str, Any]]) -> None:
        """The request flow that owns this runtime adds ``part()`` (its donors' and the KV
        canary's counters) to every :meth:`snapshot`; called once, by its constructor."""
        self._flow_part = part

    def refuse(self, options: list[str]) -> None:
        """The server runs with ``options`` that semantic reuse does not support: log them once
        (one line) and stay out of every request from now on (no lookup, no donor)."""
        self._refused = tuple(options)
        self._reuse_off += tuple(options)
        logger.warning(
            "semblend: semantic reuse is off in this scheduler; unsupported server options: %s",
            "; ".join(options),
        )

    def note_reuse_off(self, reason: str) -> None:
        """Record a start-up ``reason`` why no plan of this scheduler can be served (its caller
        has logged it once); requests are still looked up and declined with their reason."""
        if reason not in self._reuse_off:
            self._reuse_off += (reason,)

    @property
    def active(self) -> bool:
        """True unless :meth:`refuse` turned reuse off."""
        return not self._refused

    def snapshot(self) -> dict[str, Any]:
        """The provider's snapshot plus ``unsupported_options`` (what :meth:`refuse` named),
        ``reuse_off`` (every start-up reason reuse cannot happen here), what the flow reports
        (:meth:`report_flow`: the donor KV's counters and ``kv_canary_recorded``),
        ``sparse_extend_batches`` (batches holding a sparse request, by attention path) and
        ``passage_orders`` (:meth:`count_passage_order`)."""
        snap = self._provider.snapshot()
        snap["unsupported_options"] = list(self._refused)
        snap["reuse_off"] = list(self._reuse_off)
        snap.update(self._flow_part())
        snap["recompute_checks"] = self._recompute.checks
        snap["recompute_gated"] = self._recompute.gated
        snap["recompute_rechecks"] = self._recompute.rechecks
        snap["recompute_residual_deviation_sum"] = self._recompute.residual_deviation_sum
        snap["by_settings"] = {label: dict(c) for label, c in sorted(self._by_settings.items())}
        snap["passage_orders"] = dict(self._passage_orders)
        snap["sparse_extend_batches"] = sparse_batch_counts()
        return snap

    # ----------------------------------------------------------------- lookups and outcomes
    def lookup(self, params: LookupParams) -> Decision:
        """The provider's decision for one request (:meth:`SemanticProvider.lookup`)."""
        return self._provider.lookup(params)

    def count_settings(self, label: str, counter: str, amount: int = 1) -> None:
        """Add ``amount`` to ``counter`` (one of :data:`SETTINGS_COUNTERS`) of the requests
        served with settings ``label``."""
        counts = self._by_settings.setdefault(label, dict.fromkeys(SETTINGS_COUNTERS, 0))
        counts[counter] += amount

    def count_passage_order(self, outcome: str, held_tokens: int = 0, joins: int = 0) -> None:
        """One request's passages got ``outcome`` (one of :data:`PASSAGE_OUTCOMES`), its chosen
        order putting ``held_tokens`` passage tokens behind an exact prefix and making ``joins``
        donor-run joins (:func:`~semblend_sglang.passages.donor_runs`)."""
        self._passage_orders[outcome] += 1
        self._passage_orders["held_tokens"] += held_tokens
        self._passage_orders["joins"] += joins

    def observe_copy(self, seconds: float) -> None:
        """One prefill batch's donor K/V copy took ``seconds`` (device work included)."""
        self._provider.telemetry.observe_copy(seconds)

    def count_recomputed(self, tokens: int) -> None:
        """``tokens`` reused positions were recomputed (span heads, or at a check layer)."""
        self._provider.telemetry.observe_recomputed(tokens)

    def count_check(self, outcome: CheckOutcome) -> None:
        """A check layer chose ``outcome`` for one chunk of a request."""
        self.count_recomputed(outcome.recomputed)
        self._recompute.checks += 1
        self._recompute.gated += int(outcome.gated)
        self._recompute.rechecks += int(outcome.rechecked)
        self._recompute.residual_deviation_sum += outcome.residual

    def observe_hook(self, seconds: float) -> None:
        """An engine hook took ``seconds``."""
        self._provider.telemetry.observe_hook(seconds)

    def record_error(self, where: str) -> None:
        """Count an error at ``where`` that is no request's outcome."""
        self._provider.telemetry.record_error(where)

    def log_failure(self, where: str, exc: BaseException) -> None:
        """Log an error of the semantic path, once per ``where`` and exception type."""
        self._failures.log(where, exc)

    # ----------------------------------------------------------------- model
    def detokenize(self, token_ids: list[int]) -> str:
        """Text of ``token_ids`` with the served model's tokenizer (substitute-mode embedding
        gate only; loaded on first use from the server's tokenizer path, offline)."""
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            from .request_info import served_tokenizer_path

            path = served_tokenizer_path()
            if path is None:
                raise FileNotFoundError("no tokenizer path known to this process")
            self._tokenizer = AutoTokenizer.from_pretrained(path)
        text: str = self._tokenizer.decode(token_ids, skip_special_tokens=True)
        return text

    def use_model_config(self, hf_config: Any) -> None:
        """Take the served model's RoPE from ``hf_config``, the HF config the engine resolved
        (``--json-model-override-args`` and ``--revision`` applied), instead of reading
        config.json later. An unsupported RoPE is logged once and every plan is declined."""
        try:
            self._rope_spec = RopeSpec.from_hf_config(hf_config)
            self._rope_error = None
        except Exception as exc:
            self._rope_spec = None
            self._rope_error = f"{type(exc).__name__}: {exc}"
            logger.warning(
                "semblend: cannot reuse KV for this model (%s); every plan is declined as %s",
                self._rope_error,
                Reason.UNSUPPORTED_CACHE,
            )
            self.note_reuse_off(f"the model's RoPE: {self._rope_error}")

    def rope_spec(self, model_path: str | None) -> RopeSpec | None:
        """RoPE of the served model, read once from its config.json; None (logged once) when
        the model's rotary embedding is not supported or its config cannot be read."""
        if self._rope_spec is not None or self._rope_error is not None:
            return self._rope_spec
        try:
            if model_path is None:
                raise FileNotFoundError("no model path known to this process")
            config_file = Path(model_path) / "config.json"
            if config_file.is_file():
                hf_config: Any = json.loads(config_file.read_text())
            else:
                from transformers import AutoConfig

                hf_config = AutoConfig.from_pretrained(model_path)
            self._rope_spec = RopeSpec.from_hf_config(hf_config)
        except Exception as exc:
            self._rope_error = f"{type(exc).__name__}: {exc}"
            logger.warning(
                "semblend: cannot reuse KV for this model (%s); every plan is declined as %s",
                self._rope_error,
                Reason.UNSUPPORTED_CACHE,
            )
        return self._rope_spec
