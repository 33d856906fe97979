"""Alignment: equals a brute-force oracle; finds any shift and any number of reordered passages."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from semblend_sglang.align import UNBOUNDED, AlignLimits, Span, align, measured_align
from semblend_sglang.anchors import anchor_geometry, anchors_of
from semblend_sglang.chunking import token_prefix


def brute_force(target: list[int], donor: list[int], min_length: int) -> tuple[Span, ...]:
    """The definition: repeatedly take the longest unused identical run (ties: smallest target
    start, then smallest donor start) until none of at least min_length is left."""
    t_used = [False] * len(target)
    d_used = [False] * len(donor)
    spans = []
    while True:
        best = None
        for i in range(len(target)):
            for j in range(len(donor)):
                length = 0
                while (
                    i + length < len(target)
                    and j + length < len(donor)
                    and not t_used[i + length]
                    and not d_used[j + length]
                    and target[i + length] == donor[j + length]
                ):
                    length += 1
                if length >= min_length and (best is None or (-length, i, j) < best):
                    best = (-length, i, j)
        if best is None:
            return tuple(sorted(spans))
        length, i, j = -best[0], best[1], best[2]
        spans.append(Span(i, j, length))
        for x in range(length):
            t_used[i + x] = True
            d_used[j + x] = True


@st.composite
def sequence_pairs(draw: Any) -> tuple[list[int], list[int], int]:
    alphabet = draw(st.integers(1, 5))
    tokens = st.integers(0, alphabet - 1)
    target = draw(st.lists(tokens, max_size=36))
    donor = draw(st.lists(tokens, max_size=36))
    if target and draw(st.booleans()):  # plant shared pieces of the target in the donor
        a = draw(st.integers(0, len(target) - 1))
        b = draw(st.integers(a, len(target)))
        at = draw(st.integers(0, len(donor)))
        donor = donor[:at] + target[a:b] + donor[at:]
    return target, donor, draw(st.integers(1, 6))


@settings(max_examples=400, deadline=None)
@given(sequence_pairs())
def test_align_equals_brute_force_oracle(case: tuple[list[int], list[int], int]) -> None:
    target, donor, min_length = case
    got = align(
        np.asarray(target, dtype=np.int64),
        np.asarray(donor, dtype=np.int64),
        min_length=min_length,
        limits=UNBOUNDED,
    )
    assert got == brute_force(target, donor, min_length)


@settings(max_examples=150, deadline=None)
@given(sequence_pairs())
def test_spans_are_identical_and_disjoint(case: tuple[list[int], list[int], int]) -> None:
    target, donor, min_length = case
    t = np.asarray(target, dtype=np.int64)
    d = np.asarray(donor, dtype=np.int64)
    spans = align(t, d, min_length=min_length)  # default limits
    t_cover = np.zeros(t.size, dtype=int)
    d_cover = np.zeros(d.size, dtype=int)
    for s in spans:
        assert s.length >= min_length
        assert np.array_equal(t[s.target_start : s.target_end], d[s.donor_start : s.donor_end])
        t_cover[s.target_start : s.target_end] += 1
        d_cover[s.donor_start : s.donor_end] += 1
    assert t_cover.max(initial=0) <= 1
    assert d_cover.max(initial=0) <= 1


def test_precomputed_target_anchors_give_the_same_result(essay_ids: np.ndarray) -> None:
    target = essay_ids[:3000]
    donor = np.concatenate([essay_ids[5000:5100], essay_ids[1000:2500]])
    anchors = anchors_of(target, 32)
    assert align(target, donor, target_anchors=anchors) == align(target, donor)
    assert align(target, donor) == (Span(1000, 100, 1500),)


@pytest.fixture(scope="module")
def essay_ids(smollm2_tokenizer: Any, essay_texts: list[str]) -> np.ndarray:
    """Token ids of the 49 real essays, concatenated (about 154K tokens)."""
    ids = [smollm2_tokenizer(t, add_special_tokens=False)["input_ids"] for t in essay_texts]
    return np.asarray([tok for part in ids for tok in part], dtype=np.int64)


@pytest.mark.parametrize("shift", [1, 2, 7, 31, 64, 333, 1000, 2049, 4096, 4999, 5000])
def test_shifted_context_is_found_at_any_shift(essay_ids: np.ndarray, shift: int) -> None:
    passage = essay_ids[:3000]
    other = essay_ids[20000 : 20000 + shift]  # text from a different essay in front
    target = np.concatenate([other, passage])
    spans = align(target, passage, min_length=32)
    longest = max(spans, key=lambda s: s.length)
    assert longest == Span(shift, 0, 3000)
    assert longest.delta == shift


def test_reordered_passages_give_one_span_per_passage(essay_ids: np.ndarray) -> None:
    cuts = [0, 700, 1100, 1900, 2300, 3100, 3600]
    starts = [4000, 9000, 14000, 19000, 24000, 29000]
    passages = [essay_ids[s : s + (cuts[i + 1] - cuts[i])] for i, s in enumerate(starts)]
    donor = np.concatenate(passages)
    donor_pos = np.cumsum([0] + [p.size for p in passages])[:-1]
    order = [3, 0, 5, 2, 4, 1]
    header = essay_ids[40000:40120]
    target = np.concatenate([header] + [passages[k] for k in order])
    target_pos = {}
    at = header.size
    for k in order:
        target_pos[k] = at
        at += passages[k].size
    spans = align(target, donor, min_length=32)
    assert len(spans) == len(passages)
    for k, passage in enumerate(passages):
        (span,) = [s for s in spans if s.delta == target_pos[k] - donor_pos[k]]
        assert span.target_start <= target_pos[k]
        assert span.target_end >= target_pos[k] + passage.size
        assert span.length <= passage.size + 2  # at most a boundary token coincides


def test_no_span_between_unrelated_texts(essay_ids: np.ndarray) -> None:
    assert align(essay_ids[:2000], essay_ids[30000:32000], min_length=32) == ()


def test_repetitive_input_is_bounded_and_still_exact() -> None:
    target = np.zeros(3000, dtype=np.int64)
    donor = np.zeros(2000, dtype=np.int64)
    limits = AlignLimits(max_anchor_pairs=10000, max_diagonals=8)
    spans = align(target, donor, min_length=32, limits=limits)
    assert spans, "a run of one repeated token is still aligned"
    for s in spans:
        assert np.array_equal(
            target[s.target_start : s.target_end], donor[s.donor_start : s.donor_end]
        )
    assert max(s.length for s in spans) == 2000
    measured = measured_align(target, donor, min_length=32, limits=limits)
    assert measured.spans == spans
    assert measured.pair_work == 10000 and measured.diagonals == 8  # both caps bind


def test_measured_work_of_real_text_is_what_it_listed(essay_ids: np.ndarray) -> None:
    """On real text an alignment uses a small part of its limits, and says so: its pair work is
    the anchor pairs it found (no bucket holds two anchors' worth of probes here) and its
    diagonals the distinct shifts of those pairs; the spans are :func:`align`'s."""
    target = np.concatenate([essay_ids[5000:6000], essay_ids[:3000]])
    donor = essay_ids[:4000]
    limits = AlignLimits(max_anchor_pairs=65536, max_diagonals=256)
    measured = measured_align(target, donor, min_length=32, limits=limits)
    assert measured.spans == align(target, donor, min_length=32, limits=limits)
    assert measured.spans and measured.spans[0].target_start == 1000
    assert 0 < measured.pair_work < 65536 // 4 and 1 <= measured.diagonals < 256 // 4
    tight = AlignLimits(max_anchor_pairs=8, max_diagonals=1)
    capped = measured_align(target, donor, min_length=32, limits=tight)
    assert capped.pair_work <= 8 and capped.diagonals <= 1


def test_span_geometry() -> None:
    span = Span(target_start=130, donor_start=30, length=50)
    assert span.delta == 100
    assert span.target_end == 180
    assert span.donor_end == 80


def diagonal_oracle(target: np.ndarray, donor: np.ndarray, min_length: int) -> tuple[Span, ...]:
    """The greedy definition again, for inputs too long for ``brute_force``: every step scans
    every diagonal for its maximal runs of equal, unused tokens (no anchors, no hashing) and takes
    the longest (ties: smallest target start, then smallest donor start)."""
    t_used = np.zeros(target.size, dtype=bool)
    d_used = np.zeros(donor.size, dtype=bool)
    spans = []
    while True:
        best = None
        for diag in range(-(donor.size - 1), target.size):
            i0 = max(diag, 0)
            j0 = i0 - diag
            m = min(target.size - i0, donor.size - j0)
            if m < min_length:
                continue
            ok = (target[i0 : i0 + m] == donor[j0 : j0 + m]) & ~t_used[i0 : i0 + m]
            ok &= ~d_used[j0 : j0 + m]
            edges = np.diff(np.concatenate([[0], ok.astype(np.int8), [0]]))
            for s, e in zip(np.flatnonzero(edges == 1), np.flatnonzero(edges == -1), strict=True):
                if e - s >= min_length:
                    key = (-(int(e) - int(s)), i0 + int(s), j0 + int(s))
                    best = key if best is None or key < best else best
        if best is None:
            return tuple(sorted(spans))
        length, i, j = -best[0], best[1], best[2]
        spans.append(Span(i, j, length))
        t_used[i : i + length] = True
        d_used[j : j + length] = True


@st.composite
def planted_pairs(draw: Any) -> tuple[np.ndarray, np.ndarray, int]:
    """Longer target/donor pairs: random tokens (a large or a tiny alphabet) with pieces of the
    target copied into the donor at arbitrary offsets, so shared spans start and end anywhere
    relative to chunk boundaries and to the sampled anchors."""
    alphabet = draw(st.sampled_from([3, 50_000]))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    target = rng.integers(0, alphabet, draw(st.integers(0, 400)))
    donor = rng.integers(0, alphabet, draw(st.integers(0, 400)))
    for _ in range(draw(st.integers(0, 4))):
        if target.size == 0:
            break
        a = draw(st.integers(0, target.size - 1))
        b = draw(st.integers(a, min(target.size, a + 160)))
        at = draw(st.integers(0, donor.size))
        donor = np.concatenate([donor[:at], target[a:b], donor[at:]])
    return target, donor, draw(st.sampled_from([1, 2, 5, 16, 31, 32, 33, 64]))


@settings(max_examples=120, deadline=None)
@given(planted_pairs())
def test_sampled_anchor_alignment_equals_the_oracle_on_longer_input(
    case: tuple[np.ndarray, np.ndarray, int],
) -> None:
    """The target is sampled at every stride-th k-gram and every donor k-gram is looked up;
    spans that start mid-chunk, between anchors, or at any shift are still found and extended
    token by token, exactly as the definition."""
    target, donor, min_length = case
    want = diagonal_oracle(target, donor, min_length)
    assert align(target, donor, min_length=min_length, limits=UNBOUNDED) == want
    anchors = anchors_of(target, min_length, prefix=token_prefix(target))
    got = align(target, donor, min_length=min_length, limits=UNBOUNDED, target_anchors=anchors)
    assert got == want


def test_anchor_sampling_covers_every_window_of_min_length() -> None:
    for min_length in (1, 2, 3, 16, 31, 32, 33, 100):
        k, stride = anchor_geometry(min_length)
        assert k >= 1 and stride >= 1 and k + stride - 1 == min_length
        positions = anchors_of(np.arange(500, dtype=np.int64), min_length).positions
        for start in range(500 - min_length + 1):  # each window holds a whole sampled k-gram
            inside = (positions >= start) & (positions + k <= start + min_length)
            assert inside.any(), (min_length, start)
