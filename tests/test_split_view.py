"""The split view (patches/sglang/attention/split_view.py) on sglang 0.5.23's real ForwardBatch: the
runs, the view's fields, that the real batch is left as it was, and the view's cache."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from semblend_sglang.cpu_runtime import ensure_torchvision_importable
from tests.sparse_extend_batches import random_batch

pytest.importorskip("sglang")
ensure_torchvision_importable()

from sglang.srt.model_executor.forward_batch_info import ForwardBatch  # noqa: E402

from semblend_sglang.patches.sglang.attention import split_view  # noqa: E402
from semblend_sglang.patches.sglang.attention.hook_kit import (  # noqa: E402
    SparsePath,
    count_sparse_batch,
    sparse_batch_counts,
)
from semblend_sglang.patches.sglang.attention.split_view import (  # noqa: E402
    NOTES_ATTR,
    check_of,
    computed_runs,
    forward_notes,
    is_sparse_batch,
    notes_of,
    split_sequences,
    split_view_of,
)
from tests.harness.attention_backend import forward_batch  # noqa: E402


def test_computed_runs():
    assert computed_runs([]) == []
    assert computed_runs([4]) == [(4, 5)]
    assert computed_runs([0, 1, 2, 5, 6, 9]) == [(0, 3), (5, 7), (9, 10)]
    with pytest.raises(ValueError, match="ascending"):
        computed_runs([3, 3])
    with pytest.raises(ValueError, match="ascending"):
        computed_runs([5, 2])


def _fb(prefix: list[int], extend: list[int], seq: list[int], positions: list[int]) -> ForwardBatch:
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    t = sum(extend)
    return ForwardBatch(
        forward_mode=ForwardMode.EXTEND,
        batch_size=len(seq),
        input_ids=torch.zeros(t, dtype=torch.int64),
        req_pool_indices=torch.tensor([7, 3, 5][: len(seq)]),
        seq_lens=torch.tensor(seq),
        out_cache_loc=torch.arange(100, 100 + t),
        seq_lens_sum=sum(seq),
        seq_lens_cpu=torch.tensor(seq),
        positions=torch.tensor(positions),
        extend_prefix_lens=torch.tensor(prefix, dtype=torch.int32),
        extend_seq_lens=torch.tensor(extend, dtype=torch.int32),
        extend_prefix_lens_cpu=prefix,
        extend_seq_lens_cpu=extend,
        extend_start_loc=torch.tensor([0, extend[0], extend[0] + extend[1]][: len(seq)]),
        extend_logprob_start_lens_cpu=[0] * len(seq),
    )


def test_layout_of_a_mixed_batch():
    """Request 0 exact hit [2, 5); request 1 sparse over n = 10 computing 1, 2, 5, 8, 9 (runs
    [1, 3), [5, 6), [8, 10)); request 2 a sparse non-final chunk of n = 6 computing 0 and 3."""
    fb = _fb([2, 1, 0], [3, 5, 2], [5, 10, 6], [2, 3, 4, 1, 2, 5, 8, 9, 0, 3])
    seqs = split_sequences(fb)
    assert seqs is not None
    assert seqs.request == [0, 1, 1, 1, 2, 2]
    assert seqs.prefix == [2, 1, 5, 8, 0, 3]
    assert seqs.extend == [3, 2, 1, 2, 1, 1]
    assert seqs.seq == [5, 3, 6, 10, 1, 4]
    view = split_view_of(fb).batch
    assert view.batch_size == 6
    assert view.req_pool_indices.tolist() == [7, 3, 3, 3, 5, 5]
    assert view.seq_lens.tolist() == seqs.seq and view.seq_lens_cpu.tolist() == seqs.seq
    assert view.seq_lens_sum == sum(seqs.seq)
    assert view.extend_prefix_lens.tolist() == seqs.prefix == view.extend_prefix_lens_cpu
    assert view.extend_seq_lens.tolist() == seqs.extend == view.extend_seq_lens_cpu
    assert view.extend_prefix_lens.dtype == torch.int32  # the real batch's dtypes
    assert view.extend_start_loc.tolist() == [0, 3, 5, 6, 8, 9]
    assert view.extend_logprob_start_lens_cpu is None
    # unchanged: the tokens are in order already
    assert view.positions is fb.positions and view.out_cache_loc is fb.out_cache_loc
    assert view.input_ids is fb.input_ids and view.forward_mode is fb.forward_mode


def test_the_real_batch_is_left_as_it_was():
    fb = _fb([2, 1], [3, 5], [5, 10], [2, 3, 4, 1, 2, 5, 8, 9])
    before = {f.name: getattr(fb, f.name) for f in dataclasses.fields(fb)}
    view = split_view_of(fb).batch
    assert view is not fb
    for name, value in before.items():
        assert getattr(fb, name) is value, name
    # the view holds only fields the real ForwardBatch has (no stray attribute reaches a backend)
    names = {f.name for f in dataclasses.fields(ForwardBatch)}
    assert set(vars(view)) <= names


def test_a_batch_without_a_sparse_request_has_no_view():
    fb = _fb([2, 0], [3, 4], [5, 4], [2, 3, 4, 0, 1, 2, 3])
    assert split_sequences(fb) is None
    assert split_view_of(fb).batch is None


def test_the_view_is_built_once_per_batch_and_rebuilt_when_positions_change():
    fb = _fb([2, 1], [3, 5], [5, 10], [2, 3, 4, 1, 2, 5, 8, 9])
    first = split_view_of(fb)
    assert split_view_of(fb) is first and getattr(fb, NOTES_ATTR).batch.view is first
    fb.positions = torch.tensor([2, 3, 4, 1, 2, 3, 8, 9])
    second = split_view_of(fb)
    assert second is not first
    assert second.sequences is not None and second.sequences.prefix == [2, 1, 8]


def test_the_sparse_answer_is_read_once_per_batch_until_a_length_field_is_replaced(
    monkeypatch: pytest.MonkeyPatch,
):
    """Every attention layer asks is_sparse_batch; the host reads of the lengths (a device sync
    on a GPU without CPU mirrors) happen once per forward, and again only when the check layer
    replaces a length field."""
    reads = []
    real = split_view.batch_lens
    monkeypatch.setattr(split_view, "batch_lens", lambda fb: reads.append(1) or real(fb))
    fb = _fb([2, 1], [3, 5], [5, 10], [2, 3, 4, 1, 2, 5, 8, 9])
    assert all(is_sparse_batch(fb) for _ in range(5)) and len(reads) == 1
    fb.extend_seq_lens_cpu = [3, 9]  # request 1 now computes all of [1, 10): not sparse
    fb.extend_seq_lens = torch.tensor([3, 9])
    fb.positions = torch.tensor([2, 3, 4, *range(1, 10)])
    assert not is_sparse_batch(fb) and len(reads) == 2
    ordinary = _fb([0, 4], [5, 2], [5, 6], [0, 1, 2, 3, 4, 4, 5])
    assert not any(is_sparse_batch(ordinary) for _ in range(3)) and len(reads) == 3


@pytest.mark.parametrize(
    ("positions", "match"),
    [
        ([2, 3, 4, 1, 2, 5, 8], "one position per computed token"),
        ([2, 3, 4, 1, 2, 5, 9, 8], "ascending"),
        ([2, 3, 4, 1, 2, 5, 8, 10], "outside"),
        ([2, 3, 4, 0, 2, 5, 8, 9], "outside"),
    ],
)
def test_bad_positions_are_refused(positions: list[int], match: str):
    fb = _fb([2, 1], [3, 5], [5, 10], [2, 3, 4, 1, 2, 5, 8, 9])
    fb.positions = torch.tensor(positions)
    with pytest.raises(ValueError, match=match):
        split_sequences(fb)


@pytest.mark.parametrize("seed", range(8))
def test_random_batches_split_into_their_positions(seed: int):
    batch = random_batch(seed, n_requests=6, max_len=64)
    fb = forward_batch(batch)
    seqs = split_sequences(fb)
    assert seqs is not None  # random_batch holds a sparse request
    assert sum(seqs.extend) == batch.positions.numel()
    covered = torch.cat([torch.arange(s, e) for s, e in zip(seqs.prefix, seqs.seq, strict=True)])
    assert covered.tolist() == batch.positions.tolist()  # every computed token, in order, once
    for i, (s, n) in enumerate(zip(seqs.prefix, seqs.seq, strict=True)):
        assert n <= int(batch.seq_lens[seqs.request[i]])
        assert s >= int(batch.extend_prefix_lens[seqs.request[i]])


def test_a_forward_batch_carries_one_attribute_whose_check_and_count_outlive_a_shrink():
    """The hooks and the check layer keep one object on a ForwardBatch: reading the check layer's
    state makes none; when a length field is replaced (the check layer shrinking the batch) the
    attention notes are new, while the check layer's state and the sparse-path count stay."""
    fb = _fb([2, 1], [3, 5], [5, 10], [2, 3, 4, 1, 2, 5, 8, 9])
    assert check_of(fb) is None and NOTES_ATTR not in vars(fb)
    notes = forward_notes(fb)
    state = object()
    notes.check = state
    before = sparse_batch_counts()[SparsePath.SPLIT_VIEW.value]
    count_sparse_batch(SparsePath.SPLIT_VIEW, fb)
    first = notes_of(fb)
    fb.positions = torch.tensor([2, 3, 4, 1, 2, 3, 8, 9])
    assert forward_notes(fb) is notes and notes_of(fb) is not first
    count_sparse_batch(SparsePath.SPLIT_VIEW, fb)
    assert check_of(fb) is state
    assert sparse_batch_counts()[SparsePath.SPLIT_VIEW.value] == before + 1
    assert [name for name in vars(fb) if name.startswith("_semblend")] == [NOTES_ATTR]
