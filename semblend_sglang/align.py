"""Alignment: maximal token-identical spans between a target and a donor, at any shift.

:func:`align` returns the spans a greedy longest-first selection picks: repeatedly take the longest
run ``target[i:i+L] == donor[j:j+L]`` whose target and donor positions are all still unused (ties:
smallest ``i``, then smallest ``j``), until no run of at least ``min_length`` is left. Spans never
overlap in the target or in the donor, and any number of them, at any shifts, are found. Runs are
seeded by k-gram hash anchors (``k = min_length``) and measured token by token along each anchored
diagonal, so they extend past chunk and anchor edges and never rely on a hash being collision-free.

:func:`fuzzy_chunk_matches` (rapidfuzz) pairs near-identical chunks; only the substitute mode
uses it. Everything here is a pure function of its inputs.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np

from .chunking import Chunks, kgram_hashes, minimizer_positions, token_hashes


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

    ``max_anchor_pairs``: at most this many (target, donor) k-gram anchor pairs are used, rarest
    k-grams first; ``max_diagonals``: at most this many shifts are measured, those with the most
    anchors first (ties: smaller shift). Real text stays far below both defaults; a run of one
    repeated token would otherwise cost target x donor work.
    """

    max_anchor_pairs: int | None = 65536
    max_diagonals: int | None = 256


UNBOUNDED = AlignLimits(max_anchor_pairs=None, max_diagonals=None)
"""Limits under which :func:`align` is exactly the greedy longest-first selection."""


@dataclass(frozen=True, slots=True)
class Anchors:
    """Minimizer anchors of one sequence for a given ``min_length``: the selected positions and
    their k-gram hashes (``k + w - 1 == min_length``). Build with :func:`anchors_of`."""

    min_length: int
    positions: np.ndarray
    hashes: np.ndarray


def anchors_of(tokens: np.ndarray, min_length: int, hashes: np.ndarray | None = None) -> Anchors:
    """Anchors of ``tokens`` (``hashes``: its :func:`token_hashes`, when already computed).

    Every identical stretch of ``min_length`` tokens in two sequences holds an anchor of each
    at the same relative position, with equal hashes."""
    k = max(1, min_length // 2)
    w = min_length - k + 1
    kh = kgram_hashes(token_hashes(tokens) if hashes is None else hashes, k)
    if kh.size == 0:
        empty = np.empty(0, dtype=np.int64)
        return Anchors(min_length, empty, np.empty(0, dtype=np.uint64))
    pos = minimizer_positions(kh, w)
    return Anchors(min_length, pos, kh[pos])


def _anchor_diagonals(t_anchor: Anchors, d_anchor: Anchors, limits: AlignLimits) -> np.ndarray:
    """Distinct shifts ``i - j`` with an equal anchor pair, in deterministic order."""
    if t_anchor.hashes.size == 0 or d_anchor.hashes.size == 0:
        return np.empty(0, dtype=np.int64)
    t_pos, tk = t_anchor.positions, t_anchor.hashes
    d_pos, dk = d_anchor.positions, d_anchor.hashes
    order = np.argsort(dk, kind="stable")
    dk_sorted = dk[order]
    lo = np.searchsorted(dk_sorted, tk, side="left")
    hi = np.searchsorted(dk_sorted, tk, side="right")
    counts = hi - lo
    hit = np.flatnonzero(counts)
    if hit.size == 0:
        return np.empty(0, dtype=np.int64)
    counts_hit = counts[hit]
    if limits.max_anchor_pairs is not None and int(counts_hit.sum()) > limits.max_anchor_pairs:
        # rarest k-grams first (stable: then by target position)
        by_rarity = np.argsort(counts_hit, kind="stable")
        keep_n = int(np.searchsorted(np.cumsum(counts_hit[by_rarity]), limits.max_anchor_pairs))
        keep = np.sort(by_rarity[: max(keep_n, 1)])
        hit, counts_hit = hit[keep], counts_hit[keep]
    if int(counts_hit.max()) == 1:
        diags = t_pos[hit] - d_pos[order[lo[hit]]]
    else:
        total = int(counts_hit.sum())
        seg_start = np.cumsum(counts_hit) - counts_hit
        idx = np.arange(total, dtype=np.int64) - np.repeat(seg_start - lo[hit], counts_hit)
        diags = t_pos[np.repeat(hit, counts_hit)] - d_pos[order[idx]]
    uniq, n_anchor = np.unique(diags, return_counts=True)
    if limits.max_diagonals is not None and uniq.size > limits.max_diagonals:
        pick = np.lexsort((np.abs(uniq), uniq < 0, -n_anchor))[: limits.max_diagonals]
        uniq = np.sort(uniq[pick])
    return uniq


def _diagonal_runs(
    target: np.ndarray, donor: np.ndarray, diag: int, min_length: int
) -> list[tuple[int, int, int]]:
    """Maximal runs of equal tokens on one diagonal: (length, target_start, donor_start)."""
    i0 = max(diag, 0)
    j0 = i0 - diag
    n = min(target.size - i0, donor.size - j0)
    if n < min_length:
        return []
    eq = target[i0 : i0 + n] == donor[j0 : j0 + n]
    padded = np.empty(n + 2, dtype=np.int8)
    padded[0] = 0
    padded[-1] = 0
    padded[1:-1] = eq
    edges = np.diff(padded)
    starts = np.flatnonzero(edges == 1)
    ends = np.flatnonzero(edges == -1)
    lengths = ends - starts
    keep = lengths >= min_length
    return [
        (int(length), i0 + int(s), j0 + int(s))
        for s, length in zip(starts[keep], lengths[keep], strict=True)
    ]


def _free_pieces(
    t_used: np.ndarray, d_used: np.ndarray, length: int, i: int, j: int, min_length: int
) -> list[tuple[int, int, int]]:
    """Sub-runs of run (i, j, length) whose target and donor positions are all unused."""
    free = ~(t_used[i : i + length] | d_used[j : j + length])
    if free.all():
        return [(length, i, j)]
    padded = np.zeros(length + 2, dtype=np.int8)
    padded[1:-1] = free
    edges = np.diff(padded)
    starts = np.flatnonzero(edges == 1)
    ends = np.flatnonzero(edges == -1)
    return [
        (int(e - s), i + int(s), j + int(s))
        for s, e in zip(starts, ends, strict=True)
        if e - s >= min_length
    ]


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
    if min_length < 1:
        raise ValueError(f"min_length must be >= 1, got {min_length}")
    target = np.asarray(target)
    donor = np.asarray(donor)
    if target.size < min_length or donor.size < min_length:
        return ()
    if target_anchors is None or target_anchors.min_length != min_length:
        target_anchors = anchors_of(target, min_length)
    diagonals = _anchor_diagonals(target_anchors, anchors_of(donor, min_length), limits)
    heap: list[tuple[int, int, int]] = []
    for diag in diagonals.tolist():
        for length, i, j in _diagonal_runs(target, donor, diag, min_length):
            heap.append((-length, i, j))
    if not heap:
        return ()
    heapq.heapify(heap)
    t_used = np.zeros(target.size, dtype=bool)
    d_used = np.zeros(donor.size, dtype=bool)
    spans: list[Span] = []
    while heap:
        neg_len, i, j = heapq.heappop(heap)
        length = -neg_len
        pieces = _free_pieces(t_used, d_used, length, i, j, min_length)
        if len(pieces) == 1 and pieces[0] == (length, i, j):
            spans.append(Span(i, j, length))
            t_used[i : i + length] = True
            d_used[j : j + length] = True
            continue
        for p_len, p_i, p_j in pieces:
            heapq.heappush(heap, (-p_len, p_i, p_j))
    spans.sort()
    return tuple(spans)


@dataclass(frozen=True, slots=True)
class FuzzyMatch:
    """A target chunk paired with a near-identical donor chunk (substitute mode only)."""

    target_start: int
    target_end: int
    donor_start: int
    donor_end: int
    similarity: float


def fuzzy_chunk_matches(
    target: np.ndarray,
    donor: np.ndarray,
    target_chunks: Chunks,
    donor_chunks: Chunks,
    *,
    threshold: float,
    exclude: tuple[Span, ...] = (),
    max_matches: int = 64,
) -> tuple[FuzzyMatch, ...]:
    """Pair each target chunk not covered by ``exclude`` with its most similar unused donor chunk.

    Similarity is rapidfuzz's normalized Indel similarity of the token-id sequences; a pair is kept
    when it is at least ``threshold``. Greedy in target order; ties go to the earliest donor chunk.
    Deterministic. Only the substitute mode calls this: the pairs are not token-identical.
    """
    from rapidfuzz.distance import Indel

    covered = np.zeros(target.size, dtype=bool)
    for span in exclude:
        covered[span.target_start : span.target_end] = True
    donor_seqs = [
        donor[s:e].tolist()
        for s, e in zip(donor_chunks.starts.tolist(), donor_chunks.ends.tolist(), strict=True)
    ]
    used = [False] * len(donor_seqs)
    out: list[FuzzyMatch] = []
    for ts, te in zip(target_chunks.starts.tolist(), target_chunks.ends.tolist(), strict=True):
        if len(out) >= max_matches:
            break
        if covered[ts:te].any():
            continue
        seq = target[ts:te].tolist()
        best, best_sim = -1, threshold
        for idx, dseq in enumerate(donor_seqs):
            if used[idx]:
                continue
            sim = Indel.normalized_similarity(seq, dseq, score_cutoff=best_sim)
            if sim > best_sim or (best < 0 and sim >= best_sim):
                best, best_sim = idx, sim
        if best >= 0:
            used[best] = True
            out.append(
                FuzzyMatch(
                    ts,
                    te,
                    int(donor_chunks.starts[best]),
                    int(donor_chunks.ends[best]),
                    float(best_sim),
                )
            )
    return tuple(out)
