"""Content-defined chunking and k-gram hashing over token ids, vectorized with numpy.

Every hash here is a pure function of token ids (fixed odd multipliers, polynomial hashing with
64-bit wrap-around arithmetic): no Python ``hash()``, no seed, no clock, so every process and every
tensor-parallel rank computes the same values. Chunk boundaries are chosen by the content of a small
window of tokens, so the same text at another offset is cut into the same chunks (after the first
boundary). Used by :mod:`semblend_sglang.index` (donor probing), :mod:`semblend_sglang.anchors`
and :mod:`semblend_sglang.align` (alignment anchors). A lookup runs these on every request, so they
are a handful of whole-array passes written with ndarray methods and ufuncs: numpy's Python-level
helpers (``np.diff``, ``np.flatnonzero``, ``np.unique``, ...) cost several times more per call on
arrays this small.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

U64 = np.uint64
POLY_BASE = 0x9E3779B97F4A7C15 | 1
"""Odd multiplier of the polynomial k-gram hash (odd, so it is invertible modulo 2**64)."""
_POLY_BASE_INV = pow(POLY_BASE, -1, 1 << 64)
_TOKEN_MUL = U64(0xFF51AFD7ED558CCD)

TokenArray = np.ndarray


def as_token_array(token_ids: Sequence[int] | np.ndarray) -> np.ndarray:
    """Return ``token_ids`` as a 1-D contiguous int64 array (no copy when it already is one).

    Raises ValueError for a non 1-D input or a negative id.
    """
    if (
        type(token_ids) is np.ndarray
        and token_ids.dtype == np.int64
        and token_ids.flags.c_contiguous
    ):
        arr = token_ids
    else:
        arr = np.ascontiguousarray(np.asarray(token_ids), dtype=np.int64)
    if arr.ndim != 1:
        raise ValueError(f"token ids must be 1-D, got shape {arr.shape}")
    if arr.size and int(arr.min()) < 0:
        raise ValueError("token ids must be non-negative")
    return arr


def token_hashes(tokens: np.ndarray) -> np.ndarray:
    """Per-token 64-bit hashes (uint64 array of the same length): ``id * M`` modulo 2**64, with
    ``M`` a fixed odd constant (murmur3's), a bijection of 64-bit ids.

    The polynomial hashes built on these (:func:`poly_prefix`) are what every comparison uses;
    they are uniform enough in their high bits to cut chunks and fill hash tables, and each
    equality they suggest is confirmed on the tokens themselves before anything relies on it,
    so no mixing beyond one multiply is needed (and the multiply folds into the powers, see
    :func:`token_prefix`). ``tokens`` must be a non-negative integer array (see
    :func:`as_token_array`).
    """
    return np.asarray(tokens, dtype=np.int64).view(U64) * _TOKEN_MUL


class _Powers:
    """Thread-safe, growing cache of ``POLY_BASE**i``, its inverse powers, and ``M * POLY_BASE**i``
    (``M`` the multiplier of :func:`token_hashes`) modulo 2**64."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # one tuple, replaced whole, so a reader never pairs a new table with an old one
        one = np.ones(1, dtype=U64)
        self._arrays = (one, one, one * _TOKEN_MUL)

    def get(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        """(powers, inverse powers), each with at least ``n`` elements."""
        arrays = self.get3(n)
        return arrays[0], arrays[1]

    def get3(self, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(powers, inverse powers, ``M`` x powers), each with at least ``n`` elements."""
        arrays = self._arrays
        if arrays[0].size >= n:
            return arrays
        with self._lock:
            if self._arrays[0].size < n:
                size = max(n, 2 * self._arrays[0].size, 8192)
                base = np.full(size, POLY_BASE, dtype=U64)
                base[0] = 1
                base_inv = np.full(size, _POLY_BASE_INV, dtype=U64)
                base_inv[0] = 1
                pw = np.cumprod(base, dtype=U64)
                self._arrays = (pw, np.cumprod(base_inv, dtype=U64), pw * _TOKEN_MUL)
            return self._arrays


_POWERS = _Powers()


def poly_prefix(hashes: np.ndarray) -> np.ndarray:
    """Prefix sums of the polynomial hash: ``out[i] = sum(hashes[t] * POLY_BASE**t, t < i)``
    (uint64, wrapping modulo 2**64; ``len(hashes) + 1`` elements).

    One pass serves every window length: :func:`window_hashes` reads any window off it. Callers
    that hash the same tokens for chunking and for alignment anchors compute it once.
    """
    n = hashes.size
    pw, _ = _POWERS.get(n + 1)
    prefix = np.empty(n + 1, dtype=U64)
    prefix[0] = 0
    # uint64 array arithmetic wraps modulo 2**64 without warnings.
    (hashes * pw[:n]).cumsum(out=prefix[1:])
    return prefix


def token_prefix(tokens: np.ndarray) -> np.ndarray:
    """``poly_prefix(token_hashes(tokens))`` in one multiply and one running sum: the token
    hash's multiplier is folded into the powers."""
    n = int(tokens.size)
    _, _, pw_m = _POWERS.get3(n + 1)
    prefix = np.empty(n + 1, dtype=U64)
    prefix[0] = 0
    np.multiply(np.asarray(tokens, dtype=np.int64).view(U64), pw_m[:n], out=prefix[1:])
    prefix[1:].cumsum(out=prefix[1:])
    return prefix


def window_hashes(prefix: np.ndarray, starts: np.ndarray, lengths: int | np.ndarray) -> np.ndarray:
    """Polynomial hashes of the windows ``[starts[i], starts[i] + lengths[i])`` of the sequence
    behind ``prefix`` (:func:`poly_prefix`): ``sum(hashes[s + t] * POLY_BASE**t, t < length)``,
    the same value for the same tokens at any offset. ``lengths``: one int for all, or per window.
    """
    _, inv = _POWERS.get(prefix.size)
    return (prefix[starts + lengths] - prefix[starts]) * inv[starts]


def strided_window_hashes(prefix: np.ndarray, k: int, stride: int) -> np.ndarray:
    """:func:`window_hashes` of the windows of ``k`` tokens starting at ``0, stride, 2 * stride,
    ...`` that fit in the sequence behind ``prefix`` (two whole-array passes over strided views)."""
    n = prefix.size - 1
    if n < k:
        return np.empty(0, dtype=U64)
    last = (n - k) // stride * stride
    _, inv = _POWERS.get(prefix.size)
    return (prefix[k : last + k + 1 : stride] - prefix[: last + 1 : stride]) * inv[
        : last + 1 : stride
    ]


def kgram_hashes(hashes: np.ndarray | None, k: int, prefix: np.ndarray | None = None) -> np.ndarray:
    """Polynomial hash of every window of ``k`` consecutive token hashes.

    Element ``i`` hashes ``hashes[i:i+k]``; the result has ``len(hashes) - k + 1`` elements (empty
    when the input is shorter than ``k``). Equal windows give equal values at any offset; unequal
    windows collide with probability about 2**-64. ``prefix``: :func:`poly_prefix` of ``hashes``
    (or :func:`token_prefix` of the tokens) when already computed; ``hashes`` may then be None.
    """
    if k <= 0:
        raise ValueError(f"k must be positive, got {k}")
    if prefix is None:
        if hashes is None:
            raise ValueError("kgram_hashes needs hashes or prefix")
        prefix = poly_prefix(hashes)
    n = prefix.size - 1
    if n < k:
        return np.empty(0, dtype=U64)
    _, inv = _POWERS.get(n + 1)
    out = prefix[k:] - prefix[: n - k + 1]
    out *= inv[: n - k + 1]
    return out


@dataclass(frozen=True, slots=True)
class ChunkParams:
    """Content-defined chunking parameters (all in tokens).

    A boundary candidate follows token ``i`` when the hash of the ``window`` tokens ending at ``i``
    has its top ``log2(avg)`` bits zero (``avg`` a power of two); candidates closer than
    ``min_size`` to the previous candidate are skipped, and no chunk is longer than ``max_size``
    (see :func:`_cut_points`).
    """

    window: int = 8
    avg: int = 64
    min_size: int = 16
    max_size: int = 256

    @classmethod
    def for_avg(cls, avg: int) -> ChunkParams:
        """The chunking the donor index and the dispatcher use at average chunk length ``avg`` (a
        power of two): window 8, chunks of ``max(8, avg // 4)`` to ``4 * avg`` tokens."""
        return cls(window=8, avg=avg, min_size=max(8, avg // 4), max_size=avg * 4)

    def __post_init__(self) -> None:
        if self.window < 1:
            raise ValueError(f"window must be >= 1, got {self.window}")
        if self.avg < 1 or self.avg & (self.avg - 1):
            raise ValueError(f"avg must be a power of two, got {self.avg}")
        if not self.window <= self.min_size <= self.max_size:
            raise ValueError(
                f"need window <= min_size <= max_size, got {self.window}, {self.min_size}, "
                f"{self.max_size}"
            )


@dataclass(frozen=True, slots=True)
class Chunks:
    """Chunks of one token sequence: ``starts[i]:ends[i]`` has content hash ``hashes[i]``
    (uint64; equal content gives equal hashes at any offset)."""

    starts: np.ndarray
    ends: np.ndarray
    hashes: np.ndarray

    @property
    def lengths(self) -> np.ndarray:
        """Chunk lengths in tokens (int64)."""
        return self.ends - self.starts

    def __len__(self) -> int:
        return int(self.starts.size)


def _boundaries(
    candidates: np.ndarray, n: int, params: ChunkParams
) -> tuple[np.ndarray, np.ndarray]:
    """Chunk boundaries ``[0, e_1, ..., n]`` and chunk lengths from sorted boundary candidates in
    ``[1, n)``.

    A candidate is a boundary when the previous candidate (or the sequence start) lies at least
    ``min_size`` tokens before it, a rule local to the content around it. A gap longer than
    ``max_size`` between boundaries is cut every ``max_size`` tokens from its start (the piece
    before the next boundary may then be shorter than ``min_size``). Vectorized (ndarray methods
    and ufuncs only: numpy's Python-level helpers cost several times more on small arrays).
    """
    bounds = np.empty(candidates.size + 2, dtype=np.int64)
    bounds[0] = 0
    bounds[1:-1] = candidates
    bounds[-1] = n
    if candidates.size:
        # keep candidate i when candidate i-1 (bounds[i]) lies min_size or more before it
        keep = np.empty(bounds.size, dtype=bool)
        np.greater_equal(bounds[1:-1] - bounds[:-2], params.min_size, out=keep[1:-1])
        keep[0] = keep[-1] = True
        bounds = bounds[keep]
    lengths = bounds[1:] - bounds[:-1]
    if lengths.max() <= params.max_size:
        return bounds, lengths
    forced = (lengths - 1) // params.max_size
    total = int(forced.sum())
    seg = forced.cumsum() - forced
    step = np.arange(1, total + 1, dtype=np.int64) - seg.repeat(forced)
    cuts = bounds[:-1].repeat(forced) + step * params.max_size
    bounds = np.concatenate((bounds, cuts))
    bounds.sort()
    return bounds, bounds[1:] - bounds[:-1]


def chunk_tokens(
    tokens: np.ndarray,
    params: ChunkParams,
    hashes: np.ndarray | None = None,
    prefix: np.ndarray | None = None,
) -> Chunks:
    """Cut ``tokens`` (int64 array from :func:`as_token_array`) into content-defined chunks.

    Boundaries and chunk hashes depend only on token content: a chunk's hash is the polynomial
    hash of its own tokens (:func:`window_hashes`) XOR its length, never of tokens outside it (not
    finalized: the index mixes it with the namespace salt). ``hashes``: :func:`token_hashes` of
    ``tokens``, ``prefix``: :func:`poly_prefix` of those, when already computed. Pure function;
    safe to call from any thread.
    """
    n = int(tokens.size)
    if n == 0:
        empty = np.empty(0, dtype=np.int64)
        return Chunks(empty, empty, np.empty(0, dtype=U64))
    if prefix is None:
        prefix = token_prefix(tokens) if hashes is None else poly_prefix(hashes)
    w = params.window
    _, inv = _POWERS.get(n + 1)
    if n <= w:
        cand = np.empty(0, dtype=np.int64)
    elif params.avg > 1:
        # A candidate after the last token of window i (position i + w) when the top log2(avg)
        # bits of the window hash are zero (the polynomial hash of mixed tokens is uniform);
        # window i = n - w would put one at n, which is the end anyway.
        below = U64(1 << (64 - (params.avg.bit_length() - 1)))
        win = prefix[w:n] - prefix[: n - w]
        win *= inv[: n - w]
        cand = (win < below).nonzero()[0]
        cand += w
    else:
        cand = np.arange(w, n, dtype=np.int64)
    bounds, lengths = _boundaries(cand, n, params)
    starts = bounds[:-1]
    # window hash of [s, e): (prefix[e] - prefix[s]) * inv[s], then XOR the length
    at = prefix[bounds]
    content = at[1:] - at[:-1]
    content *= inv[starts]
    content ^= lengths.view(U64)
    return Chunks(starts, bounds[1:], content)
