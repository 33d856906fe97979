"""Namespace-salted chunk keys, and bottom-k sketches of a set of them.

A token sequence's content-defined chunks (:mod:`semblend_sglang.chunking`) become 63-bit keys
salted with the request's namespace (:func:`salted_keys`): the donor index posts them and the
data-parallel dispatcher remembers them, so neither can match across namespaces. A sketch
(:func:`sketch_of`, the high halves of the :data:`SKETCH_SIZE` smallest keys) estimates how much
two chunk sets overlap (:func:`sketch_similarity`): the index ranks tied candidates by it and
substitute mode's ``jaccard`` embedder uses it. Pure functions, deterministic.
"""

from __future__ import annotations

import numpy as np

from .chunking import Chunks
from .namespace import Namespace, namespace_salt

U64 = np.uint64
SKETCH_SIZE = 16
"""Bottom-k sketch size: the 16 smallest salted chunk keys, high 32 bits each (64 bytes)."""
_KEY_MUL = U64(0x94D049BB133111EB)
_ONE = U64(1)


def salted_keys(chunks: Chunks, namespace: Namespace) -> np.ndarray:
    """Posting keys of ``chunks`` in ``namespace``: ``((chunk hash XOR namespace salt) * M) >> 1``
    (``M`` a fixed odd constant): 63-bit, so ``key + 1`` never wraps.

    Returned in chunk order (not deduplicated). Keys of different namespaces never coincide
    except by a hash collision, which the namespace check on every candidate rules out.
    """
    keys = chunks.hashes ^ U64(namespace_salt(namespace))
    keys *= _KEY_MUL
    keys >>= _ONE
    return keys


def sketch_of(sorted_unique_keys: np.ndarray) -> bytes:
    """Bottom-k sketch (high 32 bits of the :data:`SKETCH_SIZE` smallest keys) as bytes."""
    return (sorted_unique_keys[:SKETCH_SIZE] >> U64(32)).astype(np.uint32).tobytes()


def sketch_similarity(a: bytes, b: bytes) -> float:
    """Resemblance of two bottom-k sketches, |A & B| / |A | B| (an estimate of the Jaccard
    similarity of the chunk sets behind them; 0.0 when either is empty)."""
    return float(sketch_similarities(a, [b])[0])


def sketch_similarities(query: bytes, others: list[bytes]) -> np.ndarray:
    """:func:`sketch_similarity` of ``query`` with each of ``others`` (float64 array)."""
    q = set(np.frombuffer(query, dtype=np.uint32).tolist())
    out = np.zeros(len(others), dtype=np.float64)
    if not q:
        return out
    for i, other in enumerate(others):
        o = set(np.frombuffer(other, dtype=np.uint32).tolist())
        if o:
            inter = len(q & o)
            out[i] = inter / (len(q) + len(o) - inter)
    return out


def sketch_similarities_of_keys(keys: np.ndarray, others: list[bytes]) -> list[float]:
    """:func:`sketch_similarity` of the sketch of ``keys`` (any order, duplicates allowed) with
    each of ``others``; the same values as ``sketch_similarities(sketch_of(np.unique(keys)),
    others)`` for a handful of sketches, in a few Python set operations."""
    smallest = keys.copy()
    smallest.sort()
    q: set[int] = set()
    prev = None
    distinct = 0
    for key in smallest.tolist():
        if key != prev:
            q.add(key >> 32)
            prev = key
            distinct += 1
            if distinct == SKETCH_SIZE:
                break
    flat = np.frombuffer(b"".join(others), dtype=np.uint32).tolist()
    out = []
    at = 0
    for other in others:
        end = at + len(other) // 4
        o = set(flat[at:end])
        at = end
        inter = len(q & o)
        out.append(inter / (len(q) + len(o) - inter) if q and o else 0.0)
    return out
