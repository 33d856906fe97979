"""Alignment: maximal token-identical spans between a target and a donor, at any shift.

:func:`align` returns the spans a greedy longest-first selection picks: repeatedly take the longest
run ``target[i:i+L] == donor[j:j+L]`` whose target and donor positions are all still unused (ties:
smallest ``i``, then smallest ``j``), until no run of at least ``min_length`` is left. Spans never
overlap in the target or in the donor, and any number of them, at any shifts, are found.

How: the target is sampled with k-gram anchors at every ``stride``-th position (``k + stride - 1 ==
min_length``, so every stretch of ``min_length`` target tokens holds a whole sampled k-gram); each
donor k-gram, at every position, is looked up in a small hash table of the sampled ones (both in
:mod:`semblend_sglang.anchors`; its :class:`Anchors` and :func:`anchors_of` are importable from here
too). An equal pair names a diagonal (shift ``i - j``); tokens are then compared along each such
diagonal, so runs extend past chunk and anchor edges at both ends, and no result relies on a hash
being collision-free. Every identical run of at least ``min_length`` tokens holds an anchor pair, so
with :data:`UNBOUNDED` limits the result is exactly the greedy definition. The target side
(:func:`anchors_of`) is built once per lookup and shared by every donor aligned against it; per
donor the work is one pass of k-gram hashes plus a few table probes, with no sorting of donor
tokens and no Python loop over positions.

Everything here is a pure function of its inputs.
"""

from __future__ import annotations

import heapq
from bisect import bisect_left, bisect_right
from dataclasses import dataclass

import numpy as np

from .anchors import Anchors, anchor_pairs, anchors_of
from .chunking import kgram_hashes, token_prefix

_GATHER_LIMIT = 1 << 18
"""Diagonal overlaps (tokens in all) up to which many diagonals are compared in one gather."""


@dataclass(frozen=True, slots=True, order=True)
class Span:
    """``target[target_start : target_start + length] == donor[donor_start : ... + length]``."""

    target_start: int
    donor_start: int
    length: int

    @property
    def delta(self) -> int:
        """Position shift applied to the donor's KV: ``target_start - donor_start``."""
        return self.target_start - self.donor_start

    @property
    def target_end(self) -> int:
        """One past the last target position of the span."""
        return self.target_start + self.length

    @property
    def donor_end(self) -> int:
        """One past the last donor position of the span."""
        return self.donor_start + self.length


@dataclass(frozen=True, slots=True)
class AlignLimits:
    """Work bounds for :func:`align` on repetitive input (``None``: unbounded, exact greedy).

    ``max_anchor_pairs``: at most this many (target anchor, donor position) pairs of equal
    k-grams are used, target anchors with the fewest donor matches first (ties: smaller target
    position); ``max_diagonals``: at most this many shifts are measured, those with the most
    anchor pairs first (ties: smaller shift); ``max_shared_probes``: at most this many donor
    positions whose k-gram falls in a bucket of several target anchors are probed, evenly spaced
    over the donor. Real text stays far below the defaults; a run of one repeated token would
    otherwise cost target x donor work.
    """

    max_anchor_pairs: int | None = 65536
    max_diagonals: int | None = 256
    max_shared_probes: int | None = 65536


UNBOUNDED = AlignLimits(max_anchor_pairs=None, max_diagonals=None, max_shared_probes=None)
"""Limits under which :func:`align` is exactly the greedy longest-first selection."""


def _diagonals(t_pos: np.ndarray, d_pos: np.ndarray, limits: AlignLimits) -> np.ndarray:
    """Distinct shifts ``i - j`` of the anchor pairs (sorted), within ``max_diagonals``."""
    if t_pos.size == 0:
        return t_pos
    diags = t_pos - d_pos
    diags.sort()
    starts = (diags[1:] != diags[:-1]).nonzero()[0]
    if starts.size == 0:
        return diags[:1]
    starts += 1
    uniq = np.concatenate((diags[:1], diags[starts]))
    if limits.max_diagonals is not None and uniq.size > limits.max_diagonals:
        n_anchor = np.diff(np.concatenate([[0], starts, [diags.size]]))
        pick = np.lexsort((np.abs(uniq), uniq < 0, -n_anchor))[: limits.max_diagonals]
        uniq = np.sort(uniq[pick])
    return uniq


def _one_diagonal_runs(
    target: np.ndarray, donor: np.ndarray, diag: int, min_length: int, out: list
) -> None:
    """Append the maximal runs of at least ``min_length`` equal tokens on diagonal ``diag`` to
    ``out`` as ``(-length, target_start, donor_start)``."""
    a = max(diag, 0)
    b = a - diag
    m = min(target.size - a, donor.size - b)
    if m < min_length:
        return
    stops = (target[a : a + m] != donor[b : b + m]).nonzero()[0]
    if stops.size == 0:
        out.append((-m, a, b))
        return
    first, last = int(stops[0]), int(stops[-1])
    if first >= min_length:
        out.append((-first, a, b))
    if stops.size > 1:
        gap = stops[1:] - stops[:-1]
        gap -= 1
        long = (gap >= min_length).nonzero()[0]
        if long.size:
            begin = (stops[long] + 1).tolist()
            for g, s in zip(gap[long].tolist(), begin, strict=True):
                out.append((-g, a + s, b + s))
    if m - 1 - last >= min_length:
        out.append((last + 1 - m, a + last + 1, b + last + 1))


def _diagonal_runs(
    target: np.ndarray, donor: np.ndarray, diags: np.ndarray, min_length: int
) -> list[tuple[int, int, int]]:
    """Maximal runs of equal tokens of at least ``min_length`` on the given diagonals, as
    ``(-length, target_start, donor_start)``. Few diagonals are compared one slice each; many in
    one vectorized pass, where each diagonal's overlap gets one extra, always-unequal slot so
    runs never cross diagonals."""
    out: list[tuple[int, int, int]] = []
    if diags.size <= 4:
        for diag in diags.tolist():
            _one_diagonal_runs(target, donor, diag, min_length, out)
        return out
    i0 = np.maximum(diags, 0)
    j0 = i0 - diags
    size = np.minimum(target.size - i0, donor.size - j0)
    keep = size >= min_length
    if not keep.all():
        i0, j0, size = i0[keep], j0[keep], size[keep]
    if int(size.sum()) > _GATHER_LIMIT:  # long diagonals: slices beat index arrays
        for diag in (i0 - j0).tolist():
            _one_diagonal_runs(target, donor, diag, min_length, out)
        return out
    if size.size == 0:
        return out
    slots = size + 1  # the last slot of each diagonal is a separator
    seg = np.cumsum(slots) - slots
    total = int(seg[-1] + slots[-1])
    rel = np.arange(total, dtype=np.int64) - np.repeat(seg, slots)
    t_idx = np.repeat(i0, slots) + rel
    d_idx = np.repeat(j0, slots) + rel
    sep = seg + size
    t_idx[sep] = 0
    d_idx[sep] = 0
    unequal = target[t_idx] != donor[d_idx]
    unequal[sep] = True
    stops = np.flatnonzero(unequal)
    prev = np.empty_like(stops)
    prev[0] = -1
    prev[1:] = stops[:-1]
    gap = stops - prev - 1
    long = np.flatnonzero(gap >= min_length)
    if long.size == 0:
        return out
    first = prev[long] + 1
    out.extend(
        (-g, t, d)
        for g, t, d in zip(
            gap[long].tolist(), t_idx[first].tolist(), d_idx[first].tolist(), strict=True
        )
    )
    return out


class _Used:
    """Disjoint, sorted intervals of used positions (few: one per selected span)."""

    __slots__ = ("ends", "starts")

    def __init__(self) -> None:
        self.starts: list[int] = []
        self.ends: list[int] = []

    def blocked(self, lo: int, hi: int, base: int, out: list[tuple[int, int]]) -> None:
        """Append the used parts of ``[lo, hi)``, relative to ``base``, to ``out``."""
        first = bisect_right(self.ends, lo)
        last = bisect_left(self.starts, hi)
        for x in range(first, last):
            out.append((max(self.starts[x], lo) - base, min(self.ends[x], hi) - base))

    def add(self, lo: int, hi: int) -> None:
        at = bisect_left(self.starts, lo)
        self.starts.insert(at, lo)
        self.ends.insert(at, hi)


def _free_pieces(
    t_used: _Used, d_used: _Used, length: int, i: int, j: int, min_length: int
) -> list[tuple[int, int, int]] | None:
    """None when run (i, j, length) is wholly unused; else its unused sub-runs of at least
    ``min_length``, as ``(-length, target_start, donor_start)``."""
    blocked: list[tuple[int, int]] = []
    t_used.blocked(i, i + length, i, blocked)
    d_used.blocked(j, j + length, j, blocked)
    if not blocked:
        return None
    blocked.sort()
    pieces = []
    at = 0
    for lo, hi in blocked:
        if lo - at >= min_length:
            pieces.append((at - lo, i + at, j + at))
        at = max(at, hi)
    if length - at >= min_length:
        pieces.append((at - length, i + at, j + at))
    return pieces


@dataclass(frozen=True, slots=True)
class Alignment:
    """What :func:`measured_align` found and spent: ``spans`` as :func:`align` returns them,
    ``pair_work`` (the anchor-pair units spent, see
    :class:`~semblend_sglang.anchors.AnchorPairs`) and ``diagonals`` (the shifts compared).
    Neither count exceeds the limits the alignment ran under."""

    spans: tuple[Span, ...]
    pair_work: int
    diagonals: int


def align(
    target: np.ndarray,
    donor: np.ndarray,
    *,
    min_length: int = 32,
    limits: AlignLimits = AlignLimits(),
    target_anchors: Anchors | None = None,
) -> tuple[Span, ...]:
    """Maximal identical spans between ``target`` and ``donor`` (1-D integer arrays).

    Greedy longest-first (see module docstring); returned sorted by ``target_start``. With
    :data:`UNBOUNDED` limits the result equals the brute-force definition exactly.
    ``target_anchors``: :func:`anchors_of` the target for ``min_length``, to reuse across donors.
    Pure; never mutates its inputs.
    """
    return measured_align(
        target, donor, min_length=min_length, limits=limits, target_anchors=target_anchors
    ).spans


def measured_align(
    target: np.ndarray,
    donor: np.ndarray,
    *,
    min_length: int = 32,
    limits: AlignLimits = AlignLimits(),
    target_anchors: Anchors | None = None,
) -> Alignment:
    """:func:`align`, with the work it spent (for a lookup budget that charged the limits up
    front and refunds what went unused). Pure; never mutates its inputs."""
    if min_length < 1:
        raise ValueError(f"min_length must be >= 1, got {min_length}")
    target = np.asarray(target)
    donor = np.asarray(donor)
    if target.size < min_length or donor.size < min_length:
        return Alignment((), 0, 0)
    if target_anchors is None or target_anchors.min_length != min_length:
        target_anchors = anchors_of(target, min_length)
    donor_kgrams = kgram_hashes(None, target_anchors.k, token_prefix(donor))
    pairs = anchor_pairs(
        target_anchors,
        donor_kgrams,
        max_pairs=limits.max_anchor_pairs,
        max_shared_probes=limits.max_shared_probes,
    )
    diags = _diagonals(pairs.target_positions, pairs.donor_positions, limits)
    heap = _diagonal_runs(target, donor, diags, min_length)
    return Alignment(_greedy(heap, min_length), pairs.pair_work, int(diags.size))


def _greedy(heap: list[tuple[int, int, int]], min_length: int) -> tuple[Span, ...]:
    """The greedy longest-first selection over runs ``(-length, target_start, donor_start)``
    (consumed), sorted by target start."""
    if not heap:
        return ()
    if len(heap) == 1:
        neg_len, i, j = heap[0]
        return (Span(i, j, -neg_len),)
    spans: list[Span] = []
    heapq.heapify(heap)
    t_used = _Used()
    d_used = _Used()
    while heap:
        neg_len, i, j = heapq.heappop(heap)
        length = -neg_len
        pieces = _free_pieces(t_used, d_used, length, i, j, min_length)
        if pieces is None:
            spans.append(Span(i, j, length))
            t_used.add(i, i + length)
            d_used.add(j, j + length)
            continue
        for piece in pieces:
            heapq.heappush(heap, piece)
    spans.sort()
    return tuple(spans)
