"""The passage-order declaration and choice (semblend_sglang.passages), pure: the cache is the
``cached_len`` contract, answered here from the prompts it holds (their longest common prefix
with the asked prompt, as SGLang's radix tree answers at page size 1, or whole pages)."""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence

import pytest

from semblend_sglang.locate import SpanSource
from semblend_sglang.passages import (
    MAX_PASSAGES,
    PASSAGES_PARAM,
    PassageError,
    PassageLayout,
    choose_order,
    donor_runs,
    parse_passages,
    passages_error,
    reordered_prompt,
)

HEAD = [1, 2, 3]
P = {
    name: [base + k for k in range(size)]
    for name, base, size in (("a", 100, 5), ("b", 200, 7), ("c", 300, 4), ("d", 400, 6))
}
TAIL = [9, 9]


def _prompt(*names: str, head: list[int] = HEAD, tail: list[int] = TAIL) -> list[int]:
    out = list(head)
    for n in names:
        out += P[n]
    return out + tail


def _layout(*names: str, head: list[int] = HEAD) -> PassageLayout:
    bounds, at = [], len(head)
    for n in names:
        bounds.append([at, at + len(P[n])])
        at += len(P[n])
    return parse_passages(bounds, at + len(TAIL))


def _cache(*prompts: Sequence[int], page: int = 1) -> Callable[[Sequence[int]], int]:
    def cached_len(tokens: Sequence[int]) -> int:
        best = 0
        for held in prompts:
            n = next(
                (i for i, (x, y) in enumerate(zip(tokens, held, strict=False)) if x != y), None
            )
            best = max(best, min(len(tokens), len(held)) if n is None else n)
        return best - best % page

    return cached_len


def test_a_resident_requests_order_leads_and_the_rest_keeps_the_requests_order() -> None:
    request = _prompt("c", "a", "d", "b")
    layout = _layout("c", "a", "d", "b")
    # a resident request holds head + a + b + c (then its own question)
    chosen = choose_order(request, layout, _cache(_prompt("a", "b", "c", tail=[7])))
    assert chosen.order == (1, 3, 0, 2)  # a, b, c held in that order; d after them
    assert chosen.held == 3 and chosen.held_tokens == 5 + 7 + 4 and chosen.changed
    new = reordered_prompt(request, layout, chosen.order)
    assert new == _prompt("a", "b", "c", "d") and len(new) == len(request)


def test_the_longest_run_in_tokens_wins_across_residents_and_ties_keep_the_first() -> None:
    request = _prompt("a", "b", "c", "d")
    layout = _layout("a", "b", "c", "d")
    residents = _cache(_prompt("c", "a"), _prompt("b", "d"))  # 4 + 5 against 7 + 6 tokens
    assert choose_order(request, layout, residents).order == (1, 3, 0, 2)
    tie = _cache(_prompt("c", "a"), _prompt("a", "c"))
    assert choose_order(request, layout, tie).order == (0, 2, 1, 3)  # a first: request order


def test_nothing_held_after_the_head_keeps_the_requests_order() -> None:
    request = _prompt("b", "a")
    layout = _layout("b", "a")
    other_head = _cache(_prompt("a", "b", head=[5, 5, 5]))
    chosen = choose_order(request, layout, other_head)
    assert chosen.order == (0, 1) and chosen.held == 0 and not chosen.changed
    only_head = choose_order(request, layout, _cache([*HEAD, 42]))
    assert only_head.order == (0, 1) and only_head.held_tokens == 0


def test_a_passage_counts_as_held_up_to_its_last_partial_page() -> None:
    request = _prompt("b", "a")
    layout = _layout("b", "a")
    resident = _prompt("a", "b")
    # page 4: head + a is 8 tokens (2 pages), head + a + b 15 (3 whole pages held)
    chosen = choose_order(request, layout, _cache(resident, page=4), page_size=4)
    assert chosen.order == (1, 0) and chosen.held == 2
    assert choose_order(request, layout, _cache(resident[:6], page=4), page_size=4).held == 0


LENGTHS = [len(P[n]) for n in "abcd"]


def _in_donor(*names: str, donor: int = 0, at: int = 50) -> dict[str, SpanSource]:
    """Where a donor holding ``names`` back to back from position ``at`` holds each."""
    out = {}
    for n in names:
        out[n] = SpanSource(donor, at)
        at += len(P[n])
    return out


def _sources(*donors: dict[str, SpanSource]) -> list[SpanSource | None]:
    held = {n: src for donor in donors for n, src in donor.items()}
    return [held.get(n) for n in "abcd"]


def test_passages_that_follow_each_other_in_a_donor_are_put_together_in_its_order() -> None:
    # request order d, b, c, a; donor 0 holds a, b back to back, donor 1 holds c, d
    sources = _sources(_in_donor("a", "b"), _in_donor("c", "d", donor=1, at=10))
    order, joins = donor_runs([3, 1, 2, 0], LENGTHS, sources)
    assert order == (2, 3, 0, 1) and joins == 2  # each chain where its first stands: c d, a b
    # a passage of no donor, and one alone in its donor, keep their places
    lone = _sources(_in_donor("a", "c"), _in_donor("b", donor=1))
    assert donor_runs([1, 2, 3, 0], LENGTHS, lone) == ((1, 3, 0, 2), 1)


def test_no_join_keeps_the_requests_order() -> None:
    # a and b in one donor but not back to back, c in another donor at a's end position
    gap = {"a": SpanSource(0, 50), "b": SpanSource(0, 50 + LENGTHS[0] + 1)}
    other = {"c": SpanSource(1, 50 + LENGTHS[0])}
    assert donor_runs([2, 1, 0], LENGTHS, _sources(gap, other)) == ((2, 1, 0), 0)
    assert donor_runs([0, 1], LENGTHS, [None] * 4) == ((0, 1), 0)


def test_donor_runs_follow_the_exact_run_and_are_asked_only_with_two_passages_left() -> None:
    request = _prompt("c", "d", "b", "a")
    layout = _layout("c", "d", "b", "a")
    resident = _cache(_prompt("c", tail=[7]))
    # c is held; of d, b, a the donor holds a then d back to back
    located = _sources(_in_donor("a", "d"))
    asked: list[int] = []

    def sources() -> list[SpanSource | None]:
        asked.append(1)
        return [located[n] for n in (2, 3, 1, 0)]  # by declared passage: c, d, b, a

    chosen = choose_order(request, layout, resident, sources=sources)
    assert chosen.order == (0, 2, 3, 1) and chosen.held == 1 and chosen.joins == 1  # c; b; a d
    assert asked == [1]
    everything = _cache(_prompt("c", "d", "b", "a"))
    held_all = choose_order(request, layout, everything, sources=sources)
    assert held_all.order == (0, 1, 2, 3) and held_all.joins == 0 and asked == [1]


@pytest.mark.parametrize(
    ("value", "why"),
    [
        ([[3, 8]], "a list of 2 to 64"),
        ("3-8", "a list of 2 to 64"),
        ([[3, 8]] * (MAX_PASSAGES + 1), "a list of 2 to 64"),
        ([[3, 8], [8]], "passage 1 is [8], not a [start, end] pair"),
        ([[3, 8], [8, 9.5]], "not a [start, end] pair of integers"),
        ([[3, 8], [True, 9]], "not a [start, end] pair of integers"),
        ([[3, 8], [8, 8]], "passage 1 [8, 8) is empty or outside the prompt's 20 tokens"),
        ([[3, 8], [8, 21]], "outside the prompt's 20 tokens"),
        ([[-1, 8], [8, 10]], "passage 0 [-1, 8) is empty or outside"),
        ([[3, 8], [9, 12]], "passage 1 starts at 9, not where passage 0 ends (8)"),
        ([[8, 12], [3, 8]], "passage 1 starts at 3, not where passage 0 ends (12)"),
    ],
)
def test_a_malformed_declaration_names_the_key_and_why(value: object, why: str) -> None:
    with pytest.raises(PassageError, match=f"custom_params.{PASSAGES_PARAM}: .*{_escaped(why)}"):
        parse_passages(value, 20)
    error = passages_error({PASSAGES_PARAM: value}, 20)
    assert error is not None and why in error


def _escaped(text: str) -> str:
    return re.escape(text)


def test_no_declaration_is_no_error_and_a_good_one_parses() -> None:
    assert passages_error(None, 10) is None
    assert passages_error({"semblend_reuse": False}, 10) is None
    assert passages_error({PASSAGES_PARAM: [[0, 4], [4, 10]]}, 10) is None
    layout = parse_passages([[2, 4], (4, 9)], 12)
    assert (layout.head_end, layout.tail_start, layout.bounds) == (2, 9, ((2, 4), (4, 9)))
    with pytest.raises(ValueError, match="not a permutation"):
        reordered_prompt(list(range(12)), layout, (0, 0))
