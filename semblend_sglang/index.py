"""Token index: finds donors that share token content with a query, at any offset.

Each donor is cut into content-defined chunks (:mod:`semblend_sglang.chunking`); the distinct chunk
keys, salted with the namespace (:mod:`semblend_sglang.chunk_keys`), are its postings. Postings live
in a few sorted numpy runs (:mod:`semblend_sglang.posting_runs`), merged like a log-structured tree
(each run more than 16x the next one, so a probe searches two to four up to 100,000 donors), so
memory per donor is O(number of chunks): 12 bytes per distinct chunk, a 64-byte bottom-k sketch, the
record and the engine's handle. A large run in which keys repeat (a document many donors share) also
keeps its distinct keys, at most a quarter of its postings, and the probe searches that small,
cache-resident array instead. The donor's tokens are kept (int32) only when the engine cannot give
them back.

A probe weighs each donor by the query tokens in chunks it shares (a lower bound of what alignment
can reuse) and ranks by (shared tokens, sketch similarity, newest). It runs as a fixed number of
whole-array numpy steps per query (no Python loop over chunks or postings). Bounded by
``max_donors``, least recently used first out. Thread-safe (one lock). Deterministic: decisions
depend only on the sequence of calls, never on time, randomness or Python's string hashing.
"""

from __future__ import annotations

import sys
import threading
from collections import OrderedDict
from collections.abc import Hashable

import numpy as np

from .chunk_keys import salted_keys, sketch_of, sketch_similarities_of_keys
from .chunking import ChunkParams, Chunks, chunk_tokens
from .donor_record import Candidate, DonorRecord, donor_bytes
from .namespace import Namespace
from .posting_runs import PostingRun, merge_runs

U64 = np.uint64
_MERGE_RATIO = 16
"""A run is merged into the one before it while that one holds at most this many times its
postings."""
MAX_POSTINGS_PER_KEY = 64
"""A probe reads at most this many postings per chunk key: the newest ones (postings of donors
forgotten since count until compaction drops them). A chunk
shared by thousands of donors (boilerplate, a popular document) then costs a bounded amount, and
the donors it does return are the most recently registered, which are also the likeliest to still
be resident."""
_ONE = U64(1)
_ID_DTYPE = np.uint32
_MAX_ID = int(np.iinfo(_ID_DTYPE).max)


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
        max_bytes: int | None = None,
    ) -> None:
        if max_postings_per_key < 1:
            raise ValueError(f"max_postings_per_key must be >= 1, got {max_postings_per_key}")
        if max_donors < 1:
            raise ValueError(f"max_donors must be >= 1, got {max_donors}")
        self.params = params
        self.max_donors = max_donors
        self.keep_tokens = keep_tokens
        self.max_postings_per_key = max_postings_per_key
        self.max_bytes = max_bytes
        self._live_bytes = 0
        self._lock = threading.RLock()
        self._records: OrderedDict[int, DonorRecord] = OrderedDict()  # LRU order, oldest first
        self._by_handle: dict[Hashable, int] = {}
        self._alive = np.zeros(1024, dtype=bool)
        # probe scratch, one slot per donor id (see `candidates`); written under the lock only
        self._scratch = np.zeros(1024, dtype=np.int32)
        self._next_id = 0
        self._runs: list[PostingRun] = []
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
                self._scratch = np.zeros(grown.size, dtype=np.int32)
            self._alive[donor_id] = True
            self._records[donor_id] = DonorRecord(
                donor_id, handle, namespace, int(tokens.size), int(keys.size), sketch, copy
            )
            self._by_handle[handle] = donor_id
            self._add_run(keys, np.full(keys.size, donor_id, dtype=_ID_DTYPE))
            self._live_postings += int(keys.size)
            self._live_bytes += donor_bytes(int(keys.size), copy)
            evicted: list[Hashable] = []
            while len(self._records) > self.max_donors or (
                self.max_bytes is not None
                and self._live_bytes > self.max_bytes
                and len(self._records) > 1
            ):
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
        # A key occurring twice in the query is probed twice: each occurrence adds its own tokens
        # to the donors it reads, the same sums as merging the two first. Hot path: ndarray
        # methods and ufuncs only (numpy's Python-level helpers cost several times more here).
        qkeys = salted_keys(query, namespace)
        nq = qkeys.size
        bounds = np.concatenate((qkeys, qkeys + _ONE))  # [k, k + 1): keys are 63-bit
        cap = self.max_postings_per_key
        with self._lock:
            runs = self._runs[::-1]  # newest first
            if not runs:
                return []
            # Per run and key: the postings [lo, hi) of the key. Runs are oldest first and a
            # key's postings lie in registration order inside a run, so the newest postings of a
            # key are the last ones of the newest runs: take them until the per-key budget.
            found = np.empty((2, len(runs), nq), dtype=np.int64)  # [lo, hi] x run x key
            for r, run in enumerate(runs):
                run.find(qkeys, bounds, found[:, r])
            hi = found[1]
            take = hi - found[0]
            np.minimum(take[0], cap, out=take[0])
            if len(runs) == 2:
                left = cap - take[0]  # budget left for the older run
                np.minimum(take[1], left, out=take[1])
            elif len(runs) > 2:
                left = take.cumsum(axis=0)
                left -= take
                np.subtract(cap, left, out=left)  # budget left before each run
                np.maximum(left, 0, out=left)
                np.minimum(left, take, out=take)
            counts = take.ravel()
            seg_end = counts.cumsum()
            total = int(seg_end[-1])
            if total == 0:
                return []
            # posting x of segment (run, key) is at hi - take + (x - segment start)
            idx = (hi.reshape(-1) - seg_end).repeat(counts)
            idx += np.arange(total, dtype=np.int64)
            run_end = seg_end[nq - 1 :: nq].tolist()
            all_ids = np.empty(total, dtype=np.intp)
            at = 0
            for run, end in zip(runs, run_end, strict=True):
                if end > at:
                    all_ids[at:end] = run.ids[idx[at:end]]
                at = end
            lengths = np.subtract(query.ends, query.starts, dtype=np.float64)  # bincount weights
            all_w = np.concatenate((lengths,) * len(runs)).repeat(counts)
            if self._postings != self._live_postings:
                live = self._alive[all_ids]
                all_ids, all_w = all_ids[live], all_w[live]
                if all_ids.size == 0:
                    return []
            # per donor: query tokens in shared chunks
            if self._next_id <= 4 * all_ids.size:  # few ids in all: one bin per id
                sums = np.bincount(all_ids, weights=all_w)
                hit = (sums >= min_shared_tokens).nonzero()[0]
                hit_scores = sums[hit]
            else:
                # Group equal ids without sorting: every occurrence of an id reads back the
                # same slot (whichever write won), and that slot is one of the id's own
                # positions, so bins are per donor.
                slot = self._scratch
                slot[all_ids] = np.arange(all_ids.size, dtype=np.int32)
                sums = np.bincount(slot[all_ids], weights=all_w, minlength=all_ids.size)
                rep = (sums >= min_shared_tokens).nonzero()[0]
                hit = all_ids[rep]
                hit_scores = sums[rep]
            if hit.size == 0:
                return []
            # shortlist: most shared tokens first, then newest id; ties at the cut are kept
            # (up to 4 x limit) so the sketch can rank them
            top = np.lexsort((hit, hit_scores))[: -4 * limit - 1 : -1]
            top_scores = hit_scores[top].tolist()
            cut_score = top_scores[min(limit, len(top_scores)) - 1]
            n_keep = max(limit, sum(1 for x in top_scores if x >= cut_score))
            records: list[DonorRecord] = []
            scores: list[float] = []
            for donor_id, score in zip(hit[top[:n_keep]].tolist(), top_scores, strict=False):
                rec = self._records.get(donor_id)
                if rec is not None and rec.namespace == namespace:
                    records.append(rec)
                    scores.append(score)
        if not records:
            return []
        sims = sketch_similarities_of_keys(qkeys, [rec.sketch for rec in records])
        ranked = sorted(
            zip(records, scores, sims, strict=True),
            key=lambda item: (-item[1], -item[2], -item[0].donor_id),
        )
        return [
            Candidate(rec.donor_id, rec.handle, rec.namespace, int(score), sim, rec.tokens)
            for rec, score, sim in ranked[:limit]
        ]

    # ----------------------------------------------------------------- accounting
    def nbytes(self) -> int:
        """Estimated bytes held by the index: posting runs, alive mask, records, sketches, token
        copies, and the two dicts (sys.getsizeof of the containers). Handles are the engine's."""
        with self._lock:
            total = sum(run.nbytes for run in self._runs)
            total += self._alive.nbytes + self._scratch.nbytes
            total += sys.getsizeof(self._records) + sys.getsizeof(self._by_handle)
            for rec in self._records.values():
                total += sys.getsizeof(rec) + sys.getsizeof(rec.sketch)
                if rec.tokens is not None:
                    total += rec.tokens.nbytes
            return total

    @property
    def live_bytes(self) -> int:
        """Bytes the live donors cost (:func:`donor_bytes`), what ``max_bytes`` bounds."""
        return self._live_bytes

    def stats(self) -> dict[str, int]:
        """Counters for telemetry and the benchmark: donors, postings, runs, next id, and the
        bytes the index accounts against ``max_bytes`` (live postings, records, token copies)."""
        with self._lock:
            return {
                "donors": len(self._records),
                "postings": self._postings,
                "live_postings": self._live_postings,
                "bytes": self._live_bytes,
                "runs": len(self._runs),
                "next_id": self._next_id,
            }

    # ----------------------------------------------------------------- internals (locked)
    def _drop(self, donor_id: int) -> None:
        rec = self._records.pop(donor_id)
        del self._by_handle[rec.handle]
        self._alive[donor_id] = False
        self._live_postings -= rec.n_keys
        self._live_bytes -= donor_bytes(rec.n_keys, rec.tokens)

    def _add_run(self, keys: np.ndarray, ids: np.ndarray) -> None:
        self._runs.append(PostingRun(keys, ids))
        self._postings += int(keys.size)
        while len(self._runs) >= 2 and self._runs[-2].keys.size <= _MERGE_RATIO * max(
            self._runs[-1].keys.size, 1
        ):
            b = self._runs.pop()
            a = self._runs.pop()
            before = a.keys.size + b.keys.size
            merged = merge_runs(a, b, self._alive)
            self._postings -= before - merged.keys.size
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
        keys = np.concatenate([run.keys for run in self._runs])
        ids = np.concatenate([run.ids for run in self._runs])
        keep = self._alive[ids]
        keys, ids = keys[keep], ids[keep]
        order = np.argsort(keys, kind="stable")
        self._runs = [PostingRun(keys[order], ids[order])] if keys.size else []
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
        self._runs = [PostingRun(run.keys, remap[run.ids].astype(_ID_DTYPE)) for run in self._runs]
        self._next_id = len(records)
        self._alive = np.zeros(max(1024, 2 * self._next_id), dtype=bool)
        self._alive[: self._next_id] = True
        self._scratch = np.zeros(self._alive.size, dtype=np.int32)
