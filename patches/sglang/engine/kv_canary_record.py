"""semblend's copied KV slots recorded with SGLang's KV canary (``--kv-canary log|raise``,
``sglang.srt.kv_canary``, sglang 0.5.23).

The canary keeps, per KV slot, the token and position a forward wrote there and a chain hash
(``splitmix64_mix3`` of the previous position's slot entry); at every forward it verifies each
request's slots ``[0, prefix)`` against them. Its write plan takes a request's computed tokens
as consecutive positions from ``extend_prefix_len``. A sparse extend (:mod:`.span_copy`) breaks
that: the plan chains the computed tokens across the copied spans (with a prefix, its
write-time position assert fires at the first computed position after a span), the copied
slots keep what the canary last stored there (another owner's), and once the check layer
shrinks the batch the post-forward (tail) launch reads the shrunk tensors at the offsets it
planned before the forward.

So, while a canary is installed, its per-forward launches
(``single_forward_manager.manager.launch_endpoints_per_forward``, head before the forward and
tail after it) of a batch with sparse requests or check candidates get the batch as it was at
the head launch, the sparse requests' slots set to -1 (its write kernel skips those), and right
after each launch the canary's own write kernel writes each sparse request's chunk ``[lo, hi)``
in position order, chained from the slot at ``lo - 1``: the forward's token and slot where it
computed, the request's token and its row's slot where semblend copied. The rows noted at
``init_new`` go to the first launch of a batch of their lengths (the model runs a copy of the
batch ``init_new`` built). The canary's next verify then checks that bookkeeping. Nothing here
imports sglang before :func:`install` finds a canary. An error is the flow's (counted, logged
once) and leaves that launch as the canary built it: what it then reports is its own.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import torch

from ..attention.split_view import NOTES_ATTR, batch_lens, forward_notes
from ..flow import batch_state

if TYPE_CHECKING:
    from collections.abc import Callable

    from ..flow.request_flow import RequestFlow

MANAGER_MODULE = "sglang.srt.kv_canary.single_forward_manager.manager"
"""The sglang module whose ``launch_endpoints_per_forward`` the recorder wraps."""
LAUNCH = "launch_endpoints_per_forward"
_ORIGINAL_ATTR = "_semblend_original"


def canary_manager_of(model_runner: Any) -> Any | None:
    """The ``CanaryManager`` sglang installed on ``model_runner`` (None: ``--kv-canary none``,
    or a runner without the attribute). Reads one attribute; imports nothing."""
    return getattr(model_runner, "canary_manager", None)


@dataclass(frozen=True)
class SparseRow:
    """One sparse request of a forward batch: its ``index`` in the batch, its ``req_to_token``
    ``row``, its chunk start ``lo``, its tokens at ``[lo, hi)`` and the positions the forward
    computes (``computed``, ascending, inside the chunk); both CPU int64."""

    index: int
    row: int
    lo: int
    tokens: torch.Tensor
    computed: torch.Tensor

    @property
    def hi(self) -> int:
        """The chunk's end."""
        return self.lo + int(self.tokens.numel())


@dataclass(frozen=True)
class _RowsWrite:
    """The sparse rows' write of one forward, on the batch's device: the canary's ``plan`` (one
    request per row, seeded at the slot before its chunk) over ``ids``, ``positions``,
    ``slots`` (each row's chunk in position order)."""

    plan: Any
    ids: torch.Tensor
    positions: torch.Tensor
    slots: torch.Tensor


@dataclass(frozen=True)
class _Launch:
    """What one forward's canary launches use: ``batch`` (a copy of the forward batch at its
    head launch: a later check-layer shrink replaces the real one's per-token fields; the
    sparse rows' slots -1), ``expected`` (that launch's expected inputs) and the sparse rows'
    ``write`` (None: no sparse row, only check candidates)."""

    batch: Any
    expected: Any
    write: _RowsWrite | None


@dataclass
class CanaryNotes:
    """The recorder's state on one ForwardBatch (``ForwardNotes.canary``): its sparse rows
    (maybe none: a batch with check candidates) and the launch data built at its first canary
    launch (None until then, or when that failed)."""

    rows: tuple[SparseRow, ...]
    launch: _Launch | None = None
    built: bool = False
    """Whether the launch data was built (or its build failed: the launches then go as the
    canary planned them)."""


class CanaryRecorder:
    """Records sparse requests' chunks with one model runner's canary. :meth:`note` is called by
    ``RequestFlow.forward_batch`` (through ``flow.guarded``) on the scheduler's thread;
    :meth:`launch` by the wrapper of the canary's per-forward launch, inside the forward, its
    own steps guarded (only the canary's launch may raise: its errors are its own). Neither
    changes anything sglang reads, only what the canary's launches are given."""

    def __init__(self, flow: RequestFlow, req_to_token: torch.Tensor) -> None:
        self.flow = flow
        self.req_to_token = req_to_token
        self.pending: tuple[tuple[list[int], ...], CanaryNotes] | None = None
        """The last noted batch's lengths and rows, until a forward of those lengths takes them
        (the model runs a copy of the ForwardBatch ``init_new`` built: the eager runner's
        ``load_batch``)."""
        self.batches = 0
        """Forward batches whose sparse rows were written to the canary."""
        self.slots = 0
        """Slots written (each chunk position once per batch, whatever the buffers)."""

    def note(self, batch: Any, forward_batch: Any) -> None:
        """After ``init_new`` built ``forward_batch`` for ``batch``: keep its sparse rows (a
        request of ``batch``'s :class:`~.batch_state.BatchReuse` whose computed positions are the
        forward's, ``prefix + extend != seq``), none for a batch with check candidates only
        (its tail launch still needs the batch of its head launch), for its forward's first
        canary launch; any other batch drops what an earlier one left."""
        self.pending = None
        reuse = batch_state.batch_reuse(batch)
        if reuse is None or not (reuse.sparse or reuse.candidates):
            return
        if not forward_batch.forward_mode.is_extend():
            return
        lens = batch_lens(forward_batch)
        if lens is None:
            return
        prefix, extend, seq = lens
        rows: list[SparseRow] = []
        for i, req in enumerate(batch.reqs):
            computed = reuse.sparse.get(req.rid)
            if computed is None or int(computed.numel()) != extend[i]:
                continue
            if prefix[i] + extend[i] == seq[i]:
                continue
            tokens = torch.tensor(req.get_fill_ids()[prefix[i] : seq[i]], dtype=torch.int64)
            rows.append(SparseRow(i, self.flow.view.row_of(req), prefix[i], tokens, computed))
        self.pending = (lens, CanaryNotes(tuple(rows)))

    def _notes_of(self, fb: Any) -> CanaryNotes | None:
        """The canary notes of the forward batch ``fb`` the model runs: its own, or the pending
        ones when its lengths are the noted batch's (then its own from now on)."""
        found = getattr(getattr(fb, NOTES_ATTR, None), "canary", None)
        if found is not None or self.pending is None or not fb.forward_mode.is_extend():
            return cast("CanaryNotes | None", found)
        lens, notes = self.pending
        if batch_lens(fb) != lens:
            return None
        self.pending = None
        forward_notes(fb).canary = notes
        return notes

    def launch(self, original: Callable[..., Any], kw: dict[str, Any]) -> None:
        """One canary launch (``kw``: the canary's keywords): ``original`` on the batch the
        canary may see, then the sparse rows' write. A batch without notes, or a group other
        than the full pool's, is launched unchanged."""
        notes = self.flow.guarded("kv_canary", None, None, self._notes_of, kw["forward_batch"])
        if notes is None or kw["group"].kind.name != "FULL":
            original(**kw)
            return
        if not notes.built:
            notes.built = True
            notes.launch = self.flow.guarded("kv_canary", None, None, _build, self, notes, kw)
            write = None if notes.launch is None else notes.launch.write
            if write is not None:
                self.batches += 1
                self.slots += int(write.slots.numel())
        found = notes.launch
        if found is None:
            original(**kw)
            return
        original(**{**kw, "forward_batch": found.batch, "expected_inputs": found.expected})
        if found.write is not None:
            self.flow.guarded("kv_canary", None, None, self._write, kw, found.write)

    def _write(self, kw: dict[str, Any], found: _RowsWrite) -> None:
        """The canary's write kernel over the sparse rows, for each write endpoint of this
        launch (its group and head or tail filter, the V half where the canary enables it)."""
        from sglang.kernels.ops.kv_canary.verify import VerifyOrWriteContext
        from sglang.kernels.ops.kv_canary.write import launch_canary_write_kernel
        from sglang.srt.kv_canary.runner.kernel_launcher import passes_v_half_gate

        suffix = "_" + kw["group"].kind.name
        log = kw["violation_log"]
        for endpoint in kw["endpoints"]:
            tag = endpoint.kernel_kind
            if not (tag.name.endswith(suffix) and kw["tag_filter"](tag)):
                continue
            if not passes_v_half_gate(tag):
                continue
            context = VerifyOrWriteContext(
                canary_buf=endpoint.canary_buf,
                kernel_kind=tag,
                violation_ring=log.violation_ring,
                violation_write_index=log.violation_write_index,
                slot_run_counter=endpoint.slot_run_counter_view,
                kernel_run_counter=endpoint.kernel_run_counter_view,
                real_kv_sources=endpoint.real_kv_sources,
                real_kv_hash_mode=kw["real_kv_hash_mode"],
                enable_chain_position_assert=endpoint.enable_chain_position_assert,
            )
            launch_canary_write_kernel(
                context=context,
                plan=found.plan,
                input_ids=found.ids,
                positions=found.positions,
                out_cache_loc=found.slots,
                enable_write_input_assert=False,
                expected_input_tokens=None,
                expected_input_positions=None,
            )


def _build(recorder: CanaryRecorder, notes: CanaryNotes, kw: dict[str, Any]) -> _Launch:
    """The launch data of one forward from its first canary launch (before the forward, so
    before any check-layer shrink). Raises ValueError as :func:`_rows_write`."""
    fb = kw["forward_batch"]
    view = copy.copy(fb)
    view.__dict__.pop(NOTES_ATTR, None)
    write = _rows_write(recorder.req_to_token, notes.rows, view) if notes.rows else None
    return _Launch(view, kw["expected_inputs"], write)


def _rows_write(table: torch.Tensor, rows: tuple[SparseRow, ...], view: Any) -> _RowsWrite:
    """The write of ``rows`` (``table``: ``req_to_token``), each chunk position once: the
    forward's token and slot where it computes, the row's token and slot elsewhere; sets the
    rows' slots of ``view.out_cache_loc`` to -1. Raises ValueError when a row's computed
    positions are not ascending inside its chunk, or the batch's lengths disagree with them."""
    from sglang.kernels.ops.kv_canary.write import WritePlan

    loc, ids = view.out_cache_loc, view.input_ids
    device = loc.device
    starts = [0]
    for n in view.extend_seq_lens_cpu:
        starts.append(starts[-1] + int(n))
    if ids is None or int(loc.shape[0]) != starts[-1] or int(ids.shape[0]) != starts[-1]:
        raise ValueError("the batch's token count and its extend lengths differ")
    keep = torch.ones(starts[-1], dtype=torch.bool)
    tokens, slots, seeds, offsets = [], [], [], [0]
    for row in rows:
        s, e = starts[row.index], starts[row.index + 1]
        at = row.computed - row.lo
        if e - s != int(at.numel()) or not _inside(at, row.hi - row.lo):
            raise ValueError(f"request {row.index}: computed positions not ascending in its chunk")
        keep[s:e] = False
        at_dev = at.to(device)
        mine = row.tokens.to(device, copy=True)
        mine[at_dev] = ids[s:e].to(torch.int64)
        where = table[row.row, row.lo : row.hi].to(device, torch.int64, copy=True)
        where[at_dev] = loc[s:e].to(torch.int64)
        tokens.append(mine)
        slots.append(where)
        if row.lo > 0:
            seeds.append(table[row.row, row.lo - 1 : row.lo].to(device, torch.int64))
        else:
            seeds.append(torch.full((1,), -1, dtype=torch.int64, device=device))
        offsets.append(offsets[-1] + row.hi - row.lo)
    view.out_cache_loc = torch.where(keep.to(device), loc, torch.full_like(loc, -1))
    plan = WritePlan(
        write_offsets=torch.tensor(offsets, dtype=torch.int64, device=device),
        write_seed_slot_indices=torch.cat(seeds),
        write_num_valid_reqs=torch.tensor([len(rows)], dtype=torch.int32, device=device),
    )
    positions = [torch.arange(r.lo, r.hi, dtype=torch.int64, device=device) for r in rows]
    return _RowsWrite(plan, torch.cat(tokens), torch.cat(positions), torch.cat(slots))


def _inside(at: torch.Tensor, n: int) -> bool:
    """``at`` (CPU int64) is strictly ascending inside ``[0, n)``."""
    if at.numel() == 0:
        return True
    return int(at[0]) >= 0 and int(at[-1]) < n and bool((at[1:] > at[:-1]).all())


def install(flow: RequestFlow, model_runner: Any) -> CanaryRecorder | None:
    """Scheduler start: when ``model_runner`` has a canary (:func:`canary_manager_of`), wrap the
    canary's per-forward launch (once per process; a later install re-points it) and return
    the recorder, which the caller hands to the flow (:class:`.engine_facts.EngineFacts`);
    else return None, importing nothing of the canary."""
    if canary_manager_of(model_runner) is None:
        return None
    recorder = CanaryRecorder(flow, model_runner.req_to_token_pool.req_to_token)
    module = importlib.import_module(MANAGER_MODULE)
    current = getattr(module, LAUNCH)
    original = getattr(current, _ORIGINAL_ATTR, current)

    def launch_endpoints_per_forward(**kw: Any) -> None:
        recorder.launch(original, kw)

    setattr(launch_endpoints_per_forward, _ORIGINAL_ATTR, original)
    setattr(module, LAUNCH, launch_endpoints_per_forward)
    return recorder


def uninstall(flow: RequestFlow | None = None) -> None:
    """Restore the canary's own launch (a no-op when it was never wrapped) and take the
    recorder from ``flow``'s facts; for tests and unpatching."""
    module = importlib.import_module(MANAGER_MODULE)
    original = getattr(getattr(module, LAUNCH), _ORIGINAL_ATTR, None)
    if original is not None:
        setattr(module, LAUNCH, original)
    if flow is not None:
        flow.engine_started(dataclasses.replace(flow.engine, canary=None))
