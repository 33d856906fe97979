"""The question-answering bench workloads ``qa_rag`` and ``qa_rag_corpus``: real questions with
gold answers (:mod:`.qa_data`: BoolQ yes/no, DisflQA extractive spans) over several passages,
so that the bench can score each answer (:func:`.metrics.score_answer`) instead of only
comparing it with cold. :func:`build_qa_workload` makes one; :func:`.builtin_workloads.
build_workload` dispatches here for these names.

A request is the model's chat template around one user turn: an instruction (yes/no or span,
:data:`QA_INSTRUCTIONS`), then ``k`` passages (``Passage k:\\n<text>\\n\\n``, numbered in the
order shown), then ``Question: <question>``. The passages are the gold one (the passage the
question was asked about) and distractors from the same dataset: other passages, never from
the gold passage's article (BoolQ titles) and never containing the gold answer (DisflQA), so
the gold passage is the only one that answers. ``k`` is as many as fit: passages are added
(gold first) until the prompt is within a few tokens of ``context_tokens``; every request is at
most ``context_tokens`` long and a probe typically at least ``context_tokens -``
:data:`QA_LENGTH_SLACK`.

- ``qa_rag``: the donor shows the passages in one order and asks the question of another of
  them (a distractor's own question, with its own gold answer); the probe shows the same
  passages in another order whose first passage differs, and asks the gold question. Every
  passage is a reusable span at another position; exact prefix caching stops before the first.
- ``qa_rag_corpus``: the probe's passages are dealt round-robin (in the probe's order) to
  ``min(3, k)`` donors; each donor adds passages the probe does not have (the group's other
  corpus passages, shared between donors, and new ones) up to the length, and asks the question
  of one of those. Every probe passage is in exactly one donor, and no donor holds them all.

Which data: groups alternate between the datasets, even groups BoolQ, odd groups DisflQA
(:func:`dataset_of_group`), in both workloads; each request carries its own gold answer and
metric kind (:class:`.workloads.GoldAnswer`). Passages never repeat across the groups of a
workload. A request's reference (teacher-forced for the PPL ratio) is its gold answer as the
model would write it (``Yes``/``No``, or the span).

How prompts are made: each piece (the chat template's text before and after the user content,
the instruction, labels, separator, every passage and question) is tokenized on its own
(``add_special_tokens=False``) and the ids are concatenated, so a passage is the same token run
wherever it is placed (as in :mod:`.builtin_workloads`). Determinism: the only randomness is
``random.Random(f"{name}/{context_tokens}/{seed}")``.
"""

from __future__ import annotations

import random
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from .essay_pool import REFERENCE_TOKENS
from .qa_data import BOOLQ, QA_DATASETS, QAItem, answer_in, qa_items
from .workloads import (
    BenchRequest,
    RequestGroup,
    Role,
    Workload,
    adjacent_bounds,
    encode,
    prefix_order,
)

QA_WORKLOADS: tuple[str, ...] = ("qa_rag", "qa_rag_corpus")

#: The instruction in front of the passages, by answer kind.
QA_INSTRUCTIONS: dict[str, str] = {
    "yes_no": "Answer the question using the passages. Reply with yes or no.",
    "span": "Answer the question using the passages. Reply with a short span copied from the "
    "passages.",
}
QA_PASSAGE_LABEL = "Passage:\n"
QA_SEPARATOR = "\n\n"
QA_QUESTION = "Question: {question}"
#: Donors of a ``qa_rag_corpus`` group (fewer when the probe has fewer passages).
QA_CORPUS_DONORS = 3
#: Tokens kept for the question when choosing a gold passage (the longest question is ~45).
QA_QUESTION_ROOM = 64
#: A fill stops once fewer tokens than this are left.
FILL_SLACK = 8
#: A fill gives up after this many candidates in a row that do not fit.
MAX_MISFITS = 200
#: How far below ``context_tokens`` a probe may end (passages do not divide the length).
QA_LENGTH_SLACK = 96
#: The user content's place in the rendered chat template (a private-use character).
CONTENT_MARK = "\ue000"

_IDS_CACHE: weakref.WeakKeyDictionary[Any, dict[str, tuple[int, ...]]] = weakref.WeakKeyDictionary()


def _ids(tokenizer: Any, text: str) -> tuple[int, ...]:
    """``text`` tokenized (no special tokens added), cached while the tokenizer lives."""
    try:
        cache = _IDS_CACHE.setdefault(tokenizer, {})
    except TypeError:  # not weak-referenceable: no cache
        return encode(tokenizer, text)
    ids = cache.get(text)
    if ids is None:
        ids = cache[text] = encode(tokenizer, text)
    return ids


def chat_frame(tokenizer: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The token ids the model's chat template puts before and after one user turn's content,
    with the generation prompt (SmolLM2: its default system turn and ``<|im_start|>user\\n``;
    ``<|im_end|>\\n<|im_start|>assistant\\n``). Needs a transformers tokenizer with a chat
    template (``apply_chat_template``); ValueError otherwise."""
    apply = getattr(tokenizer, "apply_chat_template", None)
    if apply is None:
        raise ValueError(
            "the QA workloads need a tokenizer with a chat template "
            "(transformers' AutoTokenizer of the served model)"
        )
    text = apply(
        [{"role": "user", "content": CONTENT_MARK}], tokenize=False, add_generation_prompt=True
    )
    if not isinstance(text, str) or text.count(CONTENT_MARK) != 1:
        raise ValueError("the chat template did not render the user content exactly once")
    head, tail = text.split(CONTENT_MARK)
    return encode(tokenizer, head), encode(tokenizer, tail)


def dataset_of_group(index: int) -> str:
    """The dataset group ``index`` of a QA workload draws from: BoolQ for even, DisflQA for odd
    indices."""
    return QA_DATASETS[index % len(QA_DATASETS)]


def question_text(item: QAItem) -> str:
    """The question line of ``item``: :data:`QA_QUESTION`, with a ``?`` added when the dataset's
    question has none (BoolQ's are lowercase statements without one)."""
    question = item.question if item.question.endswith("?") else item.question + "?"
    return QA_QUESTION.format(question=question)


def reference_text(item: QAItem) -> str:
    """The gold answer as the model would write it, teacher-forced for the PPL ratio: ``Yes`` or
    ``No``, or the first gold span."""
    answer = item.gold.answers[0]
    return answer.capitalize() if item.gold.kind == "yes_no" else answer


class _Pieces:
    """The tokenized pieces of one tokenizer's QA prompts and their lengths."""

    def __init__(self, tokenizer: Any) -> None:
        self.tok = tokenizer
        self.head, self.tail = chat_frame(tokenizer)
        self.sep = _ids(tokenizer, QA_SEPARATOR)
        self.instruction = {
            kind: _ids(tokenizer, text + QA_SEPARATOR) for kind, text in QA_INSTRUCTIONS.items()
        }
        self.label = _ids(tokenizer, QA_PASSAGE_LABEL)

    def passage(self, item: QAItem) -> tuple[int, ...]:
        return _ids(self.tok, item.passage)

    def question(self, item: QAItem) -> tuple[int, ...]:
        return _ids(self.tok, question_text(item))

    def reference(self, item: QAItem) -> tuple[int, ...]:
        return _ids(self.tok, reference_text(item))

    def fixed(self, kind: str) -> int:
        """Tokens of a prompt other than its passages and question."""
        return len(self.head) + len(self.instruction[kind]) + len(self.tail)

    def cost(self, item: QAItem) -> int:
        """Tokens ``item`` adds as one of the prompt's passages (label and separator included)."""
        return len(self.label) + len(self.passage(item)) + len(self.sep)

    def total(self, items: Sequence[QAItem]) -> int:
        """Tokens ``items`` take as a prompt's passages, labels and separators (any order)."""
        return sum(self.cost(item) for item in items)

    def bounds(self, kind: str, passages: Sequence[QAItem]) -> tuple[tuple[int, int], ...]:
        """Where each of ``passages`` (label and separator included) lies in :meth:`prompt`."""
        start = len(self.head) + len(self.instruction[kind])
        return adjacent_bounds(start, [self.cost(item) for item in passages])

    def prompt(self, kind: str, passages: Sequence[QAItem], asked: QAItem) -> tuple[int, ...]:
        """The chat-formatted request: instruction, ``passages`` in order, ``asked``'s
        question."""
        out = [*self.head, *self.instruction[kind]]
        for item in passages:
            out += [*self.label, *self.passage(item), *self.sep]
        out += [*self.question(asked), *self.tail]
        return tuple(out)


class _Pool:
    """One dataset's items in a seeded order; a passage is handed out at most once per
    workload (``use``)."""

    def __init__(self, dataset: str, rng: random.Random) -> None:
        self.dataset = dataset
        self.items = qa_items(dataset)
        self.order = list(range(len(self.items)))
        rng.shuffle(self.order)
        self.used: set[str] = set()

    def use(self, item: QAItem) -> None:
        self.used.add(item.passage)

    def draw(self, accept: Callable[[QAItem], bool]) -> Iterator[QAItem]:
        """Unused items ``accept`` takes, in pool order (checked as they are reached)."""
        for index in self.order:
            item = self.items[index]
            if item.passage not in self.used and accept(item):
                yield item

    def first(self, accept: Callable[[QAItem], bool], what: str) -> QAItem:
        """The first :meth:`draw` item, marked used; ValueError when none is left."""
        for item in self.draw(accept):
            self.use(item)
            return item
        raise ValueError(
            f"not enough {self.dataset} passages for another {what}; use fewer groups or "
            "shorter contexts"
        )


def _distractor_of(gold: QAItem) -> Callable[[QAItem], bool]:
    """Whether an item may stand beside ``gold``'s passage: another article (BoolQ) and not
    holding a gold answer (DisflQA)."""

    def accept(item: QAItem) -> bool:
        if item.passage == gold.passage:
            return False
        if gold.dataset == BOOLQ:
            return not item.source or item.source != gold.source
        return not any(answer_in(a, item.passage) for a in gold.gold.answers)

    return accept


def _fill(
    pieces: _Pieces,
    pool: _Pool,
    held: Sequence[QAItem],
    budget: int,
    accept: Callable[[QAItem], bool],
    offered: Sequence[QAItem] = (),
) -> list[QAItem]:
    """``held``, then items of ``offered`` and new ones from ``pool`` (marked used) that fit,
    while the passages' tokens stay within ``budget`` (see :data:`FILL_SLACK`,
    :data:`MAX_MISFITS`)."""
    chosen = list(held)
    total = pieces.total(chosen)
    misfits = 0

    def candidates() -> Iterator[tuple[QAItem, bool]]:
        for item in offered:
            if item not in chosen:
                yield item, False
        for item in pool.draw(accept):
            yield item, True

    for item, fresh in candidates():
        if budget - total < FILL_SLACK or misfits >= MAX_MISFITS:
            break
        cost = pieces.cost(item)
        if total + cost > budget:
            misfits += 1
            continue
        chosen.append(item)
        total += cost
        misfits = 0
        if fresh:
            pool.use(item)
    return chosen


def _pick_gold(pieces: _Pieces, pool: _Pool, ctx: int) -> QAItem:
    """The group's question: an item whose passage leaves room for at least one more of the
    same length, whose question fits :data:`QA_QUESTION_ROOM` and whose answer fits the
    reference length."""
    kind = "yes_no" if pool.dataset == BOOLQ else "span"
    half = (ctx - pieces.fixed(kind) - QA_QUESTION_ROOM) // 2

    def accept(item: QAItem) -> bool:
        return (
            pieces.cost(item) <= half
            and len(pieces.question(item)) <= QA_QUESTION_ROOM
            and len(pieces.reference(item)) <= REFERENCE_TOKENS
        )

    return pool.first(accept, "question")


def _describe(items: Sequence[QAItem], asked: QAItem) -> str:
    rows = ", ".join(str(i.row) for i in items)
    return f"{asked.dataset} passages of rows [{rows}], question of row {asked.row}"


def _request(
    pieces: _Pieces,
    role: Role,
    passages: Sequence[QAItem],
    asked: QAItem,
    donor_orders: Sequence[Sequence[QAItem]] = (),
) -> BenchRequest:
    """One request; a probe given its donors' passage orders also carries its prompt with the
    passages in :func:`.workloads.prefix_order`."""
    reordered = (
        pieces.prompt(asked.gold.kind, prefix_order(passages, donor_orders), asked)
        if donor_orders
        else ()
    )
    return BenchRequest(
        pieces.prompt(asked.gold.kind, passages, asked),
        role,
        pieces.reference(asked),
        _describe(passages, asked),
        gold=asked.gold,
        reordered_ids=reordered,
        passage_bounds=pieces.bounds(asked.gold.kind, passages) if donor_orders else (),
    )


def _qa_rag(pieces: _Pieces, pool: _Pool, ctx: int, gid: str, rng: random.Random) -> RequestGroup:
    gold = _pick_gold(pieces, pool, ctx)
    kind = gold.gold.kind
    ok = _distractor_of(gold)
    room = ctx - pieces.fixed(kind)
    q_gold = len(pieces.question(gold))

    def fits_asked(item: QAItem) -> bool:
        longest = max(q_gold, len(pieces.question(item)))
        return ok(item) and pieces.total([gold, item]) + longest <= room

    asked = pool.first(fits_asked, "donor question")
    budget = room - max(q_gold, len(pieces.question(asked)))
    passages = _fill(pieces, pool, [gold, asked], budget, ok)
    donor = rng.sample(passages, len(passages))
    probe = list(donor)
    while probe[0] == donor[0]:  # the first passage differs: exact prefix covers none
        rng.shuffle(probe)
    return RequestGroup(
        gid,
        (
            _request(pieces, "donor", donor, asked),
            _request(pieces, "probe", probe, gold, [donor]),
        ),
        shared_spans=tuple(pieces.passage(p) for p in probe),
    )


def _qa_rag_corpus(
    pieces: _Pieces, pool: _Pool, ctx: int, gid: str, rng: random.Random
) -> RequestGroup:
    gold = _pick_gold(pieces, pool, ctx)
    kind = gold.gold.kind
    ok = _distractor_of(gold)
    room = ctx - pieces.fixed(kind)
    chosen = _fill(pieces, pool, [gold], room - len(pieces.question(gold)), ok)
    if len(chosen) < 2:
        raise ValueError(f"{gid}: only one passage fits in {ctx} tokens")
    probe = rng.sample(chosen, len(chosen))
    n_donors = min(QA_CORPUS_DONORS, len(probe))
    corpus: list[QAItem] = []  # the group's passages outside the probe, shared by donors
    donors: list[BenchRequest] = []
    donor_orders: list[list[QAItem]] = []
    for d in range(n_donors):
        share = probe[d::n_donors]
        held = pieces.total(share)

        def fits_asked(item: QAItem, share: list[QAItem] = share, held: int = held) -> bool:
            cost = pieces.cost(item)
            return ok(item) and held + cost + len(pieces.question(item)) <= room

        asked = pool.first(fits_asked, "donor question")
        budget = room - len(pieces.question(asked))
        offered = rng.sample(corpus, len(corpus))
        passages = _fill(pieces, pool, [*share, asked], budget, ok, offered)
        corpus += [p for p in passages if p not in share and p not in corpus]
        donor_orders.append(rng.sample(passages, len(passages)))
        donors.append(_request(pieces, "donor", donor_orders[-1], asked))
    return RequestGroup(
        gid,
        (*donors, _request(pieces, "probe", probe, gold, donor_orders)),
        shared_spans=tuple(pieces.passage(p) for p in probe),
    )


_QA_BUILDERS = {"qa_rag": _qa_rag, "qa_rag_corpus": _qa_rag_corpus}


def build_qa_workload(
    name: str, tokenizer: Any, context_tokens: int, groups: int, seed: int
) -> Workload:
    """Build the QA workload ``name`` (one of :data:`QA_WORKLOADS`; see the module doc) with
    ``groups`` groups of prompts at most ``context_tokens`` long. ``tokenizer``: the served
    model's transformers tokenizer (its chat template frames every request). Called by
    :func:`.builtin_workloads.build_workload`, which checks ``context_tokens`` and ``groups``;
    deterministic for equal arguments. Raises ValueError for an unknown name, a tokenizer
    without a chat template, or when a dataset runs out of unused passages (too many groups)."""
    if name not in _QA_BUILDERS:
        raise ValueError(f"unknown QA workload {name!r}; one of {', '.join(QA_WORKLOADS)}")
    pieces = _Pieces(tokenizer)
    rng = random.Random(f"{name}/{context_tokens}/{seed}")
    pools = {dataset: _Pool(dataset, rng) for dataset in QA_DATASETS}
    builder = _QA_BUILDERS[name]
    built = tuple(
        builder(
            pieces,
            pools[dataset_of_group(k)],
            context_tokens,
            f"{name}-{context_tokens}-{k:03d}",
            rng,
        )
        for k in range(groups)
    )
    return Workload(name=name, context_tokens=context_tokens, groups=built)
