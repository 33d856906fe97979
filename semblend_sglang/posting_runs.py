"""Posting runs: the sorted (chunk key, donor id) arrays a token index keeps its postings in.

:class:`~semblend_sglang.index.TokenIndex` holds a few of them. A run pairs chunk keys (uint64,
ascending) with donor ids (same order); :class:`PostingRun` finds the postings of many keys in one
whole-array step, and :func:`merge_runs` merges two runs while dropping the postings of donors no
longer alive. When runs are merged, how many there are and which donors are alive is the index's
business; nothing here locks or keeps state beyond one run.
"""

from __future__ import annotations

import numpy as np

DIRECTORY_MIN = 4096
"""Runs with at least this many postings, and at least 4 postings per distinct key on average,
keep a directory of their distinct keys."""


class PostingRun:
    """One sorted posting run: ``keys`` (uint64, ascending) and ``ids`` (donor ids, same order; a
    key's postings in registration order). A run with many postings per distinct key (a
    document many donors share) also keeps its distinct keys and where each one's postings start:
    a probe searches that small array, which stays in cache, instead of the whole run."""

    __slots__ = ("_distinct", "_starts", "ids", "keys")

    def __init__(self, keys: np.ndarray, ids: np.ndarray) -> None:
        self.keys = keys
        self.ids = ids
        self._distinct: np.ndarray | None = None
        self._starts: np.ndarray | None = None
        if keys.size >= DIRECTORY_MIN:
            new = keys[1:] != keys[:-1]
            n_distinct = 1 + int(np.count_nonzero(new))
            if 4 * n_distinct <= keys.size:
                starts = np.empty(n_distinct + 1, dtype=np.int64)
                starts[0] = 0
                starts[1:-1] = new.nonzero()[0]
                starts[1:-1] += 1
                starts[-1] = keys.size
                self._distinct = keys[starts[:-1]]
                self._starts = starts

    @property
    def nbytes(self) -> int:
        """Bytes of the run's arrays."""
        total = self.keys.nbytes + self.ids.nbytes
        if self._distinct is not None and self._starts is not None:
            total += self._distinct.nbytes + self._starts.nbytes
        return total

    def find(self, qkeys: np.ndarray, bounds: np.ndarray, out: np.ndarray) -> None:
        """Write the posting range ``[lo, hi)`` of each of ``qkeys`` to ``out[0]``, ``out[1]``
        (``bounds``: ``qkeys`` then ``qkeys + 1``)."""
        distinct, starts = self._distinct, self._starts
        if distinct is None or starts is None:
            out[:] = self.keys.searchsorted(bounds).reshape(2, qkeys.size)
        else:  # an absent key finds the same distinct slot for k and k + 1: an empty range
            out[:] = starts[distinct.searchsorted(bounds)].reshape(2, qkeys.size)


def merge_runs(a: PostingRun, b: PostingRun, alive: np.ndarray) -> PostingRun:
    """Merge two sorted runs (b after a for equal keys), dropping the postings of donors whose
    ``alive[id]`` is False. Neither input is modified."""
    ak, ai = a.keys, a.ids
    bk, bi = b.keys, b.ids
    keep_a = alive[ai]
    keep_b = alive[bi]
    if not keep_a.all():
        ak, ai = ak[keep_a], ai[keep_a]
    if not keep_b.all():
        bk, bi = bk[keep_b], bi[keep_b]
    pos = ak.searchsorted(bk, side="right")
    return PostingRun(np.insert(ak, pos, bk), np.insert(ai, pos, bi))
