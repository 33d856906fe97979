"""The check layer of a ``deviation`` / ``query`` recompute, inside the model forward.

What it selects, the sampled check and the second check are told in docs/sglang.md ("Recompute
budget and quality gate"). This module is the one seam between the recompute and a model's
code: :class:`LayerHook` wraps, per model instance, each decoder layer's ``forward`` (shrunk
positions in; the hidden states shrunk after a check layer, :mod:`.batch_fields`) and the
``RadixAttention`` of every layer (candidates scored there before it writes, by
:mod:`semblend_sglang.recompute`; a dense reference's K/V forced there). After a check layer the
batch is a sparse extend (:mod:`.backends`). :mod:`.check_install` decides at start-up whether
a model takes the hook.

A request whose ``sampling_params.custom_params`` has ``semblend_dense_reference`` true runs
as the *dense reference* of its selection: it keeps every position in every layer, with the
donor's K/V forced wherever the sparse run keeps the donor's; its logits equal the sparse run's
up to float rounding (tests use it).

A forward that does not match the batch that armed it selects nothing: every position still in
the batch is computed in every layer (positions a sampled check left out keep the donor's KV,
which the publish cap keeps out of the exact cache like any reused KV), and the mismatch is
logged once.
"""

from __future__ import annotations

from typing import Any, cast

import torch

from semblend_sglang import recompute
from semblend_sglang.config import Config
from semblend_sglang.recompute import RecomputeStrategy

from ..attention.split_view import check_of, forward_notes
from ..batch_fields import attention_backend, shrink_batch, shrink_hidden
from ..request_info import wants_dense_reference
from .batch_state import batch_reuse
from .check_state import (
    Forced,
    ForwardCheck,
    Recheck,
    RequestCheck,
    drop_unchosen,
    request_starts,
    tail_rows,
)
from .engine_facts import CheckReports
from .request_reuse import CheckOutcome


class LayerHook:
    """The check-layer hook of one model instance in one scheduler process.

    :meth:`arm` is called by ``ForwardBatch.init_new`` for a batch with check candidates; the
    wrapped layers consume it in that batch's forward. Never raises into the forward: an error
    is :meth:`.engine_facts.CheckReports.fail` and leaves the rest of the forward dense
    (exact). It reports to ``flow`` (the request flow, through that protocol)."""

    def __init__(self, flow: CheckReports, model_runner: Any) -> None:
        model = model_runner.model
        layers = model.model.layers
        self.flow = flow
        self.pool = model_runner.token_to_kv_pool
        config = flow.config
        self.check_layer = int(config.recompute_check_layer)
        self.layers = len(layers)
        self.recheck_layer = self.recheck_layer_of(config)
        """The second check's layer of the server's settings (None: one check)."""
        self.last_layer = len(layers) - 1
        self.armed: ForwardCheck | None = None
        self._wrapped: list[Any] = []
        for i, layer in enumerate(layers):
            self._wrap_layer(i, layer)

    def recheck_layer_of(self, settings: Config) -> int | None:
        """The layer of the second check of a request with ``settings`` (None: one check)."""
        depth = settings.recompute_recheck_depth
        return recompute.recheck_layer(depth, self.check_layer, self.layers)

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
                settings = self.flow.config if cand.settings is None else cand.settings
                rechecks = cand.spans > settings.recompute_check_max_spans
                requests.append(
                    RequestCheck(
                        i,
                        req.rid,
                        cand.offsets,
                        cand.final,
                        wants_dense_reference(req),
                        cand.reused,
                        cand.pinned,
                        cand.spans,
                        settings,
                        self.recheck_layer_of(settings) if rechecks else None,
                    )
                )
        if requests:
            self.armed = ForwardCheck(requests, tuple(int(x) for x in lens))

    def _take(self, forward_batch: Any, layer: int) -> ForwardCheck | None:
        check = cast("ForwardCheck | None", check_of(forward_batch))
        if check is not None or layer != 0 or self.armed is None:
            return check
        armed, self.armed = self.armed, None
        lens = forward_batch.extend_seq_lens_cpu
        if lens is None or tuple(int(x) for x in lens) != armed.extend_lens:
            self.flow.fail(
                "check_layer", RuntimeError("the forward is not the batch that armed the check")
            )
            return None
        starts = request_starts(armed)
        pins = [starts[rc.index] + rc.pinned for rc in armed.requests if rc.pinned.numel()]
        if pins:
            rows = torch.cat(pins).to(forward_batch.out_cache_loc.device)
            armed.forced.append(Forced(-1, rows, forward_batch.out_cache_loc[rows]))
        armed.select_at = self.check_layer
        armed.lens = armed.extend_lens
        forward_notes(forward_batch).check = armed
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
            check = cast("ForwardCheck | None", check_of(forward_batch))
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
    def _select(
        self, attn: Any, q: Any, k: Any, v: Any, forward_batch: Any, check: ForwardCheck
    ) -> None:
        """Score each request's candidates at the check layer (before it writes its K/V),
        select (a request with a second check: ``recompute_recheck_width`` times its budget),
        report to the runtime those with no second check and set ``check.keep`` (and the
        reference rows). Each request is selected by its own settings."""
        n = int(k.shape[0])
        k3 = k.reshape(n, attn.tp_k_head_num, -1)
        v3 = v.reshape(n, attn.tp_v_head_num, -1)
        device = k.device
        starts = request_starts(check)
        keep = torch.ones(n, dtype=torch.bool, device=device)
        forced: list[torch.Tensor] = []
        reports: list[CheckOutcome] = []
        for rc in check.requests:
            config = rc.settings
            rows = (starts[rc.index] + rc.offsets).to(device)
            deviation = self._deviation(attn, k3, v3, rows, forward_batch)
            scores = deviation
            if config.recompute_strategy is RecomputeStrategy.QUERY:
                tail = tail_rows(
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
            if rc.recheck_layer is not None and not selection.gated:
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
                    rc.recheck = Recheck(rows[wide], count, selection.residual_deviation)
                chosen = wide
            drop_unchosen(rc, rows, chosen, keep, forced)
            if rc.recheck is None:
                count = int(chosen.numel())
                reports.append(rc.outcome(count, selection.gated, selection.residual_deviation))
        self._kept(check, keep, forced, forward_batch, reports, self.check_layer)

    def _recheck(
        self, attn: Any, q: Any, k: Any, v: Any, forward_batch: Any, check: ForwardCheck
    ) -> None:
        """At a second check layer (before it writes its K/V): of the rows each request
        rechecked at this layer kept at its first check, keep its budget by their K/V
        deviation from the donor's still in their slots; report them and set ``check.keep``
        (and the reference rows)."""
        del q
        layer = int(attn.layer_id)
        n = int(k.shape[0])
        k3 = k.reshape(n, attn.tp_k_head_num, -1)
        v3 = v.reshape(n, attn.tp_v_head_num, -1)
        keep = torch.ones(n, dtype=torch.bool, device=k.device)
        forced: list[torch.Tensor] = []
        reports: list[CheckOutcome] = []
        for rc in check.requests:
            if rc.recheck is None or rc.recheck_layer != layer:
                continue
            recheck, rc.recheck = rc.recheck, None
            rows = recheck.rows
            deviation = self._deviation(attn, k3, v3, rows, forward_batch)
            chosen = recompute.top(deviation, recheck.count)
            drop_unchosen(rc, rows, chosen, keep, forced)
            reports.append(rc.outcome(recheck.count, False, recheck.residual, rechecked=True))
        self._kept(check, keep, forced, forward_batch, reports, layer)

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
        check: ForwardCheck,
        keep: torch.Tensor,
        forced: list[torch.Tensor],
        forward_batch: Any,
        reports: list[CheckOutcome],
        layer: int,
    ) -> None:
        """A check at ``layer`` chose: ``keep`` the rows that stay after it, ``forced`` the
        dense reference rows on donor K/V after it; ``reports`` go to the flow."""
        check.keep = keep
        if forced:
            rows = torch.cat(forced)
            check.forced.append(Forced(layer, rows, forward_batch.out_cache_loc[rows]))
        for outcome in reports:
            self.flow.checked(outcome)

    def _settle(self, check: ForwardCheck) -> None:
        """After the last layer: a second check that did not run (an error before it) reports
        what the first kept, all of it computed since."""
        for rc in check.requests:
            recheck, rc.recheck = rc.recheck, None
            if recheck is not None:
                count = int(recheck.rows.numel())
                self.flow.checked(rc.outcome(count, False, recheck.residual))

    def _shrink(
        self, out: Any, positions: torch.Tensor, forward_batch: Any, check: ForwardCheck
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
            counts = [int(part.sum()) for part in keep.split(list(check.lens))]
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
        pending = [rc.recheck_layer for rc in check.requests if rc.recheck is not None]
        check.select_at = min((x for x in pending if x is not None), default=None)
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


def _radix_attention(layer: Any) -> Any:
    found = [m for m in layer.modules() if type(m).__name__ == "RadixAttention"]
    if len(found) != 1:
        raise TypeError(f"{type(layer).__name__} has {len(found)} RadixAttention modules")
    return found[0]
