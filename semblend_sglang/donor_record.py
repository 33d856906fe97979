"""What the token index keeps per donor and what its probe returns (:mod:`.index`).

:class:`DonorRecord` is owned by :class:`~.index.TokenIndex`; :class:`Candidate` is what
:meth:`~.index.TokenIndex.candidates` hands the provider. :func:`donor_bytes` is the memory a
live donor costs the index (``max_index_bytes``).
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

import numpy as np

from .namespace import Namespace

POSTING_BYTES = 12
"""Bytes of one posting in a run: an 8-byte chunk key and a 4-byte donor id."""

RECORD_BYTES = 320
"""Bytes of one donor's record, sketch and dict entries (measured with sys.getsizeof)."""


def donor_bytes(n_keys: int, tokens: np.ndarray | None) -> int:
    """What one donor costs the index while it is live: its postings, its record and sketch, and
    its token copy when the index keeps one. Dead postings wait for compaction, which keeps them
    fewer than the live ones."""
    return n_keys * POSTING_BYTES + RECORD_BYTES + (0 if tokens is None else int(tokens.nbytes))


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
