"""Alignment anchors: sampled k-grams of a target, and the donor k-grams that equal them.

:func:`anchors_of` samples the target with k-gram anchors at every ``stride``-th position
(:func:`anchor_geometry`: ``k + stride - 1 == min_length``, so every stretch of ``min_length``
target tokens holds a whole sampled k-gram) and builds a small hash table over them, once per
lookup. :func:`anchor_pairs` looks each donor k-gram, at every position, up in that table and
returns the (target position, donor position) pairs of equal hashes, which
:func:`~semblend_sglang.align.align` turns into diagonals to compare token by token. Hash equality
is only a hint: no result relies on a hash being collision-free.

Everything here is a pure function of its inputs.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .chunking import poly_prefix, strided_window_hashes, token_prefix

_U64 = np.uint64


def anchor_geometry(min_length: int) -> tuple[int, int]:
    """``(k, stride)`` of the target anchors for ``min_length``: k-grams of ``k`` tokens at every
    ``stride``-th target position, ``k + stride - 1 == min_length``."""
    k = max(1, min_length // 2)
    return k, min_length - k + 1


@dataclass(frozen=True, slots=True)
class Anchors:
    """Sampled k-gram anchors of one target for a given ``min_length``: the target positions
    ``0, stride, 2 * stride, ...`` (those with a whole k-gram inside the target) and their
    k-gram hashes, plus a lookup table over them. Build with :func:`anchors_of`; immutable, so
    one instance can serve concurrent lookups."""

    min_length: int
    k: int
    stride: int
    hashes: np.ndarray
    # Lookup table (internal): `_table[hash >> _shift]` is 1 + the index of the only anchor in
    # that bucket, 0 for none, -1 for several (equal hashes or not; `_shared` tells whether any
    # bucket is so marked). `_check[1 + i]` is anchor i's hash; `_check[-1]` is a sentinel that
    # no donor k-gram in a -1 bucket can equal.
    _table: np.ndarray
    _shift: int
    _check: np.ndarray
    _shared: bool

    @property
    def positions(self) -> np.ndarray:
        """Target position of each anchor."""
        return np.arange(0, self.hashes.size * self.stride, self.stride, dtype=np.int64)


def anchors_of(
    tokens: np.ndarray,
    min_length: int,
    hashes: np.ndarray | None = None,
    prefix: np.ndarray | None = None,
) -> Anchors:
    """Target anchors of ``tokens`` for ``min_length`` (see :class:`Anchors`).

    ``hashes``: :func:`~semblend_sglang.chunking.token_hashes` of ``tokens``; ``prefix``:
    :func:`~semblend_sglang.chunking.poly_prefix` of those (or
    :func:`~semblend_sglang.chunking.token_prefix` of the tokens), when already computed. Every
    identical stretch of ``min_length`` tokens between ``tokens`` and any donor holds a sampled
    k-gram of ``tokens`` whose donor copy has the same hash."""
    if min_length < 1:
        raise ValueError(f"min_length must be >= 1, got {min_length}")
    k, stride = anchor_geometry(min_length)
    if int(tokens.size) < min_length:
        none = np.empty(0, dtype=_U64)
        return Anchors(min_length, k, stride, none, np.zeros(1, np.int32), 63, none, False)
    if prefix is None:
        prefix = token_prefix(tokens) if hashes is None else poly_prefix(hashes)
    values = strided_window_hashes(prefix, k, stride)
    # Bucket table on the top bits of the hash: at least 64 slots per anchor, so few donor
    # k-grams land in an occupied bucket and few buckets hold two anchors
    bits = max(4, min(22, int(values.size * 64 - 1).bit_length()))
    shift = 64 - bits
    buckets = (values >> _U64(shift)).view(np.int64)
    code = np.arange(1, values.size + 1, dtype=np.int32)
    table = np.zeros(1 << bits, dtype=np.int32)
    table[buckets] = code  # several anchors in one bucket: one wins, the bucket is marked next
    lost = buckets[table[buckets] != code]
    if lost.size:
        table[lost] = -1
    # The sentinel read through code -1 lies in an empty bucket, so no donor k-gram that reaches
    # it (all of those lie in buckets marked -1) can equal it.
    empty = 0
    while table[empty] != 0:
        empty += 1
    check = np.empty(values.size + 2, dtype=_U64)
    check[1:-1] = values
    check[0] = check[-1] = empty << shift
    return Anchors(min_length, k, stride, values, table, shift, check, bool(lost.size))


@dataclass(frozen=True, slots=True)
class AnchorPairs:
    """What :func:`anchor_pairs` found: the pairs as parallel position arrays, and
    ``pair_work``, the pair units it spent (pairs listed plus donor positions probed in buckets
    of several anchors; ``max_pairs`` whenever that cap applied), which a work budget charged
    per pair may refund down to."""

    target_positions: np.ndarray
    donor_positions: np.ndarray
    pair_work: int


def anchor_pairs(
    anchors: Anchors,
    donor_kgrams: np.ndarray,
    *,
    max_pairs: int | None,
    max_shared_probes: int | None,
) -> AnchorPairs:
    """The pairs of equal k-gram hashes between ``anchors`` and ``donor_kgrams`` (the donor's
    k-gram hash at each position, k = ``anchors.k``). ``max_pairs`` and ``max_shared_probes``
    bound the work as :class:`~semblend_sglang.align.AlignLimits` describes (``None``: every
    pair)."""
    empty = np.empty(0, dtype=np.int64)
    if anchors.hashes.size == 0 or donor_kgrams.size == 0:
        return AnchorPairs(empty, empty, 0)
    # hot path: ndarray methods and ufuncs only (numpy's Python-level helpers cost more)
    slot = anchors._table[(donor_kgrams >> _U64(anchors._shift)).view(np.int64)]
    cand = (slot != 0).nonzero()[0]  # (a bool mask has numpy's fast nonzero)
    code = slot[cand]
    probe = donor_kgrams[cand]
    hit = (anchors._check[code] == probe).nonzero()[0]  # code -1 reads the sentinel
    d_pos = cand[hit]
    t_idx = code[hit].astype(np.int64)
    t_idx -= 1
    probes = 0
    if anchors._shared:
        shared = (code < 0).nonzero()[0]
        cap = max_shared_probes
        if cap is not None and shared.size > cap:
            shared = shared[:: -(-shared.size // cap)]  # evenly spaced, deterministic
        probes = int(shared.size)
        if shared.size:
            s_probe, s_pos = probe[shared], cand[shared]
            m = anchors.hashes.size
            if s_probe.size * m <= 1 << 16:
                flat = (s_probe[:, None] == anchors.hashes[None, :]).ravel().nonzero()[0]
                rows = flat // m
                d_pos = np.concatenate((d_pos, s_pos[rows]))
                t_idx = np.concatenate((t_idx, flat - rows * m))
            else:
                ranges = _SortedAnchors(anchors, s_probe)
                if max_pairs is not None and d_pos.size + ranges.total > max_pairs:
                    t_pos, d_kept = _limited_pairs(anchors, t_idx, d_pos, ranges, s_pos, max_pairs)
                    return AnchorPairs(t_pos, d_kept, max_pairs)
                d_more, t_more = ranges.expand(s_pos)
                d_pos = np.concatenate([d_pos, d_more])
                t_idx = np.concatenate([t_idx, t_more])
    if max_pairs is not None and d_pos.size > max_pairs:
        t_pos, d_kept = _limited_pairs(anchors, t_idx, d_pos, None, empty, max_pairs)
        return AnchorPairs(t_pos, d_kept, max_pairs)
    t_idx *= anchors.stride
    work = int(d_pos.size) + probes
    return AnchorPairs(t_idx, d_pos, work if max_pairs is None else min(work, max_pairs))


class _SortedAnchors:
    """For each of many donor k-gram hashes, the range of equal anchors in hash order."""

    def __init__(self, anchors: Anchors, probe: np.ndarray) -> None:
        self.order = np.argsort(anchors.hashes, kind="stable")
        ordered = anchors.hashes[self.order]
        self.lo = np.searchsorted(ordered, probe, side="left")
        self.hi = np.searchsorted(ordered, probe, side="right")
        self.count = self.hi - self.lo
        self.total = int(self.count.sum())

    def expand(
        self, d_pos: np.ndarray, keep_sorted: np.ndarray | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """All pairs (donor positions, anchor indices); only anchors whose hash-order index is in
        ``keep_sorted`` (sorted) when given."""
        lo, count = self.lo, self.count
        if keep_sorted is not None:
            lo = np.searchsorted(keep_sorted, self.lo)
            count = np.searchsorted(keep_sorted, self.hi) - lo
        total = int(count.sum())
        seg = np.cumsum(count) - count
        idx = np.arange(total, dtype=np.int64) - np.repeat(seg - lo, count)
        if keep_sorted is not None:
            idx = keep_sorted[idx]
        return np.repeat(d_pos, count), self.order[idx].astype(np.int64)


def _limited_pairs(
    anchors: Anchors,
    t_idx: np.ndarray,
    d_pos: np.ndarray,
    ranges: _SortedAnchors | None,
    range_pos: np.ndarray,
    max_pairs: int,
) -> tuple[np.ndarray, np.ndarray]:
    """The pairs of the target anchors with the fewest donor matches (ties: target position)
    until ``max_pairs`` (at least one anchor), as (target positions, donor positions). Pairs are
    ``(t_idx, d_pos)`` plus, when given, every pair of ``ranges`` (donor positions
    ``range_pos``), which are counted without being listed."""
    m = anchors.hashes.size
    per_anchor = np.bincount(t_idx, minlength=m)
    if ranges is not None:
        starts = np.bincount(ranges.lo, minlength=m + 1)
        ends = np.bincount(ranges.hi, minlength=m + 1)
        per_anchor[ranges.order] += np.cumsum(starts - ends)[:m]
    matched = np.flatnonzero(per_anchor)
    by_rarity = matched[np.argsort(per_anchor[matched], kind="stable")]
    keep_n = int(np.searchsorted(np.cumsum(per_anchor[by_rarity]), max_pairs))
    kept = np.zeros(m, dtype=bool)
    kept[by_rarity[: max(keep_n, 1)]] = True
    sel = kept[t_idx]
    t_idx, d_pos = t_idx[sel], d_pos[sel]
    if ranges is not None:
        d_more, t_more = ranges.expand(range_pos, np.flatnonzero(kept[ranges.order]))
        d_pos = np.concatenate([d_pos, d_more])
        t_idx = np.concatenate([t_idx, t_more])
    return t_idx * anchors.stride, d_pos
