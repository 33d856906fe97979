"""Token index: finds donors that share token content with a query, at any offset.

Each donor is cut into content-defined chunks (:mod:`semblend_sglang.chunking`); the distinct chunk
hashes, salted with the namespace, are its postings. Postings live in a few sorted numpy runs
(merged like a log-structured tree: each run at least 4x the next one), so memory per donor is
O(number of chunks): 12 bytes per distinct chunk, a 64-byte bottom-k sketch, the record and the
engine's handle. The donor's tokens are kept (int32) only when the engine cannot give them back.

A probe weighs each donor by the query tokens in chunks it shares (a lower bound of what alignment
can reuse) and ranks by (shared tokens, sketch similarity, newest). Bounded by ``max_donors``,
least recently used first out. Thread-safe (one lock). Deterministic: decisions depend only on the
sequence of calls, never on time, randomness or Python's string hashing.
"""

from __future__ import annotations

import sys
import threading
from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass

import numpy as np

from .chunking import ChunkParams, Chunks, chunk_tokens, mix64
from .namespace import Namespace, namespace_salt

U64 = np.uint64
SKETCH_SIZE = 16
"""Bottom-k sketch size: the 16 smallest salted chunk keys, high 32 bits each (64 bytes)."""
_MERGE_RATIO = 4
MAX_POSTINGS_PER_KEY = 64
"""A probe reads at most this many postings per chunk key: the newest ones (postings of donors
forgotten since count until compaction drops them). A chunk
shared by thousands of donors (boilerplate, a popular document) then costs a bounded amount, and
the donors it does return are the most recently registered, which are also the likeliest to still
be resident."""
_ID_DTYPE = np.uint32
_MAX_ID = int(np.iinfo(_ID_DTYPE).max)


class DonorRecord:
    """One registered donor. Owned by :class:`TokenIndex`; callers must not mutate it."""

    __slots__ = ("donor_id", "handle", "n_keys", "n_tokens", "namespace", "sketch", "tokens")

    def __init__(
        self,
        donor_id: int,
        handle: Hashable,
        namespace: Namespace,
        n_tokens: int,
        n_keys: int,
        sketch: bytes,
        tokens: np.ndarray | None,
    ) -> None:
        self.donor_id = donor_id
        self.handle = handle
        self.namespace = namespace
        self.n_tokens = n_tokens
        self.n_keys = n_keys
        self.sketch = sketch
        self.tokens = tokens


@dataclass(frozen=True, slots=True)
class Candidate:
    """A donor sharing chunks with a query: ``shared_tokens`` query tokens lie in shared chunks;
    ``sketch_similarity`` estimates the Jaccard similarity of the two chunk sets."""

    donor_id: int
    handle: Hashable
    namespace: Namespace
    shared_tokens: int
    sketch_similarity: float
    tokens: np.ndarray | None


def salted_keys(chunks: Chunks, namespace: Namespace) -> np.ndarray:
    """Posting keys of ``chunks`` in ``namespace``: mix64(chunk hash XOR namespace salt).

    Returned in chunk order (not deduplicated). Keys of different namespaces never coincide
    except by a 64-bit hash collision, which the namespace check on every candidate rules out.
    """
    return mix64(chunks.hashes ^ U64(namespace_salt(namespace)))


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


class TokenIndex:
    """Bounded, thread-safe donor index keyed by namespace-salted content-defined chunks.

    The provider is its only caller. ``keep_tokens``: store an int32 copy of each donor's tokens
    (when the engine offers no way to read them back). Methods never call back into the engine.
    """

    def __init__(
        self,
        params: ChunkParams,
        max_donors: int,
        *,
        keep_tokens: bool,
        max_postings_per_key: int = MAX_POSTINGS_PER_KEY,
    ) -> None:
        if max_postings_per_key < 1:
            raise ValueError(f"max_postings_per_key must be >= 1, got {max_postings_per_key}")
        if max_donors < 1:
            raise ValueError(f"max_donors must be >= 1, got {max_donors}")
        self.params = params
        self.max_donors = max_donors
        self.keep_tokens = keep_tokens
        self.max_postings_per_key = max_postings_per_key
        self._lock = threading.RLock()
        self._records: OrderedDict[int, DonorRecord] = OrderedDict()  # LRU order, oldest first
        self._by_handle: dict[Hashable, int] = {}
        self._alive = np.zeros(1024, dtype=bool)
        self._next_id = 0
        self._runs: list[tuple[np.ndarray, np.ndarray]] = []
        self._postings = 0
        self._live_postings = 0

    # ----------------------------------------------------------------- registration
    def register(
        self, namespace: Namespace, handle: Hashable, tokens: np.ndarray
    ) -> list[Hashable]:
        """Index ``tokens`` (int64 array) as donor ``handle`` in ``namespace``; replaces an earlier
        registration of the same handle. Returns the handles evicted to stay within max_donors."""
        chunks = chunk_tokens(tokens, self.params)
        keys = np.unique(salted_keys(chunks, namespace))
        sketch = sketch_of(keys)
        copy = tokens.astype(np.int32) if self.keep_tokens else None
        with self._lock:
            old = self._by_handle.get(handle)
            if old is not None:
                self._drop(old)
            if self._next_id >= _MAX_ID:
                self._renumber()
            donor_id = self._next_id
            self._next_id += 1
            if donor_id >= self._alive.size:
                grown = np.zeros(max(2 * self._alive.size, donor_id + 1), dtype=bool)
                grown[: self._alive.size] = self._alive
                self._alive = grown
            self._alive[donor_id] = True
            self._records[donor_id] = DonorRecord(
                donor_id, handle, namespace, int(tokens.size), int(keys.size), sketch, copy
            )
            self._by_handle[handle] = donor_id
            self._add_run(keys, np.full(keys.size, donor_id, dtype=_ID_DTYPE))
            self._live_postings += int(keys.size)
            evicted: list[Hashable] = []
            while len(self._records) > self.max_donors:
                oldest = next(iter(self._records))
                evicted.append(self._records[oldest].handle)
                self._drop(oldest)
            self._maybe_compact()
            return evicted

    def forget(self, handle: Hashable) -> bool:
        """Remove donor ``handle``; False if it was not registered. Postings are dropped lazily."""
        with self._lock:
            donor_id = self._by_handle.get(handle)
            if donor_id is None:
                return False
            self._drop(donor_id)
            self._maybe_compact()
            return True

    def touch(self, handle: Hashable) -> None:
        """Mark donor ``handle`` as just used (moves it to the most recent end of the LRU)."""
        with self._lock:
            donor_id = self._by_handle.get(handle)
            if donor_id is not None:
                self._records.move_to_end(donor_id)

    def tokens_of(self, handle: Hashable) -> np.ndarray | None:
        """The kept token copy of donor ``handle`` (``keep_tokens`` indexes only), else None."""
        with self._lock:
            donor_id = self._by_handle.get(handle)
            if donor_id is None:
                return None
            return self._records[donor_id].tokens

    def __contains__(self, handle: object) -> bool:
        with self._lock:
            return handle in self._by_handle

    def __len__(self) -> int:
        with self._lock:
            return len(self._records)

    def handles(self) -> list[Hashable]:
        """Registered handles, least recently used first."""
        with self._lock:
            return [rec.handle for rec in self._records.values()]

    # ----------------------------------------------------------------- probing
    def candidates(
        self,
        namespace: Namespace,
        query: Chunks,
        *,
        limit: int,
        min_shared_tokens: int,
    ) -> list[Candidate]:
        """Up to ``limit`` donors of ``namespace`` whose chunks cover at least
        ``min_shared_tokens`` query tokens, best first: most shared tokens, then highest sketch
        similarity, then most recently registered. Never returns another namespace's donor.
        Reads at most ``max_postings_per_key`` postings per query key (the newest)."""
        if len(query) == 0:
            return []
        qkeys_all = salted_keys(query, namespace)
        qkeys, inverse = np.unique(qkeys_all, return_inverse=True)
        weights = np.bincount(inverse.ravel(), weights=query.lengths, minlength=qkeys.size)
        q_sketch = sketch_of(qkeys)
        with self._lock:
            id_parts: list[np.ndarray] = []
            w_parts: list[np.ndarray] = []
            # Runs are oldest first and a key's postings lie in registration order inside a run,
            # so walking runs newest first and each run from its end reads the newest postings.
            budget = np.full(qkeys.size, self.max_postings_per_key, dtype=np.int64)
            # [k, k + 1) bounds in one search (k + 1 wraps to 0 only for k = 2**64 - 1: clamped)
            bounds = np.concatenate([qkeys, qkeys + U64(1)])
            nq = qkeys.size
            for keys, ids in reversed(self._runs):
                found = keys.searchsorted(bounds, side="left")
                hi = np.maximum(found[nq:], found[:nq])
                lo = np.maximum(found[:nq], hi - budget)
                counts = hi - lo
                budget -= counts
                total = int(counts.sum())
                if total == 0:
                    continue
                seg_start = np.cumsum(counts) - counts
                idx = np.arange(total, dtype=np.int64) - np.repeat(seg_start - lo, counts)
                id_parts.append(ids[idx].astype(np.int64))
                w_parts.append(np.repeat(weights, counts))
            if not id_parts:
                return []
            all_ids = np.concatenate(id_parts) if len(id_parts) > 1 else id_parts[0]
            all_w = np.concatenate(w_parts) if len(w_parts) > 1 else w_parts[0]
            if self._postings != self._live_postings:
                live = self._alive[all_ids]
                all_ids, all_w = all_ids[live], all_w[live]
            # per donor: query tokens in shared chunks (compact ids: the probe read few postings)
            uniq_ids, inverse_ids = np.unique(all_ids, return_inverse=True)
            uniq_scores = np.bincount(inverse_ids.ravel(), weights=all_w, minlength=uniq_ids.size)
            keep_hit = uniq_scores >= min_shared_tokens
            hit, hit_scores = uniq_ids[keep_hit], uniq_scores[keep_hit]
            if hit.size == 0:
                return []
            scores = dict(zip(hit.tolist(), hit_scores.tolist(), strict=True))
            # shortlist: most shared tokens first, then newest id; ties at the cut are kept
            # (up to 4 x limit) so the sketch can rank them
            order = np.lexsort((-hit, -hit_scores))
            cut = min(limit, order.size) - 1
            cut_score = hit_scores[order[cut]]
            n_keep = max(limit, int(np.count_nonzero(hit_scores >= cut_score)))
            shortlist = hit[order[: min(n_keep, 4 * limit)]]
            records: list[DonorRecord] = []
            for donor_id in shortlist.tolist():
                rec = self._records.get(donor_id)
                if rec is not None and rec.namespace == namespace:
                    records.append(rec)
            sims = sketch_similarities(q_sketch, [rec.sketch for rec in records])
        ranked = sorted(
            zip(records, sims.tolist(), strict=True),
            key=lambda item: (-scores[item[0].donor_id], -item[1], -item[0].donor_id),
        )
        return [
            Candidate(
                rec.donor_id, rec.handle, rec.namespace, int(scores[rec.donor_id]), sim, rec.tokens
            )
            for rec, sim in ranked[:limit]
        ]

    # ----------------------------------------------------------------- accounting
    def nbytes(self) -> int:
        """Estimated bytes held by the index: posting runs, alive mask, records, sketches, token
        copies, and the two dicts (sys.getsizeof of the containers). Handles are the engine's."""
        with self._lock:
            total = sum(k.nbytes + i.nbytes for k, i in self._runs) + self._alive.nbytes
            total += sys.getsizeof(self._records) + sys.getsizeof(self._by_handle)
            for rec in self._records.values():
                total += sys.getsizeof(rec) + sys.getsizeof(rec.sketch)
                if rec.tokens is not None:
                    total += rec.tokens.nbytes
            return total

    def stats(self) -> dict[str, int]:
        """Counters for telemetry and the benchmark: donors, postings, runs, next id."""
        with self._lock:
            return {
                "donors": len(self._records),
                "postings": self._postings,
                "live_postings": self._live_postings,
                "runs": len(self._runs),
                "next_id": self._next_id,
            }

    # ----------------------------------------------------------------- internals (locked)
    def _drop(self, donor_id: int) -> None:
        rec = self._records.pop(donor_id)
        del self._by_handle[rec.handle]
        self._alive[donor_id] = False
        self._live_postings -= rec.n_keys

    def _merge(
        self, a: tuple[np.ndarray, np.ndarray], b: tuple[np.ndarray, np.ndarray]
    ) -> tuple[np.ndarray, np.ndarray]:
        """Merge two sorted runs (b after a for equal keys), dropping dead donors."""
        ak, ai = a
        bk, bi = b
        keep_a = self._alive[ai]
        keep_b = self._alive[bi]
        if not keep_a.all():
            ak, ai = ak[keep_a], ai[keep_a]
        if not keep_b.all():
            bk, bi = bk[keep_b], bi[keep_b]
        pos = ak.searchsorted(bk, side="right")
        return np.insert(ak, pos, bk), np.insert(ai, pos, bi)

    def _add_run(self, keys: np.ndarray, ids: np.ndarray) -> None:
        self._runs.append((keys, ids))
        self._postings += int(keys.size)
        while len(self._runs) >= 2 and self._runs[-2][0].size <= _MERGE_RATIO * max(
            self._runs[-1][0].size, 1
        ):
            b = self._runs.pop()
            a = self._runs.pop()
            before = a[0].size + b[0].size
            merged = self._merge(a, b)
            self._postings -= before - merged[0].size
            self._runs.append(merged)

    def _maybe_compact(self) -> None:
        dead = self._postings - self._live_postings
        if dead > max(self._live_postings, 4096):
            self._rebuild()
        if self._next_id > 4 * max(len(self._records), 4096):
            self._renumber()

    def _rebuild(self) -> None:
        """One sorted run holding only live postings."""
        if not self._runs:
            return
        keys = np.concatenate([k for k, _ in self._runs])
        ids = np.concatenate([i for _, i in self._runs])
        keep = self._alive[ids]
        keys, ids = keys[keep], ids[keep]
        order = np.argsort(keys, kind="stable")
        self._runs = [(keys[order], ids[order])] if keys.size else []
        self._postings = int(keys.size)

    def _renumber(self) -> None:
        """Give live donors ids 0..n-1 (in LRU order) so the alive mask stays small."""
        self._rebuild()
        remap = np.zeros(max(self._next_id, 1), dtype=np.int64)
        records: OrderedDict[int, DonorRecord] = OrderedDict()
        for new_id, (old_id, rec) in enumerate(self._records.items()):
            remap[old_id] = new_id
            rec.donor_id = new_id
            records[new_id] = rec
            self._by_handle[rec.handle] = new_id
        self._records = records
        self._runs = [(k, remap[i].astype(_ID_DTYPE)) for k, i in self._runs]
        self._next_id = len(records)
        self._alive = np.zeros(max(1024, 2 * self._next_id), dtype=bool)
        self._alive[: self._next_id] = True
