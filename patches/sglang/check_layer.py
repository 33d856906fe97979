"""The check layer of a ``deviation`` / ``query`` recompute, inside the model forward.

A batch whose reused positions are selected at a check layer (:class:`.one_pass.BatchReuse`)
computes its candidates up to that layer: every copied position, or with
``recompute_check_share`` below 1 a sample of them (the others left the batch before the first
layer and keep the donor's KV in every layer). At the check layer's attention, before it
writes, each request's candidates are scored against the donor K/V still in their slots
(:mod:`semblend_sglang.recompute`); the unselected ones leave the batch right after the layer,
so the layers after it compute only the gaps and the selected positions, their donor KV staying
in the slots. The attention is then a sparse extend (:mod:`.attention`).

With ``recompute_recheck_depth`` set, a plan of more than ``recompute_check_max_spans`` spans is
checked twice: the check layer keeps ``recompute_recheck_width`` times its budget, and at the
second check layer (:func:`~semblend_sglang.recompute.recheck_layer`) the K/V deviation of those
(computed beside donor K/V since the first) keeps the budget; the others leave the batch after
that layer. The second check scores the deviation whatever the strategy.

This module is the one seam between the recompute and a model's code: it wraps, per model
instance, each decoder layer's ``forward`` (to pass the shrunk positions and to shrink the
hidden states after the check layer) and the ``RadixAttention`` of every layer (a dense
reference's K/V are forced there). It knows the decoder layers of
:data:`KNOWN_MODEL_CLASSES` (``forward(positions, hidden_states, forward_batch, ...)``
returning sglang's residual-stream handle, or a ``(hidden, residual)`` pair); on any other
model, pipeline or attention parallelism, or a check layer outside the model, :func:`install`
logs one line and refuses (plans are then declined as ``unsupported_model``).

A request whose ``sampling_params.custom_params`` has ``semblend_dense_reference`` true runs
as the *dense reference* of its selection: it keeps every position in every layer; the K/V of
its copied positions left out of the sample are replaced by the donor's before attention in
every layer, and those of its unselected candidates in the layers after the check layer that
dropped them. Its logits equal the sparse run's up to float rounding (tests use it).

If a forward does not match the batch that armed it, nothing is selected: every position still
in the batch is computed in every layer (a cold prefill's result with a dense check; with a
sample, the positions left out keep the donor's KV, which the publish cap keeps out of the
exact cache like any reused KV), and the mismatch is logged once.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch

from semblend_sglang import recompute
from semblend_sglang.plan import Reason
from semblend_sglang.recompute import RecomputeStrategy

from .batch_shrink import attention_backend, shrink_batch, shrink_hidden
from .one_pass import batch_reuse
from .request_flow import RequestFlow
from .request_info import wants_dense_reference

logger = logging.getLogger(__name__)

KNOWN_MODEL_CLASSES = frozenset(
    {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"}
)
"""Model classes whose decoder layers this seam knows."""

_FORWARD_ATTR = "_semblend_forward_check"
_WRAPPED_ATTR = "_semblend_layer_hook"


@dataclass
class _Recheck:
    """A request's second check: ``rows`` (in the forward's current rows) kept by the first,
    of which ``count`` are kept; the first check's quality-gate ``residual``."""

    rows: torch.Tensor
    count: int
    residual: float


@dataclass
class _RequestCheck:
    index: int
    rid: str
    offsets: torch.Tensor
    final: bool
    reference: bool
    reused: int
    pinned: torch.Tensor
    spans: int
    recheck: _Recheck | None = None


@dataclass
class _Forced:
    """Dense reference rows (in the forward's current rows) whose K/V are the donor's, read
    from ``slots``, in every layer after ``after``."""

    after: int
    rows: torch.Tensor
    slots: torch.Tensor


@dataclass
class _ForwardCheck:
    """One forward's check: armed by ``ForwardBatch.init_new``, bound to the forward whose
    extend lengths are ``extend_lens``. ``select_at``: the layer whose attention selects next
    (None: no more); ``keep``: the rows that stay after layer ``shrink_at``; ``lens``: the
    per-request rows of the forward now; ``forced``: dense reference rows on donor K/V."""

    requests: list[_RequestCheck]
    extend_lens: tuple[int, ...]
    select_at: int | None = None
    keep: torch.Tensor | None = None
    shrink_at: int | None = None
    lens: tuple[int, ...] = ()
    positions: torch.Tensor | None = None
    forced: list[_Forced] = field(default_factory=list)


class LayerHook:
    """The check-layer hook of one model instance in one scheduler process.

    :meth:`arm` is called by ``ForwardBatch.init_new`` for a batch with check candidates; the
    wrapped layers consume it in that batch's forward. Never raises into the forward: an error
    is :meth:`RequestFlow.fail` and leaves the rest of the forward dense (exact)."""

    def __init__(self, flow: RequestFlow, model_runner: Any) -> None:
        model = model_runner.model
        layers = model.model.layers
        runtime = flow.runtime
        self.flow = flow
        self.runtime = runtime
        self.pool = model_runner.token_to_kv_pool
        config = runtime.config
        self.check_layer = int(config.recompute_check_layer)
        self.recheck_layer = recompute.recheck_layer(
            config.recompute_recheck_depth, self.check_layer, len(layers)
        )
        self.strategy = config.recompute_strategy
        self.last_layer = len(layers) - 1
        self.armed: _ForwardCheck | None = None
        self._wrapped: list[Any] = []
        for i, layer in enumerate(layers):
            self._wrap_layer(i, layer)

    # ------------------------------------------------------------------ arming
    def arm(self, batch: Any, forward_batch: Any) -> None:
        """Bind ``batch``'s check candidates to the forward of ``forward_batch`` (the result of
        ``init_new`` for it). A previous arming that no forward took is dropped."""
        self.armed = None
        reuse = batch_reuse(batch)
        found = None if reuse is None else reuse.candidates
        if not found or not forward_batch.forward_mode.is_extend():
            return
        lens = forward_batch.extend_seq_lens_cpu
        if lens is None:
            return
        requests = []
        for i, req in enumerate(batch.reqs):
            cand = found.get(req.rid)
            if cand is not None and cand.offsets.numel():
                requests.append(
                    _RequestCheck(
                        i,
                        req.rid,
                        cand.offsets,
                        cand.final,
                        wants_dense_reference(req),
                        cand.reused,
                        cand.pinned,
                        cand.spans,
                    )
                )
        if requests:
            self.armed = _ForwardCheck(requests, tuple(int(x) for x in lens))

    def _take(self, forward_batch: Any, layer: int) -> _ForwardCheck | None:
        check: _ForwardCheck | None = forward_batch.__dict__.get(_FORWARD_ATTR)
        if check is not None or layer != 0 or self.armed is None:
            return check
        armed, self.armed = self.armed, None
        lens = forward_batch.extend_seq_lens_cpu
        if lens is None or tuple(int(x) for x in lens) != armed.extend_lens:
            self.flow.fail(
                "check_layer", RuntimeError("the forward is not the batch that armed the check")
            )
            return None
        starts = _request_starts(armed)
        pins = [starts[rc.index] + rc.pinned for rc in armed.requests if rc.pinned.numel()]
        if pins:
            rows = torch.cat(pins).to(forward_batch.out_cache_loc.device)
            armed.forced.append(_Forced(-1, rows, forward_batch.out_cache_loc[rows]))
        armed.select_at = self.check_layer
        armed.lens = armed.extend_lens
        setattr(forward_batch, _FORWARD_ATTR, armed)
        return armed

    # ------------------------------------------------------------------ wrappers
    def _wrap_layer(self, index: int, layer: Any) -> None:
        orig = layer.forward
        hook = self

        def forward(
            positions: Any, hidden_states: Any, forward_batch: Any, *args: Any, **kw: Any
        ) -> Any:
            check = hook._take(forward_batch, index)
            if check is None:
                return orig(positions, hidden_states, forward_batch, *args, **kw)
            if check.positions is not None:
                positions = check.positions
            out = orig(positions, hidden_states, forward_batch, *args, **kw)
            if index == check.shrink_at:
                out = hook.flow.guarded(
                    "check_layer", None, out, hook._shrink, out, positions, forward_batch, check
                )
            if index == hook.last_layer:
                hook.flow.guarded("check_layer", None, None, hook._settle, check)
            return out

        layer.forward = forward
        self._wrapped.append(layer)
        attn = _radix_attention(layer)
        attn_orig = attn.forward

        def attn_forward(q: Any, k: Any, v: Any, forward_batch: Any, *args: Any, **kw: Any) -> Any:
            check = forward_batch.__dict__.get(_FORWARD_ATTR)
            if check is not None and k is not None:
                if index == check.select_at:
                    select = hook._select if index == hook.check_layer else hook._recheck
                    check.select_at = None
                    hook.flow.guarded(
                        "check_layer", None, None, select, attn, q, k, v, forward_batch, check
                    )
                    if check.keep is not None:
                        check.shrink_at = index
                forced = [f for f in check.forced if f.after < index]
                if forced:
                    rows = torch.cat([f.rows for f in forced])
                    slots = torch.cat([f.slots for f in forced])
                    k, v = hook._force(attn, k, v, rows, slots)
            return attn_orig(q, k, v, forward_batch, *args, **kw)

        attn.forward = attn_forward
        self._wrapped.append(attn)

    def remove(self) -> None:
        """Restore every wrapped module's own ``forward``."""
        for module in self._wrapped:
            module.__dict__.pop("forward", None)
        self._wrapped.clear()

    # ------------------------------------------------------------------ the check
    def _rechecks(self, rc: _RequestCheck) -> bool:
        return (
            self.recheck_layer is not None
            and rc.spans > self.runtime.config.recompute_check_max_spans
        )

    def _select(
        self, attn: Any, q: Any, k: Any, v: Any, forward_batch: Any, check: _ForwardCheck
    ) -> None:
        """Score each request's candidates at the check layer (before it writes its K/V),
        select (a request with a second check: ``recompute_recheck_width`` times its budget),
        report to the runtime those with no second check and set ``check.keep`` (and the
        reference rows)."""
        config = self.runtime.config
        n = int(k.shape[0])
        k3 = k.reshape(n, attn.tp_k_head_num, -1)
        v3 = v.reshape(n, attn.tp_v_head_num, -1)
        device = k.device
        starts = _request_starts(check)
        keep = torch.ones(n, dtype=torch.bool, device=device)
        forced: list[torch.Tensor] = []
        reports: list[tuple[_RequestCheck, int, bool, float]] = []
        for rc in check.requests:
            rows = (starts[rc.index] + rc.offsets).to(device)
            deviation = self._deviation(attn, k3, v3, rows, forward_batch)
            scores = deviation
            if self.strategy is RecomputeStrategy.QUERY:
                tail = _tail_rows(
                    starts[rc.index], check.extend_lens[rc.index], rc.offsets, rc.pinned
                )
                q3 = q.reshape(n, attn.tp_q_head_num, -1)
                scores = recompute.query_attention(
                    q3[tail.to(device)], k3[rows], float(attn.scaling)
                )
            selection = recompute.select(
                scores,
                deviation,
                config.recompute_ratio,
                config.quality_gate,
                config.recompute_min_deviation,
                rc.reused,
            )
            chosen = selection.recompute
            if self._rechecks(rc) and not selection.gated:
                # the floor judges the check layer's deviation, too shallow for these plans:
                # a rechecked plan spends its whole budget
                wide = recompute.select(
                    scores,
                    deviation,
                    config.recompute_ratio * config.recompute_recheck_width,
                    0.0,
                    0.0,
                    rc.reused,
                ).recompute
                count = min(int(rows.numel()), recompute.budget(rc.reused, config.recompute_ratio))
                if wide.numel() > count:  # else it is the budget (width 1, or every candidate)
                    rc.recheck = _Recheck(rows[wide], count, selection.residual_deviation)
                chosen = wide
            _drop_unchosen(rc, rows, chosen, keep, forced)
            if rc.recheck is None:
                reports.append(
                    (rc, int(chosen.numel()), selection.gated, selection.residual_deviation)
                )
        self._kept(check, keep, forced, forward_batch, reports, self.check_layer)

    def _recheck(
        self, attn: Any, q: Any, k: Any, v: Any, forward_batch: Any, check: _ForwardCheck
    ) -> None:
        """At the second check layer (before it writes its K/V): of the rows each rechecked
        request's first check kept, keep its budget by their K/V deviation from the donor's
        still in their slots; report them and set ``check.keep`` (and the reference rows)."""
        del q
        n = int(k.shape[0])
        k3 = k.reshape(n, attn.tp_k_head_num, -1)
        v3 = v.reshape(n, attn.tp_v_head_num, -1)
        keep = torch.ones(n, dtype=torch.bool, device=k.device)
        forced: list[torch.Tensor] = []
        reports: list[tuple[_RequestCheck, int, bool, float]] = []
        for rc in check.requests:
            recheck, rc.recheck = rc.recheck, None
            if recheck is None:
                continue
            rows = recheck.rows
            deviation = self._deviation(attn, k3, v3, rows, forward_batch)
            chosen = recompute.top(deviation, recheck.count)
            _drop_unchosen(rc, rows, chosen, keep, forced)
            reports.append((rc, recheck.count, False, recheck.residual))
        assert self.recheck_layer is not None
        self._kept(check, keep, forced, forward_batch, reports, self.recheck_layer)

    def _deviation(
        self, attn: Any, k3: Any, v3: Any, rows: torch.Tensor, forward_batch: Any
    ) -> torch.Tensor:
        """The relative deviation of this layer's K/V at ``rows`` (before it writes) from the
        donor K/V still in their slots."""
        slots = forward_batch.out_cache_loc[rows]
        k_pool = self.pool.get_key_buffer(attn.layer_id)
        v_pool = self.pool.get_value_buffer(attn.layer_id)
        return recompute.relative(
            *recompute.kv_deviation(k3[rows], v3[rows], k_pool[slots], v_pool[slots])
        )

    def _kept(
        self,
        check: _ForwardCheck,
        keep: torch.Tensor,
        forced: list[torch.Tensor],
        forward_batch: Any,
        reports: list[tuple[_RequestCheck, int, bool, float]],
        layer: int,
    ) -> None:
        """A check at ``layer`` chose: ``keep`` the rows that stay after it, ``forced`` the
        dense reference rows on donor K/V after it; ``reports`` go to the flow."""
        check.keep = keep
        if forced:
            rows = torch.cat(forced)
            check.forced.append(_Forced(layer, rows, forward_batch.out_cache_loc[rows]))
        second = layer != self.check_layer
        for rc, count, gated, residual in reports:
            self.flow.checked(rc.rid, count, gated, residual, rc.final, second)

    def _settle(self, check: _ForwardCheck) -> None:
        """After the last layer: a second check that did not run (an error before it) reports
        what the first kept, all of it computed since."""
        for rc in check.requests:
            recheck, rc.recheck = rc.recheck, None
            if recheck is not None:
                count = int(recheck.rows.numel())
                self.flow.checked(rc.rid, count, False, recheck.residual, rc.final)

    def _shrink(
        self, out: Any, positions: torch.Tensor, forward_batch: Any, check: _ForwardCheck
    ) -> Any:
        """After a check layer: drop the rows it did not keep from the hidden states and the
        forward batch (later layers get ``check.positions``); the rows still to be rechecked
        and the forced rows follow, and a pending second check is scheduled."""
        keep = check.keep
        assert keep is not None
        check.keep, check.shrink_at = None, None
        if not bool(keep.all()):
            backend = attention_backend(forward_batch)
            if backend is None:  # before any change: the later layers then compute every row
                raise RuntimeError("no attention backend to rebuild the shrunk batch's metadata")
            index = torch.nonzero(keep).flatten()
            out = shrink_hidden(out, index, forward_batch)
            counts = []
            start = 0
            for length in check.lens:
                counts.append(int(keep[start : start + length].sum()))
                start += length
            shrink_batch(forward_batch, index, positions, check.lens, counts)
            check.lens = tuple(counts)
            check.positions = forward_batch.positions
            backend.init_forward_metadata(forward_batch)
            moved = torch.cumsum(keep.to(torch.int64), 0) - 1
            for f in check.forced:
                f.rows = moved[f.rows]
            for rc in check.requests:
                if rc.recheck is not None:
                    rc.recheck.rows = moved[rc.recheck.rows]
        if any(rc.recheck is not None for rc in check.requests):
            check.select_at = self.recheck_layer
        return out

    def _force(
        self, attn: Any, k: Any, v: Any, rows: torch.Tensor, slots: torch.Tensor
    ) -> tuple[Any, Any]:
        """Dense reference: the K/V of ``rows`` become the donor's, read from their ``slots``
        (in this layer's pool, before the attention writes)."""
        pool = self.pool
        n = int(k.shape[0])
        k3 = k.reshape(n, attn.tp_k_head_num, -1).clone()
        v3 = v.reshape(n, attn.tp_v_head_num, -1).clone()
        k3[rows] = pool.get_key_buffer(attn.layer_id)[slots].to(k3.dtype)
        v3[rows] = pool.get_value_buffer(attn.layer_id)[slots].to(v3.dtype)
        return k3.reshape(k.shape), v3.reshape(v.shape)


# -------------------------------------------------------------------------- helpers
def _request_starts(check: _ForwardCheck) -> list[int]:
    """The first row of each of the batch's requests in the forward of ``check`` (before the
    check layer), by request index."""
    starts = [0]
    for length in check.extend_lens[:-1]:
        starts.append(starts[-1] + length)
    return starts


def _drop_unchosen(
    rc: _RequestCheck,
    rows: torch.Tensor,
    chosen: torch.Tensor,
    keep: torch.Tensor,
    forced: list[torch.Tensor],
) -> None:
    """The ``rows`` of request ``rc`` not at the indices ``chosen`` leave the batch after this
    check (False in ``keep``), or, for a dense reference, stay on the donor's K/V (``forced``)."""
    dropped = torch.ones(rows.numel(), dtype=torch.bool, device=rows.device)
    dropped[chosen] = False
    if rc.reference:
        forced.append(rows[dropped])
    else:
        keep[rows[dropped]] = False


def _radix_attention(layer: Any) -> Any:
    found = [m for m in layer.modules() if type(m).__name__ == "RadixAttention"]
    if len(found) != 1:
        raise TypeError(f"{type(layer).__name__} has {len(found)} RadixAttention modules")
    return found[0]


def _tail_rows(
    start: int, length: int, offsets: torch.Tensor, pinned: torch.Tensor
) -> torch.Tensor:
    """The last :data:`~semblend_sglang.recompute.QUERY_TAIL_TOKENS` rows of a request's
    segment that are neither candidates nor pinned (the prompt's own tail)."""
    mine = torch.ones(length, dtype=torch.bool)
    mine[offsets] = False
    mine[pinned] = False
    rows = torch.nonzero(mine).flatten()[-recompute.QUERY_TAIL_TOKENS :]
    return rows + start


def refusal(model_runner: Any, check_layer: int) -> str | None:
    """Why the model of ``model_runner`` cannot take the check-layer hook, or None."""
    model = getattr(model_runner, "model", None)
    name = type(model).__name__
    if name not in KNOWN_MODEL_CLASSES:
        return f"model class {name} is not one the check-layer hook knows"
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        return f"{name} has no model.layers"
    start = int(getattr(model.model, "start_layer", 0))
    end = int(getattr(model.model, "end_layer", len(layers)))
    if start != 0 or end != len(layers):
        return "pipeline parallelism splits the layers"
    if not 0 <= check_layer < end - 1:
        return f"recompute_check_layer {check_layer} is not below the last layer ({end - 1})"
    server_args = getattr(model_runner, "server_args", None)
    if getattr(server_args, "enable_dp_attention", False):
        return "data-parallel attention"
    for arg in ("tp_size", "attn_cp_size", "dcp_size"):
        if int(getattr(server_args, arg, 1) or 1) > 1:
            return f"--{arg.replace('_', '-')} > 1 (ranks would score different heads)"
    return None


def model_runner_of(scheduler: Any) -> Any:
    """The model runner of a scheduler (``tp_worker.model_runner``, or the legacy
    ``tp_worker.worker.model_runner``), or None."""
    worker = getattr(scheduler, "tp_worker", None)
    runner = getattr(worker, "model_runner", None)
    if runner is None:
        runner = getattr(getattr(worker, "worker", None), "model_runner", None)
    return runner


def install(flow: RequestFlow, model_runner: Any) -> LayerHook | None:
    """Scheduler start: wrap the served model's layers when the configured strategy selects
    at a check layer (a model wrapped already reports to ``flow`` from now on), and set
    :attr:`SemblendRuntime.layer_check`. On a model this seam does not take, one warning names
    why, ``layer_check`` is False and None is returned."""
    runtime = flow.runtime
    if not runtime.config.recompute_strategy.uses_check_layer:
        return None
    model = getattr(model_runner, "model", None)
    if model is not None and getattr(model, _WRAPPED_ATTR, None) is not None:
        hook: LayerHook = getattr(model, _WRAPPED_ATTR)
        hook.flow, hook.runtime = flow, runtime
        runtime.layer_check = True
        runtime.check_hook = hook
        return hook
    reason = refusal(model_runner, int(runtime.config.recompute_check_layer))
    if reason is None:
        try:
            hook = LayerHook(flow, model_runner)
        except Exception as exc:
            reason = f"{type(exc).__name__}: {exc}"
    if reason is not None:
        runtime.layer_check = False
        logger.warning(
            "semblend: recompute_strategy=%s needs the check-layer hook, which refuses this "
            "model (%s); every plan is declined as %s",
            runtime.config.recompute_strategy,
            reason,
            Reason.UNSUPPORTED_MODEL,
        )
        return None
    object.__setattr__(model, _WRAPPED_ATTR, hook)
    runtime.layer_check = True
    runtime.check_hook = hook
    config = runtime.config
    if config.recompute_recheck_depth > 0.0 and hook.recheck_layer is None:
        logger.warning(
            "semblend: recompute_recheck_depth=%s puts the second check at layer %d, not after "
            "recompute_check_layer=%d and before the last layer (%d): plans are checked once",
            config.recompute_recheck_depth,
            round(config.recompute_recheck_depth * (hook.last_layer + 1)),
            hook.check_layer,
            hook.last_layer,
        )
    elif hook.recheck_layer is not None:
        logger.info(
            "semblend: plans of more than %d spans are checked again at layer %d of %d",
            config.recompute_check_max_spans,
            hook.recheck_layer,
            hook.last_layer + 1,
        )
    if config.quality_gate > 0.0 and config.recompute_check_share < 1.0:
        logger.warning(
            "semblend: quality_gate is set, so every plan is checked on all its reused "
            "positions (recompute_check_share=%s is not used)",
            config.recompute_check_share,
        )
    return hook
