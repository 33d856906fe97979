"""The check layer of a ``deviation`` / ``query`` recompute, inside the model forward.

A batch whose reused positions are selected at a check layer (:class:`.one_pass.BatchReuse`)
computes its candidates up to that layer: every copied position, or with
``recompute_check_share`` below 1 a sample of them (the others left the batch before the first
layer and keep the donor's KV in every layer). At the check layer's attention, before it
writes, each request's candidates are scored against the donor K/V still in their slots
(:mod:`semblend_sglang.recompute`); the unselected ones leave the batch right after the layer,
so the layers after it compute only the gaps and the selected positions, their donor KV staying
in the slots. The attention is then a sparse extend (:mod:`.attention`).

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
every layer, and those of its unselected candidates in the layers after the check layer. Its
logits equal the sparse run's up to float rounding (tests use it).

If a forward does not match the batch that armed it, nothing is selected: every position still
in the batch is computed in every layer (a cold prefill's result with a dense check; with a
sample, the positions left out keep the donor's KV, which the publish cap keeps out of the
exact cache like any reused KV), and the mismatch is logged once.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
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
class _RequestCheck:
    index: int
    rid: str
    offsets: torch.Tensor
    final: bool
    reference: bool
    reused: int
    pinned: torch.Tensor


@dataclass
class _ForwardCheck:
    """One forward's check: armed by ``ForwardBatch.init_new``, bound to the forward whose
    extend lengths are ``extend_lens``; ``pin_rows``/``pin_slots`` (a dense reference's copied
    positions left out of the sample) set when the forward takes it; filled at the check
    layer."""

    requests: list[_RequestCheck]
    extend_lens: tuple[int, ...]
    keep: torch.Tensor | None = None
    positions: torch.Tensor | None = None
    force_rows: torch.Tensor | None = None
    force_slots: torch.Tensor | None = None
    pin_rows: torch.Tensor | None = None
    pin_slots: torch.Tensor | None = None


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
        self.check_layer = int(runtime.config.recompute_check_layer)
        self.strategy = runtime.config.recompute_strategy
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
            armed.pin_rows = rows
            armed.pin_slots = forward_batch.out_cache_loc[rows]
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
            if index == hook.check_layer and check.keep is not None:
                out = hook.flow.guarded(
                    "check_layer", None, out, hook._shrink, out, positions, forward_batch, check
                )
            return out

        layer.forward = forward
        self._wrapped.append(layer)
        attn = _radix_attention(layer)
        attn_orig = attn.forward

        def attn_forward(q: Any, k: Any, v: Any, forward_batch: Any, *args: Any, **kw: Any) -> Any:
            check = forward_batch.__dict__.get(_FORWARD_ATTR)
            if check is not None and k is not None:
                if index == hook.check_layer and check.keep is None:
                    hook.flow.guarded(
                        "check_layer",
                        None,
                        None,
                        hook._select,
                        attn,
                        q,
                        k,
                        v,
                        forward_batch,
                        check,
                    )
                if index > hook.check_layer and check.force_rows is not None:
                    assert check.force_slots is not None
                    k, v = hook._force(attn, k, v, check.force_rows, check.force_slots)
                elif index <= hook.check_layer and check.pin_rows is not None:
                    assert check.pin_slots is not None
                    k, v = hook._force(attn, k, v, check.pin_rows, check.pin_slots)
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
        self, attn: Any, q: Any, k: Any, v: Any, forward_batch: Any, check: _ForwardCheck
    ) -> None:
        """Score each request's candidates at the check layer (before it writes its K/V),
        select, report to the runtime and set ``check.keep`` (and the reference rows)."""
        config = self.runtime.config
        n = int(k.shape[0])
        k3 = k.reshape(n, attn.tp_k_head_num, -1)
        v3 = v.reshape(n, attn.tp_v_head_num, -1)
        k_pool = self.pool.get_key_buffer(attn.layer_id)
        v_pool = self.pool.get_value_buffer(attn.layer_id)
        device = k.device
        starts = _request_starts(check)
        keep = torch.ones(n, dtype=torch.bool, device=device)
        forced: list[torch.Tensor] = []
        reports = []
        for rc in check.requests:
            rows = (starts[rc.index] + rc.offsets).to(device)
            slots = forward_batch.out_cache_loc[rows]
            diff, norm = recompute.kv_deviation(k3[rows], v3[rows], k_pool[slots], v_pool[slots])
            deviation = recompute.relative(diff, norm)
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
            dropped = torch.ones(rows.numel(), dtype=torch.bool, device=device)
            dropped[selection.recompute] = False
            if rc.reference:
                forced.append(rows[dropped])
            else:
                keep[rows[dropped]] = False
            reports.append((rc, int(selection.recompute.numel()), selection))
        check.keep = keep
        if check.pin_rows is not None:
            forced.append(check.pin_rows)
        if forced:
            rows = torch.cat(forced)
            check.force_slots = forward_batch.out_cache_loc[rows]
            check.force_rows = torch.cumsum(keep.to(torch.int64), 0)[rows] - 1
        for rc, count, selection in reports:
            self.flow.checked(
                rc.rid, count, selection.gated, selection.residual_deviation, rc.final
            )

    def _shrink(
        self, out: Any, positions: torch.Tensor, forward_batch: Any, check: _ForwardCheck
    ) -> Any:
        """After the check layer: drop the unselected candidates from the hidden states and
        the forward batch; later layers get ``check.positions``."""
        keep = check.keep
        assert keep is not None
        if bool(keep.all()):
            return out
        backend = attention_backend(forward_batch)
        if backend is None:  # before any change: the later layers then compute every row
            raise RuntimeError("no attention backend to rebuild the shrunk batch's metadata")
        index = torch.nonzero(keep).flatten()
        out = shrink_hidden(out, index, forward_batch)
        counts = []
        start = 0
        for length in check.extend_lens:
            counts.append(int(keep[start : start + length].sum()))
            start += length
        shrink_batch(forward_batch, index, positions, check.extend_lens, counts)
        check.positions = forward_batch.positions
        backend.init_forward_metadata(forward_batch)
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
    if config.quality_gate > 0.0 and config.recompute_check_share < 1.0:
        logger.warning(
            "semblend: quality_gate is set, so every plan is checked on all its reused "
            "positions (recompute_check_share=%s is not used)",
            config.recompute_check_share,
        )
    return hook
