"""Passage order, opt-in per request: a RAG prompt's passages put in the order SGLang's exact
prefix cache serves furthest, the rest left in the request's order.

A request declares its reorderable passages in ``custom_params`` (``sampling_params`` of
``/generate``, ``extra_body`` of the OpenAI-compatible API)::

    {"semblend_passages": [[12, 310], [310, 598], [598, 901]]}

Each pair is one passage's ``[start, end)`` token positions in the prompt; passages are adjacent
(each starts where the one before ends), at least :data:`MIN_PASSAGES` and at most
:data:`MAX_PASSAGES`, and a passage carries whatever separates it from the next (its label, a
blank line). The tokens before the first passage (the instruction) and after the last (the
question) stay where they are. Without the key nothing is reordered.

:func:`choose_order` is the choice: the longest run of passages (in tokens) that the exact cache
holds right after the request's own head, in the order the cache holds them (a resident
request's order), then the others in the request's order, except that passages which follow
each other in one donor are put together in that donor's order (:func:`donor_runs`: one aligned
span for semantic reuse instead of several). It asks only the cache how much of a prompt it
holds and the provider where donors hold each passage, both deterministic, so every rank whose
cache and donors are the same chooses the same order. Pure:
the scheduler's arrival hook (:mod:`semblend_sglang.patches.sglang.flow.passage_order`) calls it,
the request guard calls :func:`passages_error`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .locate import SpanSource

PASSAGES_PARAM = "semblend_passages"
"""The ``custom_params`` key a request declares its passages with (module docstring)."""
ORDER_INFO_KEY = "semblend_passage_order"
"""The ``meta_info`` key of the order the model saw: for each place, the index of the declared
passage put there (``[0, 1, ...]``: the request's own order)."""
MIN_PASSAGES = 2
MAX_PASSAGES = 64
MAX_CACHE_PROBES = 512
"""How many cache lookups one request's order search may take (its depth-first search stops
there and keeps the best run found)."""

CachedLen = Callable[[Sequence[int]], int]
"""``cached_len(tokens)``: how many leading tokens of ``tokens`` the exact cache holds."""


class PassageError(ValueError):
    """A malformed :data:`PASSAGES_PARAM` declaration; the message names the key and why."""


@dataclass(frozen=True, slots=True)
class PassageLayout:
    """A prompt's declared passages: ``bounds`` ``((start, end), ...)``, adjacent, in prompt
    order. The head is ``[0, head_end)``, the tail ``[tail_start, len(prompt))``."""

    bounds: tuple[tuple[int, int], ...]

    @property
    def head_end(self) -> int:
        """Where the first passage starts."""
        return self.bounds[0][0]

    @property
    def tail_start(self) -> int:
        """Where the last passage ends."""
        return self.bounds[-1][1]

    def passage(self, tokens: Sequence[int], i: int) -> list[int]:
        """Passage ``i``'s tokens in ``tokens``."""
        start, end = self.bounds[i]
        return [int(t) for t in tokens[start:end]]


def _error(why: str) -> PassageError:
    return PassageError(f"custom_params.{PASSAGES_PARAM}: {why}")


def parse_passages(value: Any, prompt_len: int) -> PassageLayout:
    """The :class:`PassageLayout` ``value`` declares for a prompt of ``prompt_len`` tokens;
    :class:`PassageError` saying why when it is not a list of :data:`MIN_PASSAGES` to
    :data:`MAX_PASSAGES` adjacent ``[start, end]`` integer pairs with ``start < end`` inside the
    prompt."""
    if not isinstance(value, list) or not MIN_PASSAGES <= len(value) <= MAX_PASSAGES:
        raise _error(
            f"expected a list of {MIN_PASSAGES} to {MAX_PASSAGES} [start, end] pairs, "
            f"got {str(value)[:80]}"
        )
    bounds: list[tuple[int, int]] = []
    for k, pair in enumerate(value):
        ok = isinstance(pair, list | tuple) and len(pair) == 2
        if not ok or not all(isinstance(x, int) and not isinstance(x, bool) for x in pair):
            raise _error(f"passage {k} is {str(pair)[:40]}, not a [start, end] pair of integers")
        start, end = int(pair[0]), int(pair[1])
        if not 0 <= start < end <= prompt_len:
            raise _error(
                f"passage {k} [{start}, {end}) is empty or outside the prompt's {prompt_len} tokens"
            )
        if bounds and start != bounds[-1][1]:
            raise _error(
                f"passage {k} starts at {start}, not where passage {k - 1} ends "
                f"({bounds[-1][1]}): passages are adjacent, in prompt order"
            )
        bounds.append((start, end))
    return PassageLayout(tuple(bounds))


def passages_error(custom_params: Any, prompt_len: int) -> str | None:
    """Why ``custom_params`` carries a malformed :data:`PASSAGES_PARAM` for a prompt of
    ``prompt_len`` tokens; None when the key is absent or well formed. The request guard
    answers a malformed one with 400."""
    if not isinstance(custom_params, dict) or PASSAGES_PARAM not in custom_params:
        return None
    try:
        parse_passages(custom_params[PASSAGES_PARAM], prompt_len)
    except PassageError as exc:
        return str(exc)
    return None


@dataclass(frozen=True, slots=True)
class PassageOrder:
    """:func:`choose_order`'s answer: ``order`` (for each place, the index of the declared
    passage put there), of which the first ``held`` passages, ``held_tokens`` tokens, are the
    run the exact cache holds; ``joins``: places after the run where a passage follows the
    one before it as it does in a donor (:func:`donor_runs`)."""

    order: tuple[int, ...]
    held: int
    held_tokens: int
    joins: int = 0

    @property
    def changed(self) -> bool:
        """Whether ``order`` is not the request's own."""
        return self.order != tuple(range(len(self.order)))


def donor_runs(
    rest: Sequence[int], lengths: Sequence[int], sources: Sequence[SpanSource | None]
) -> tuple[tuple[int, ...], int]:
    """``rest`` (passage indices, the request's order) with every chain of passages that follow
    each other in one donor put together, in that donor's order, where the chain's first
    passage stands; the others keep their places. Passage ``b`` follows ``a`` when
    ``sources`` (indexed by passage, :class:`~.locate.SpanSource`) puts both in one donor with
    ``b`` starting where ``a`` (``lengths[a]`` tokens) ends: there the donor's KV of ``b`` was
    computed after ``a``, and the two are one aligned span instead of two. Returns the order and
    its number of such joins. Pure; :func:`choose_order` calls it."""
    starts = {(src.donor, src.start): i for i in rest if (src := sources[i]) is not None}
    after: dict[int, int] = {}
    has_before: set[int] = set()
    for a in rest:
        src = sources[a]
        if src is None:
            continue
        b = starts.get((src.donor, src.start + lengths[a]))
        if b is not None and b != a and b not in has_before:
            after[a] = b
            has_before.add(b)
    order: list[int] = []
    for i in rest:
        if i in has_before:
            continue  # placed with the passage it follows
        order.append(i)
        while i in after:
            i = after[i]
            order.append(i)
    return tuple(order), len(after)


def choose_order(
    tokens: Sequence[int],
    layout: PassageLayout,
    cached_len: CachedLen,
    page_size: int = 1,
    sources: Callable[[], Sequence[SpanSource | None]] | None = None,
) -> PassageOrder:
    """The order to serve ``tokens``' passages in (:class:`PassageOrder`): the longest run (in
    tokens) of passages that ``cached_len`` holds after the head ``tokens[:layout.head_end]``, as a
    depth-first search trying the remaining passages in the request's order (ties: the first found),
    then every other passage in the request's order, put in donor runs (:func:`donor_runs`) when
    ``sources`` is given (called once, when two or more passages remain: where donors hold each
    declared passage of ``tokens`` as sent). A passage counts as held when the cache holds
    the prompt so far through it, up to its last partial page (``page_size``: the tree matches whole
    pages). At most :data:`MAX_CACHE_PROBES` lookups. The request's own order when nothing after the
    head is held and no two remaining passages join."""
    head = [int(t) for t in tokens[: layout.head_end]]
    passages = [layout.passage(tokens, i) for i in range(len(layout.bounds))]
    best: tuple[int, ...] = ()
    best_len = 0
    probes = 0

    def held(prompt: list[int]) -> bool:
        nonlocal probes
        probes += 1
        return cached_len(prompt) >= len(prompt) - len(prompt) % max(1, page_size)

    def search(prompt: list[int], run: tuple[int, ...], run_len: int) -> None:
        nonlocal best, best_len
        if run_len > best_len:
            best, best_len = run, run_len
        for i, passage in enumerate(passages):
            if i in run or probes >= MAX_CACHE_PROBES:
                continue
            longer = prompt + passage
            if held(longer):
                search(longer, (*run, i), run_len + len(passage))

    search(head, (), 0)
    rest = tuple(i for i in range(len(passages)) if i not in best)
    joins = 0
    if sources is not None and len(rest) >= 2:
        rest, joins = donor_runs(rest, [len(p) for p in passages], sources())
    return PassageOrder((*best, *rest), len(best), best_len, joins)


def reordered_prompt(
    tokens: Sequence[int], layout: PassageLayout, order: Sequence[int]
) -> list[int]:
    """``tokens`` with its passages in ``order`` (a permutation of their indices), head and
    tail in place; the same length."""
    if sorted(order) != list(range(len(layout.bounds))):
        raise ValueError(f"order {list(order)} is not a permutation of {len(layout.bounds)}")
    out = [int(t) for t in tokens[: layout.head_end]]
    for i in order:
        out += layout.passage(tokens, i)
    out += [int(t) for t in tokens[layout.tail_start :]]
    return out
