"""Content-defined chunking and k-gram hashing over token ids, vectorized with numpy.

Every hash here is a pure function of token ids (splitmix64 mixing, a fixed odd multiplier, 64-bit
wrap-around arithmetic): no Python ``hash()``, no seed, no clock, so every process and every
tensor-parallel rank computes the same values. Chunk boundaries are chosen by the content of a small
window of tokens, so the same text at another offset is cut into the same chunks (after the first
boundary). Used by :mod:`semblend_sglang.index` (donor probing) and :mod:`semblend_sglang.align`
(anchors).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

U64 = np.uint64
_MASK64 = (1 << 64) - 1
POLY_BASE = 0x9E3779B97F4A7C15 | 1
"""Odd multiplier of the polynomial k-gram hash (odd, so it is invertible modulo 2**64)."""
_POLY_BASE_INV = pow(POLY_BASE, -1, 1 << 64)

TokenArray = np.ndarray


def as_token_array(token_ids: Sequence[int] | np.ndarray) -> np.ndarray:
    """Return ``token_ids`` as a 1-D contiguous int64 array (no copy when it already is one).

    Raises ValueError for a non 1-D input or a negative id.
    """
    arr = np.ascontiguousarray(np.asarray(token_ids), dtype=np.int64)
    if arr.ndim != 1:
        raise ValueError(f"token ids must be 1-D, got shape {arr.shape}")
    if arr.size and int(arr.min()) < 0:
        raise ValueError("token ids must be non-negative")
    return arr


def mix64(values: np.ndarray) -> np.ndarray:
    """splitmix64 finalizer, elementwise on a uint64 array (returns a new array)."""
    z = values.astype(U64, copy=True)
    z ^= z >> U64(30)
    z *= U64(0xBF58476D1CE4E5B9)
    z ^= z >> U64(27)
    z *= U64(0x94D049BB133111EB)
    z ^= z >> U64(31)
    return z


def mix64_int(value: int) -> int:
    """splitmix64 finalizer of one Python int (same function as :func:`mix64`)."""
    z = value & _MASK64
    z ^= z >> 30
    z = (z * 0xBF58476D1CE4E5B9) & _MASK64
    z ^= z >> 27
    z = (z * 0x94D049BB133111EB) & _MASK64
    z ^= z >> 31
    return z


class _TokenTable:
    """Thread-safe, growing table ``mix64(id + 1)`` for token ids, so hashing is one gather."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._table = mix64(np.arange(1, 65537, dtype=U64))

    def lookup(self, tokens: np.ndarray) -> np.ndarray:
        table = self._table
        if tokens.size and int(tokens.max()) >= table.size:
            with self._lock:
                need = int(tokens.max()) + 1
                if self._table.size < need:
                    size = max(need, 2 * self._table.size)
                    self._table = mix64(np.arange(1, size + 1, dtype=U64))
                table = self._table
        return table[tokens]


_TOKEN_TABLE = _TokenTable()


def token_hashes(tokens: np.ndarray) -> np.ndarray:
    """Per-token 64-bit hashes: ``mix64(token_id + 1)`` (uint64 array of the same length).

    ``tokens`` must be a non-negative integer array (see :func:`as_token_array`).
    """
    return _TOKEN_TABLE.lookup(tokens)


class _Powers:
    """Thread-safe, growing cache of ``POLY_BASE**i`` and its inverse powers modulo 2**64."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pow = np.ones(1, dtype=U64)
        self._inv = np.ones(1, dtype=U64)

    def get(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        pw, inv = self._pow, self._inv
        if pw.size >= n:
            return pw, inv
        with self._lock:
            if self._pow.size < n:
                size = max(n, 2 * self._pow.size, 8192)
                base = np.full(size, POLY_BASE, dtype=U64)
                base[0] = 1
                base_inv = np.full(size, _POLY_BASE_INV, dtype=U64)
                base_inv[0] = 1
                self._pow = np.cumprod(base, dtype=U64)
                self._inv = np.cumprod(base_inv, dtype=U64)
            return self._pow, self._inv


_POWERS = _Powers()


def kgram_hashes(hashes: np.ndarray, k: int) -> np.ndarray:
    """Polynomial hash of every window of ``k`` consecutive token hashes.

    Element ``i`` hashes ``hashes[i:i+k]``; the result has ``len(hashes) - k + 1`` elements (empty
    when the input is shorter than ``k``). Equal windows give equal values at any offset; unequal
    windows collide with probability about 2**-64.
    """
    n = hashes.size
    if k <= 0:
        raise ValueError(f"k must be positive, got {k}")
    if n < k:
        return np.empty(0, dtype=U64)
    pw, inv = _POWERS.get(n + 1)
    # uint64 array arithmetic wraps modulo 2**64 without warnings.
    prefix = np.empty(n + 1, dtype=U64)
    prefix[0] = 0
    np.cumsum(hashes * pw[:n], dtype=U64, out=prefix[1:])
    out = (prefix[k:] - prefix[: n - k + 1]) * inv[: n - k + 1]
    return out


@dataclass(frozen=True, slots=True)
class ChunkParams:
    """Content-defined chunking parameters (all in tokens).

    A boundary follows token ``i`` when the hash of the ``window`` tokens ending at ``i`` is 0
    modulo ``avg`` (``avg`` a power of two), subject to ``min_size <= chunk length <= max_size``
    (a chunk reaching ``max_size`` is cut there).
    """

    window: int = 8
    avg: int = 64
    min_size: int = 16
    max_size: int = 256

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
    """Chunks of one token sequence: ``starts[i]:ends[i]`` has content hash ``hashes[i]``."""

    starts: np.ndarray
    ends: np.ndarray
    hashes: np.ndarray

    @property
    def lengths(self) -> np.ndarray:
        """Chunk lengths in tokens (int64)."""
        return self.ends - self.starts

    def __len__(self) -> int:
        return int(self.starts.size)


def _cut_points(candidates: np.ndarray, n: int, params: ChunkParams) -> np.ndarray:
    """Chunk end positions from boundary candidates, applying min/max chunk size."""
    ends: list[int] = []
    last = 0
    lo, hi = params.min_size, params.max_size
    for c in candidates.tolist():
        while c - last > hi:
            last += hi
            ends.append(last)
        if c - last >= lo:
            ends.append(c)
            last = c
    while n - last > hi:
        last += hi
        ends.append(last)
    if last < n:
        ends.append(n)
    return np.asarray(ends, dtype=np.int64)


def chunk_tokens(
    tokens: np.ndarray, params: ChunkParams, hashes: np.ndarray | None = None
) -> Chunks:
    """Cut ``tokens`` (int64 array from :func:`as_token_array`) into content-defined chunks.

    Boundaries and chunk hashes depend only on token content: a chunk's hash covers its own tokens
    (the sum of the hashes of the windows that lie inside it, mixed with its length), never tokens
    outside it. ``hashes``: :func:`token_hashes` of ``tokens`` when already computed. Pure
    function; safe to call from any thread.
    """
    n = int(tokens.size)
    if n == 0:
        empty = np.empty(0, dtype=np.int64)
        return Chunks(empty, empty, np.empty(0, dtype=U64))
    h = token_hashes(tokens) if hashes is None else hashes
    w = params.window
    win = kgram_hashes(h, w)  # win[i] covers tokens i .. i+w-1
    if win.size:
        # A boundary after the last token of window i (position i + w) when the top log2(avg)
        # bits of the window hash are zero (the polynomial hash of mixed tokens is uniform).
        shift = U64(64 - (params.avg.bit_length() - 1)) if params.avg > 1 else None
        if shift is None:
            cand = np.arange(win.size, dtype=np.int64) + w
        else:
            cand = np.flatnonzero((win >> shift) == 0) + w
        cand = cand[cand < n]
    else:
        cand = np.empty(0, dtype=np.int64)
    ends = _cut_points(cand, n, params)
    starts = np.empty_like(ends)
    starts[0] = 0
    starts[1:] = ends[:-1]
    lengths = ends - starts
    # Per chunk: sum of window hashes of windows fully inside it, plus sum of token hashes
    # (covers chunks shorter than the window), mixed with the length.
    csum_h = np.zeros(n + 1, dtype=U64)
    np.cumsum(h, dtype=U64, out=csum_h[1:])
    tok_sum = csum_h[ends] - csum_h[starts]
    if win.size:
        csum_w = np.zeros(win.size + 1, dtype=U64)
        np.cumsum(win, dtype=U64, out=csum_w[1:])
        # windows i with starts <= i and i + w <= ends
        w_lo = np.minimum(starts, win.size)
        w_hi = np.clip(ends - w + 1, w_lo, win.size)
        win_sum = csum_w[w_hi] - csum_w[w_lo]
    else:
        win_sum = np.zeros(ends.size, dtype=U64)
    combined = win_sum * U64(0xD6E8FEB86659FD93) + tok_sum + lengths.astype(U64)
    return Chunks(starts, ends, mix64(combined))


def _sliding_reduce(values: np.ndarray, w: int, op: np.ufunc) -> np.ndarray:
    """``op.reduce`` over every window of ``w`` consecutive values (length ``n - w + 1``)."""
    out = values
    span = 1
    while span * 2 <= w:
        out = op(out[:-span], out[span:])
        span *= 2
    if span < w:
        rest = w - span
        out = op(out[: out.size - rest], out[rest:])
    return out


def minimizer_positions(values: np.ndarray, w: int) -> np.ndarray:
    """Sorted positions holding the minimum of at least one window of ``w`` consecutive values
    (all positions when ``w == 1``).

    Two sequences sharing ``w`` consecutive values both select the position of that stretch's
    minimum, so they share a selected position inside it.
    """
    n = int(values.size)
    if w <= 1 or n == 0:
        return np.arange(n, dtype=np.int64)
    if n <= w:
        return np.flatnonzero(values == values.min())
    window_min = _sliding_reduce(values, w, np.minimum)
    padded = np.zeros(n + w - 1, dtype=values.dtype)
    padded[w - 1 : w - 1 + window_min.size] = window_min
    # position p lies in windows p-w+1 .. p; it is a window minimum iff it equals their max min
    best_min = _sliding_reduce(padded, w, np.maximum)
    return np.flatnonzero(values == best_min)
