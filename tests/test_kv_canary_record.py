"""SGLang 0.5.23's own KV canary (its torch reference, on CPU) over semblend's sparse extend:
copied slots recorded by patches/sglang/engine/kv_canary_record.py verify clean, a wrong recorded
token or position is the canary's violation, and so is another writer of a copied slot.

Real: sglang's ``ReqToTokenPool``, ``MHATokenToKVPool``, canary buffers
(``attach_canary_buffers``), ``CanaryManager`` with its pre/post ops and violation log,
``ForwardBatch``, the canary's plan/write/verify references; semblend's ``RequestFlow`` (the
unified adapter's), ``BatchReuse``, ``forward_positions`` and the check layer's
``shrink_batch``. Stand-ins, named so: ``fake_model_forward`` (random K/V at
``out_cache_loc``), ``fake_donor_copy`` (K/V rows copied slot to slot, delta 0), ``StandInReq``
and ``StandInScheduleBatch``, ``fill_verify_tokens_stand_in`` (writes each row's tokens into the
canary's verify-token pool: sglang's snapshot pins host memory and its scatter is a Triton
kernel), and the CPU shim (semblend_sglang/cpu_runtime/canary_shim.py) for the canary's stream,
phase checker and device-to-host pump.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from semblend_sglang.config import Config
from semblend_sglang.cpu_runtime.canary_shim import apply_canary_cpu_shim
from semblend_sglang.patches.sglang import batch_fields
from semblend_sglang.patches.sglang.engine import kv_canary_record
from semblend_sglang.patches.sglang.engine.unified import UnifiedRadixCacheAdapter
from semblend_sglang.patches.sglang.flow import batch_state
from semblend_sglang.patches.sglang.flow.engine_facts import EngineFacts

CPU = torch.device("cpu")
N = 24
"""Prompt length of the donor A and the target B."""
PREFIX = 4
"""B's exact prefix (A's first slots)."""
COPIED = (8, 20)
"""B's span copied from A (delta 0); B computes [PREFIX, 8) and [20, N)."""
A = torch.arange(100, 100 + N)
B = torch.cat([A[:4], torch.arange(500, 504), A[8:20], torch.arange(600, 604)])
C = torch.arange(700, 706)
"""A dense request in B's batch (row 3)."""
SLOTS_A = torch.arange(1, 1 + N)
SLOTS_B = torch.cat([SLOTS_A[:PREFIX], torch.arange(40, 40 + N - PREFIX)])
SLOTS_C = torch.arange(80, 86)
COMPUTED_B = torch.cat([torch.arange(PREFIX, COPIED[0]), torch.arange(COPIED[1], N)])


@pytest.fixture(scope="module")
def sgl() -> SimpleNamespace:
    """The sglang names the tests build from, with the canary's CPU shim applied."""
    apply_canary_cpu_shim()
    from sglang.kernels.ops.kv_canary import consts
    from sglang.srt.kv_canary.capacities import CanaryLaunchCapacities
    from sglang.srt.kv_canary.config import CanaryConfig, CanaryMode
    from sglang.srt.kv_canary.perturb.config import PerturbConfig
    from sglang.srt.kv_canary.pool_patcher.api import attach_canary_buffers
    from sglang.srt.kv_canary.runner.canary_manager import CanaryManager
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode

    return SimpleNamespace(
        consts=consts,
        CanaryLaunchCapacities=CanaryLaunchCapacities,
        CanaryConfig=CanaryConfig,
        CanaryMode=CanaryMode,
        PerturbConfig=PerturbConfig,
        attach_canary_buffers=attach_canary_buffers,
        CanaryManager=CanaryManager,
        MHATokenToKVPool=MHATokenToKVPool,
        ReqToTokenPool=ReqToTokenPool,
        ForwardBatch=ForwardBatch,
        ForwardMode=ForwardMode,
    )


@dataclass
class StandInReq:
    """What the recorder and the flow read of a request: rid, its row, its fill ids."""

    rid: str
    row: int
    fill: list[int]
    kv: Any = None

    def __post_init__(self) -> None:
        self.kv = SimpleNamespace(req_pool_idx=self.row)

    def get_fill_ids(self) -> list[int]:
        return self.fill


@dataclass
class StandInScheduleBatch:
    """A prepared batch's requests, with the :class:`~.batch_state.BatchReuse` semblend keeps."""

    reqs: list[StandInReq]
    prefix_lens: list[int]
    extend_lens: list[int]
    sparse: dict[str, torch.Tensor] = field(default_factory=dict)
    candidates: dict[str, batch_state.CheckCandidates] = field(default_factory=dict)

    def __post_init__(self) -> None:
        reuse = batch_state.BatchReuse(sparse=dict(self.sparse), candidates=dict(self.candidates))
        setattr(self, batch_state.BATCH_ATTR, reuse)


def load_batch_stand_in(fb: Any) -> Any:
    """What sglang's eager runner hands the model (``EagerRunner.load_batch``): another
    ForwardBatch of the same fields (``dataclasses.replace``, sglang's own code under
    SGLANG_EAGER_INPUT_NO_COPY), its per-token tensors copied (into its static buffers by
    default); nothing semblend set on the original comes along."""
    run = dataclasses.replace(fb)
    for name in ("input_ids", "positions", "out_cache_loc"):
        setattr(run, name, getattr(fb, name).clone())
    return run


class Rig:
    """One real canary over real pools, driven the way ``ModelRunner.forward`` and the canary's
    own ``model.forward`` wrapper drive it; ``record``: semblend's recorder installed."""

    def __init__(self, sgl: SimpleNamespace, record: bool) -> None:
        self.sgl = sgl
        self.r2t = sgl.ReqToTokenPool(
            size=4, max_context_len=64, device="cpu", enable_memory_saver=False
        )
        kv = {"head_num": 1, "head_dim": 8, "layer_num": 1, "enable_memory_saver": False}
        self.pool = sgl.MHATokenToKVPool(
            size=128, page_size=1, dtype=torch.float32, device="cpu", **kv
        )
        config = sgl.CanaryConfig(
            mode=sgl.CanaryMode.RAISE,
            ring_capacity=256,
            sweep_interval=0,
            real_kv_hash_mode=sgl.consts.RealKvHashMode.PARTIAL,
            enable_write_input_assert=False,
            enable_verify_token_assert=True,
            stats_print_every_n_steps=0,
        )
        groups = sgl.attach_canary_buffers(
            pool=self.pool, config=config, device=CPU, kv_token_id_vs_position_offset=0
        )
        self.groups = groups
        caps = sgl.CanaryLaunchCapacities(
            per_forward_verify_capacity=3 * 128,
            per_forward_write_req_capacity=4,
            per_forward_write_entry_capacity=64,
        )
        self.manager = sgl.CanaryManager(
            config=config,
            perturb_config=sgl.PerturbConfig.from_env(),
            buffer_groups=groups,
            device=CPU,
            req_to_token_pool=self.r2t,
            launch_capacities=caps,
        )
        self.manager.mark_init_finished()  # the chain position assert and phase checks on
        self.flow = UnifiedRadixCacheAdapter(Config()).flow
        self.flow.support.backend_ok = True
        self.runner = SimpleNamespace(canary_manager=self.manager, req_to_token_pool=self.r2t)
        self.recorder = kv_canary_record.install(self.flow, self.runner) if record else None
        self.flow.engine_started(EngineFacts(canary=self.recorder))  # as scheduler start does
        self.outputs: dict[int, list[int]] = {}

    # ---- the pieces of one step
    def fill_verify_tokens_stand_in(self, row: int, tokens: torch.Tensor) -> None:
        pool = self.manager._device_state.req_to_verify_expected_tokens
        pool[row, : tokens.numel()] = tokens.to(torch.int32)

    def fake_model_forward(self, fb: Any) -> None:
        loc = fb.out_cache_loc
        self.pool.k_buffer[0][loc] = torch.randn(loc.numel(), 1, 8)
        self.pool.v_buffer[0][loc] = torch.randn(loc.numel(), 1, 8)

    def fake_donor_copy(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        self.pool.k_buffer[0][dst] = self.pool.k_buffer[0][src]
        self.pool.v_buffer[0][dst] = self.pool.v_buffer[0][src]

    def run(self, fb: Any, during: Callable[[Any], None] | None = None) -> None:
        """One forward of ``fb`` inside the canary's brackets, as ``ModelRunner.forward`` runs
        it (the model gets :func:`load_batch_stand_in`'s copy); ``during`` runs after the model
        forward, before the canary's post-forward launches (where a check-layer shrink leaves
        the batch)."""
        m = self.manager
        with (
            m.with_ops_outside_graph(single_forward_indices=[0], maybe_inaccurate_forward_batch=fb),
            m.with_active_single_forward_manager(0),
            m.model_forward_bracket_scope(),
        ):
            run = load_batch_stand_in(fb)
            pre = m.pre_ops_maybe_inside_graph(run)
            self.fake_model_forward(run)
            if during is not None:
                during(run)
            m.post_ops_maybe_inside_graph(run, pre)

    def extend_batch(
        self,
        rows: list[int],
        prefix: list[int],
        seq: list[int],
        ids: torch.Tensor,
        loc: torch.Tensor,
        extend: list[int],
    ) -> Any:
        """sglang's EXTEND ``ForwardBatch`` of ``rows`` (positions dense: the flow sets a sparse
        row's)."""
        sgl = self.sgl
        return sgl.ForwardBatch(
            forward_mode=sgl.ForwardMode.EXTEND,
            batch_size=len(rows),
            input_ids=ids,
            req_pool_indices=torch.tensor(rows),
            seq_lens=torch.tensor(seq),
            seq_lens_cpu=torch.tensor(seq),
            out_cache_loc=loc,
            seq_lens_sum=sum(seq),
            positions=torch.cat(
                [torch.arange(p, p + e) for p, e in zip(prefix, extend, strict=True)]
            ),
            extend_prefix_lens=torch.tensor(prefix),
            extend_prefix_lens_cpu=list(prefix),
            extend_seq_lens=torch.tensor(extend),
            extend_seq_lens_cpu=list(extend),
            extend_num_tokens=sum(extend),
            req_all_ids_lens=torch.tensor(seq),
        )

    def prefill(self, row: int, tokens: torch.Tensor, slots: torch.Tensor) -> None:
        """A dense cold prefill of ``tokens`` into ``slots`` (row ``row``)."""
        n = int(tokens.numel())
        self.r2t.req_to_token[row, :n] = slots.to(torch.int32)
        self.fill_verify_tokens_stand_in(row, tokens)
        self.run(self.extend_batch([row], [0], [n], tokens.clone(), slots.clone(), [n]))

    def decode(self, rows: dict[int, torch.Tensor]) -> None:
        """One decode step of each row in ``rows`` (row -> its prompt), into fresh slots."""
        sgl, ids, locs, seqs = self.sgl, [], [], []
        for row, tokens in rows.items():
            out = self.outputs.setdefault(row, [])
            n = int(tokens.numel()) + len(out)
            slot = 100 + 8 * row + len(out)
            self.r2t.req_to_token[row, n] = slot
            token = 1 + len(out)
            out.append(token)
            self.fill_verify_tokens_stand_in(row, torch.cat([tokens, torch.tensor(out)]))
            ids.append(token)
            locs.append(slot)
            seqs.append(n + 1)
        fb = sgl.ForwardBatch(
            forward_mode=sgl.ForwardMode.DECODE,
            batch_size=len(rows),
            input_ids=torch.tensor(ids),
            req_pool_indices=torch.tensor(list(rows)),
            seq_lens=torch.tensor(seqs),
            seq_lens_cpu=torch.tensor(seqs),
            out_cache_loc=torch.tensor(locs),
            seq_lens_sum=sum(seqs),
            positions=torch.tensor([s - 1 for s in seqs]),
            req_all_ids_lens=torch.tensor(seqs),
        )
        self.run(fb)

    def sparse_step(
        self,
        fill_b: list[int] | None = None,
        computed: torch.Tensor = COMPUTED_B,
        during: Callable[[Any], None] | None = None,
    ) -> None:
        """Donor A prefilled; then B (exact prefix from A, span COPIED copied from A's slots,
        ``computed`` computed: the rest, and any check candidate of the span) in one batch with
        the dense C, through semblend's flow; ``fill_b``: B's fill ids as the recorder reads
        them (default B)."""
        self.prefill(1, A, SLOTS_A)
        self.r2t.req_to_token[2, :N] = SLOTS_B.to(torch.int32)
        self.r2t.req_to_token[3, : C.numel()] = SLOTS_C.to(torch.int32)
        self.fill_verify_tokens_stand_in(2, B)
        self.fill_verify_tokens_stand_in(3, C)
        lo, hi = COPIED
        self.fake_donor_copy(SLOTS_A[lo:hi], SLOTS_B[lo:hi])
        batch = StandInScheduleBatch(
            [StandInReq("b", 2, fill_b or B.tolist()), StandInReq("c", 3, C.tolist())],
            [PREFIX, 0],
            [int(computed.numel()), int(C.numel())],
            {"b": computed.clone()},
        )
        ids = torch.cat([B[computed], C])
        loc = torch.cat([SLOTS_B[computed], SLOTS_C])
        fb = self.extend_batch([2, 3], batch.prefix_lens, [N, 6], ids, loc, batch.extend_lens)
        self.flow.forward_batch(batch, self.runner, fb)  # true positions; notes for the canary
        assert fb.positions[: computed.numel()].tolist() == computed.tolist()
        self.run(fb, during)

    # ---- what the canary found
    def violations(self) -> list[tuple[str, int, int, Any]]:
        """The canary's violation rows: (launch tag, slot, stored position, fail reasons)."""
        consts = self.sgl.consts
        from sglang.kernels.ops.kv_canary.verify import CanaryLaunchTag

        log = self.manager._device_state.violation_log
        n = int(log.violation_write_index[0])
        return [
            (
                CanaryLaunchTag(int(r[consts.VIOLATION_FIELD_KERNEL_KIND])).name,
                int(r[consts.VIOLATION_FIELD_SLOT_IDX]),
                int(r[consts.VIOLATION_FIELD_POSITION]),
                consts.FailReason(int(r[consts.VIOLATION_FIELD_FAIL_REASON_BITS])),
            )
            for r in log.violation_ring[:n]
        ]

    def stored(self, slot: int, buffer: str = "k_tail") -> tuple[int, int]:
        """(token, position) the canary's ``buffer`` holds for ``slot``."""
        row = getattr(self.groups[0], buffer).view(torch.int64)[slot]
        return int(row[0]), int(row[1])


@pytest.fixture
def rigs(sgl: SimpleNamespace) -> Any:
    """Builds rigs; restores the canary's own launch afterwards."""
    yield lambda record: Rig(sgl, record)
    kv_canary_record.uninstall()


def test_an_unrecorded_sparse_extend_is_flagged_by_the_canary(rigs: Any, sgl: Any) -> None:
    """The control: without the recorder the canary's write plan chains B's computed tokens
    across the copied span (its position assert fires at position 20, head and tail), and at
    the next verify every copied slot holds no entry of B's."""
    rig = rigs(False)
    rig.sparse_step()
    jump = int(SLOTS_B[COPIED[1]])
    bit = sgl.consts.FailReason
    assert rig.violations() == [
        ("HEAD_K_FULL", jump, COPIED[1], bit.WRITE_POSITION_MISMATCH),
        ("TAIL_K_FULL", jump, COPIED[1], bit.WRITE_POSITION_MISMATCH),
    ]
    with pytest.raises(RuntimeError, match="kv_canary violation"):
        rig.decode({2: B, 3: C})  # RAISE mode: the canary raises at its next pump
    flagged = {slot for tag, slot, _, why in rig.violations() if why & bit.VERIFY_POSITION_MISMATCH}
    assert flagged == set(SLOTS_B[COPIED[0] : COPIED[1]].tolist())


def test_recorded_copies_verify_clean(rigs: Any) -> None:
    """With the recorder: no violation in the sparse forward nor in two decode steps, whose
    verify covers every copied slot (position, chain, token, layer-0 K bytes); the canary holds
    B's token and position at each of B's slots, C's were written by the canary itself."""
    rig = rigs(True)
    rig.sparse_step()
    assert rig.violations() == []
    rig.decode({2: B, 3: C})
    rig.decode({2: B, 3: C})
    assert rig.violations() == []
    for p in range(PREFIX, N):
        for buffer in ("k_head", "k_tail"):
            assert rig.stored(int(SLOTS_B[p]), buffer) == (int(B[p]), p)
    assert [rig.stored(int(s)) for s in SLOTS_C] == [(int(t), p) for p, t in enumerate(C)]
    assert (rig.recorder.batches, rig.recorder.slots) == (1, N - PREFIX)
    snap = rig.flow.runtime.snapshot()["kv_canary_recorded"]
    assert snap == {"batches": 1, "slots": N - PREFIX}


def test_a_wrong_recorded_token_is_the_canary_s_violation(rigs: Any, sgl: Any) -> None:
    """Our bookkeeping says another token at one copied position: the canary's verify reports
    exactly that slot's token (the chain stays consistent: it was built from what we said)."""
    rig = rigs(True)
    fill = B.tolist()
    fill[12] += 1
    rig.sparse_step(fill_b=fill)
    assert rig.violations() == []
    rig.decode({2: B, 3: C})
    slot, bit = int(SLOTS_B[12]), sgl.consts.FailReason.VERIFY_TOKEN_MISMATCH
    assert rig.violations() == [("HEAD_K_FULL", slot, 12, bit), ("TAIL_K_FULL", slot, 12, bit)]


def test_a_moved_recorded_position_is_the_canary_s_violation(rigs: Any, sgl: Any) -> None:
    """A copied slot's recorded position changed after recording: the canary reports its
    position, and the chain hash of the slot after it."""
    rig = rigs(True)
    rig.sparse_step()
    slot = int(SLOTS_B[12])
    for buffer in ("k_head", "k_tail"):
        getattr(rig.groups[0], buffer).view(torch.int64)[slot, 1] = 13
    rig.decode({2: B, 3: C})
    bit = sgl.consts.FailReason
    found = {(tag, s, why) for tag, s, _, why in rig.violations()}
    assert found == {
        (tag, s, why)
        for tag in ("HEAD_K_FULL", "TAIL_K_FULL")
        for s, why in (
            (slot, bit.VERIFY_POSITION_MISMATCH),
            (int(SLOTS_B[13]), bit.VERIFY_CHAIN_HASH_MISMATCH),
        )
    }


def test_another_writer_of_a_copied_slot_is_the_canary_s_violation(rigs: Any, sgl: Any) -> None:
    """A real fault after the copy (a second owner's forward writes one of B's copied slots) is
    still the canary's to report: recording does not hide it."""
    rig = rigs(True)
    rig.sparse_step()
    stolen = int(SLOTS_B[15])
    rig.prefill(4, torch.arange(900, 903), torch.tensor([120, stolen, 121]))
    assert rig.violations() == []
    rig.decode({2: B})
    fail = sgl.consts.FailReason
    taken = fail.VERIFY_CHAIN_HASH_MISMATCH | fail.VERIFY_POSITION_MISMATCH
    taken |= fail.VERIFY_TOKEN_MISMATCH  # it holds D's token at D's position 1
    after = int(SLOTS_B[16])  # its chain link now hashes D's entry
    assert rig.violations() == [
        (tag, slot, position, why)
        for tag in ("HEAD_K_FULL", "TAIL_K_FULL")
        for slot, position, why in (
            (stolen, 1, taken),
            (after, 16, fail.VERIFY_CHAIN_HASH_MISMATCH),
        )
    ]


def test_chunked_copies_chain_from_the_chunk_before(rigs: Any) -> None:
    """A sparse request prefilled in two chunks, each with a copied span: the first chunk has
    no prefix (its chain starts at the canary's anchor), the second chains from the last slot
    the first recorded; the decode verify of the whole prompt is clean."""
    rig = rigs(True)
    rig.prefill(1, A, SLOTS_A)
    slots = torch.arange(40, 40 + N)
    rig.r2t.req_to_token[2, :N] = slots.to(torch.int32)
    rig.fill_verify_tokens_stand_in(2, B)
    req = StandInReq("b", 2, B.tolist())
    for lo, hi, span in ((0, 12, (4, 10)), (12, N, (14, 20))):
        rig.fake_donor_copy(SLOTS_A[span[0] : span[1]], slots[span[0] : span[1]])
        keep = torch.ones(hi - lo, dtype=torch.bool)
        keep[span[0] - lo : span[1] - lo] = False
        computed = torch.arange(lo, hi)[keep]
        batch = StandInScheduleBatch([req], [lo], [int(computed.numel())], {"b": computed})
        fb = rig.extend_batch(
            [2], [lo], [hi], B[computed], slots[computed], [int(computed.numel())]
        )
        rig.flow.forward_batch(batch, rig.runner, fb)
        rig.run(fb)
    rig.decode({2: B})
    assert rig.violations() == []
    assert rig.recorder.slots == N


def _shrink_at_check_layer(fb: Any) -> None:
    """What the check layer leaves of the batch: B's check candidate at position 10 (computed
    up to the check layer, then not kept) dropped (semblend's ``shrink_batch``)."""
    old = tuple(int(x) for x in fb.extend_seq_lens_cpu)
    keep = torch.ones(sum(old), dtype=torch.bool)
    keep[int((fb.positions[: old[0]] == 10).nonzero())] = False
    new = [old[0] - 1, old[1]]
    batch_fields.shrink_batch(fb, torch.nonzero(keep).flatten(), fb.positions, old, new)


def test_a_check_layer_shrink_does_not_misread_the_tail_launch(rigs: Any) -> None:
    """The check layer shrinks the batch inside the forward: unrecorded, the canary's tail write
    reads the shrunk tensors at its pre-forward offsets (IndexError in its torch reference; an
    out-of-bounds read on CUDA); recorded, the tail launch gets the batch of the head launch and
    everything verifies clean."""
    computed = torch.cat([torch.arange(PREFIX, 8), torch.tensor([10]), torch.arange(20, N)])
    control = rigs(False)
    with pytest.raises(IndexError):
        control.sparse_step(computed=computed, during=_shrink_at_check_layer)
    rig = rigs(True)
    rig.sparse_step(computed=computed, during=_shrink_at_check_layer)
    rig.decode({2: B, 3: C})
    assert rig.violations() == []


def test_a_check_layer_shrink_of_a_dense_batch_does_not_misread_it(rigs: Any) -> None:
    """A plan of several spans keeps every copied position computed up to the check layer: its
    extend starts dense (no sparse row) and shrinks after the check layer. Unrecorded, the
    canary's tail write misreads it; recorded, the tail launch gets the head launch's batch and
    the canary's own entries verify clean."""
    candidates = {"b": batch_state.CheckCandidates(torch.arange(4, 16), final=True, reused=12)}

    def step(rig: Rig) -> None:
        rig.prefill(1, A, SLOTS_A)
        rig.r2t.req_to_token[2, :N] = SLOTS_B.to(torch.int32)
        rig.fill_verify_tokens_stand_in(2, B)
        rig.fake_donor_copy(SLOTS_A[8:20], SLOTS_B[8:20])
        rig.r2t.req_to_token[3, :6] = SLOTS_C.to(torch.int32)
        rig.fill_verify_tokens_stand_in(3, C)
        reqs, n = [StandInReq("b", 2, B.tolist()), StandInReq("c", 3, C.tolist())], N - PREFIX
        batch = StandInScheduleBatch(reqs, [PREFIX, 0], [n, 6], candidates=candidates)
        ids, loc = torch.cat([B[PREFIX:], C]), torch.cat([SLOTS_B[PREFIX:], SLOTS_C])
        fb = rig.extend_batch([2, 3], [PREFIX, 0], [N, 6], ids, loc, [n, 6])
        rig.flow.forward_batch(batch, rig.runner, fb)
        rig.run(fb, during=_shrink_at_check_layer)

    control = rigs(False)
    with pytest.raises(IndexError):
        step(control)
    rig = rigs(True)
    step(rig)
    rig.decode({2: B, 3: C})
    assert rig.violations() == []
    assert rig.recorder.batches == 0  # nothing to write: the canary wrote every position


def test_a_recording_error_fails_open(rigs: Any, sgl: Any) -> None:
    """A recording that cannot be built (our tokens end short of the chunk) is counted and
    logged once, never raised; the canary then launches as it planned, and reports."""
    rig = rigs(True)
    rig.sparse_step(fill_b=B.tolist()[:20])
    assert rig.flow.runtime.snapshot()["errors"] == {"kv_canary": 1}
    bit = sgl.consts.FailReason.WRITE_POSITION_MISMATCH
    assert [why for *_, why in rig.violations()] == [bit, bit]
    assert rig.recorder.batches == 0


def test_a_forward_of_other_lengths_does_not_take_the_noted_rows(rigs: Any) -> None:
    """The rows noted at ``init_new`` go to the forward of that batch's lengths only: a
    forward of other lengths in between runs as the canary planned it."""
    rig = rigs(True)
    rig.prefill(1, A, SLOTS_A)
    rig.r2t.req_to_token[2, :N] = SLOTS_B.to(torch.int32)
    rig.fill_verify_tokens_stand_in(2, B)
    lo, hi = COPIED
    rig.fake_donor_copy(SLOTS_A[lo:hi], SLOTS_B[lo:hi])
    n = int(COMPUTED_B.numel())
    batch = StandInScheduleBatch([StandInReq("b", 2, B.tolist())], [PREFIX], [n], {"b": COMPUTED_B})
    fb = rig.extend_batch([2], [PREFIX], [N], B[COMPUTED_B], SLOTS_B[COMPUTED_B], [n])
    rig.flow.forward_batch(batch, rig.runner, fb)
    rig.prefill(3, C, SLOTS_C)  # another forward first
    assert rig.recorder.pending is not None and rig.recorder.batches == 0
    rig.run(fb)
    assert rig.recorder.pending is None and rig.recorder.batches == 1
    rig.decode({2: B, 3: C})
    assert rig.violations() == []


def test_without_a_canary_nothing_is_installed(sgl: Any) -> None:
    """``--kv-canary none``: no recorder, the canary's launch untouched, and the recorder's
    module imports nothing of sglang at its top level."""
    from sglang.srt.kv_canary.single_forward_manager import manager

    flow = UnifiedRadixCacheAdapter(Config()).flow
    before = manager.launch_endpoints_per_forward
    assert kv_canary_record.install(flow, SimpleNamespace(canary_manager=None)) is None
    assert flow.engine.canary is None
    assert manager.launch_endpoints_per_forward is before
    tree = ast.parse(inspect.getsource(kv_canary_record))
    top = [n for n in tree.body if isinstance(n, ast.Import | ast.ImportFrom)]
    names = [a.name for n in top if isinstance(n, ast.Import) for a in n.names]
    names += [n.module or "" for n in top if isinstance(n, ast.ImportFrom)]
    assert not [n for n in names if n.startswith("sglang")], names


def test_the_cpu_shim_keeps_the_phase_checker_s_contract(sgl: Any) -> None:
    """The shim's host phase checker moves like sglang's kernel and, once asserting, refuses a
    phase it did not expect; the canary's stream on CPU is a ``torch.cpu.Stream``."""
    from sglang.srt.utils import create_device_stream
    from sglang.srt.utils.phase_checker import SimplePhaseChecker

    assert isinstance(create_device_stream(CPU), torch.cpu.Stream)
    checker = SimplePhaseChecker(initial_phase=0, device=CPU)
    checker.update(expect_phase=5, next_phase=1)  # asserts off: moves anyway
    checker.enable_assert()  # back to phase 0, asserting
    checker.update(expect_phase=0, next_phase=1)
    with pytest.raises(AssertionError, match="phase mismatch"):
        checker.update(expect_phase=0, next_phase=2)
