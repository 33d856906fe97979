"""The bench's workload data model: a :class:`Workload` is a set of independent
:class:`RequestGroup` s. In a group the first request(s) are *donors* (sent first; their KV is
what a later request may reuse) and the rest are *probes* (the requests whose TTFT and quality
are measured). Every prompt is a tuple of token ids, sent to SGLang's ``/generate`` as
``input_ids``. Built-in workloads: :mod:`.builtin_workloads`; a user's JSONL file:
:mod:`.workload_file`.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypeVar, cast

Role = Literal["donor", "probe"]
ROLES: tuple[str, ...] = ("donor", "probe")

AnswerKind = Literal["yes_no", "span", "summary", "number"]
ANSWER_KINDS: tuple[str, ...] = ("yes_no", "span", "summary", "number")
YES_NO: tuple[str, ...] = ("yes", "no")


@dataclass(frozen=True)
class GoldAnswer:
    """The gold answer(s) of a question-answering request, and how an output is scored against
    them (:func:`.metrics.score_answer`).

    ``kind``: ``"yes_no"`` (``answers`` is ``("yes",)`` or ``("no",)``; accuracy), ``"span"``
    (extractive answers, any of which counts; exact match and token F1, the maximum over
    ``answers``), ``"summary"`` (a human-written reference summary; ROUGE-L, the maximum over
    ``answers``) or ``"number"`` (a math answer: right when the number SGLang's GSM8K scorer
    reads from the output equals the one it reads from ``answers[0]``; accuracy). ``dataset``:
    where the question comes from (``boolq``, ``disflqa``), for reports. Built by
    :mod:`.qa_workloads`; the bench's records carry it (:meth:`from_json` reads it back from a
    report). Only the QA workloads set it: other requests carry None.
    """

    kind: AnswerKind
    answers: tuple[str, ...]
    dataset: str = ""

    def __post_init__(self) -> None:
        if self.kind not in ANSWER_KINDS:
            raise ValueError(f"answer kind must be one of {ANSWER_KINDS}, not {self.kind!r}")
        if not self.answers or not all(a.strip() for a in self.answers):
            raise ValueError("a gold answer needs at least one non-blank answer")
        if self.kind == "yes_no" and (len(self.answers) != 1 or self.answers[0] not in YES_NO):
            raise ValueError(f"a yes_no gold answer is ('yes',) or ('no',), not {self.answers}")

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> GoldAnswer:
        """The answer from its JSON form (``dataclasses.asdict`` of one, as in a report's
        records: ``answers`` a list). Raises ValueError as the constructor does."""
        kind = str(data["kind"])
        if kind not in ANSWER_KINDS:
            raise ValueError(f"answer kind must be one of {ANSWER_KINDS}, not {kind!r}")
        answers = tuple(str(a) for a in data["answers"])
        return cls(cast(AnswerKind, kind), answers, str(data.get("dataset", "")))


@dataclass(frozen=True)
class BenchRequest:
    """One request of a bench workload.

    ``prompt_ids``: the prompt as token ids (non-empty), sent as ``input_ids``.
    ``role``: ``"donor"`` (sent first, registers KV others may reuse) or ``"probe"`` (measured).
    ``reference_ids``: a real continuation to teacher-force for the PPL ratio (may be empty).
    ``label``: a human-readable description; the e2e report of a workload file has one row per
    probe label (built-in workloads describe each request with it and are not broken down).
    ``gold``: the request's gold answer when it asks a question with a known answer (the QA
    workloads, :mod:`.qa_workloads`); None for every other request.
    ``reordered_ids``: a probe of passages, rewritten with its passages in the order
    :func:`prefix_order` gives (the lossless ``reorder`` system sends it instead); empty for a
    request without passages to reorder.
    ``passage_bounds``: that probe's passages as ``[start, end)`` token positions in
    ``prompt_ids``, adjacent (:func:`adjacent_bounds`): what the ``reorder_spans`` system
    declares as ``custom_params.semblend_passages``; empty for a request it does not send (a
    request without passages, a workload file's).
    """

    prompt_ids: tuple[int, ...]
    role: Role
    reference_ids: tuple[int, ...] = ()
    label: str = ""
    gold: GoldAnswer | None = None
    reordered_ids: tuple[int, ...] = ()
    passage_bounds: tuple[tuple[int, int], ...] = ()

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be 'donor' or 'probe', not {self.role!r}")
        if not self.prompt_ids:
            raise ValueError("prompt_ids must not be empty")
        if self.passage_bounds and self.passage_bounds[-1][1] > len(self.prompt_ids):
            raise ValueError(
                f"passage_bounds end at {self.passage_bounds[-1][1]}, after the prompt's "
                f"{len(self.prompt_ids)} tokens"
            )


def adjacent_bounds(start: int, lengths: Sequence[int]) -> tuple[tuple[int, int], ...]:
    """``[start, end)`` of adjacent pieces of ``lengths`` tokens, the first at ``start``."""
    out: list[tuple[int, int]] = []
    for n in lengths:
        out.append((start, start + n))
        start += n
    return tuple(out)


T = TypeVar("T", bound=Hashable)


def reorder_prompt(
    prompt: Sequence[int], bounds: Sequence[tuple[int, int]], order: Sequence[int]
) -> tuple[int, ...]:
    """``prompt`` with its passages at ``bounds`` (adjacent) put in ``order`` (for each place,
    the index of the passage put there; empty: as they are), what precedes and follows them
    in place: the prompt a server that chose ``order`` gave the model."""
    if not order:
        return tuple(prompt)
    head, tail = bounds[0][0], bounds[-1][1]
    moved = [t for k in order for t in prompt[bounds[k][0] : bounds[k][1]]]
    return (*prompt[:head], *moved, *prompt[tail:])


def prefix_order(probe: Sequence[T], donors: Sequence[Sequence[T]]) -> list[T]:
    """The probe's passages (distinct items) reordered so that an earlier request's order is an
    exact prefix, as a prefix-reordering planner would (LMCache's blend reorder, ContextPilot):
    the donor whose leading passages are the longest run of probe passages (ties: the first
    donor) gives that run, in its order, to the front; the others follow in the probe's order.
    Pure; the result is a permutation of ``probe``."""
    wanted = set(probe)
    best: list[T] = []
    for donor in donors:
        lead: list[T] = []
        for item in donor:
            if item not in wanted or item in lead:
                break
            lead.append(item)
        if len(lead) > len(best):
            best = lead
    return best + [item for item in probe if item not in best]


@dataclass(frozen=True)
class RequestGroup:
    """Related requests: donors first, then at least one probe that should reuse them.

    A group may have no donor (the control set: every probe is a miss). ``shared_spans`` are
    token runs that the probe and at least one donor contain contiguously (every donor, except
    in ``rag_corpus``): what a probe can at best reuse from its donors beyond the exact prefix
    (empty when unknown, e.g. for user files).
    """

    group_id: str
    requests: tuple[BenchRequest, ...]
    shared_spans: tuple[tuple[int, ...], ...] = ()

    def __post_init__(self) -> None:
        if not self.group_id:
            raise ValueError("group_id must not be empty")
        roles = [r.role for r in self.requests]
        if "probe" not in roles:
            raise ValueError(f"group {self.group_id!r} has no probe")
        first_probe = roles.index("probe")
        if "donor" in roles[first_probe:]:
            raise ValueError(f"group {self.group_id!r}: donors must come before the probes")

    @property
    def donors(self) -> tuple[BenchRequest, ...]:
        """The donor requests, in sending order."""
        return tuple(r for r in self.requests if r.role == "donor")

    @property
    def probes(self) -> tuple[BenchRequest, ...]:
        """The probe requests, in sending order."""
        return tuple(r for r in self.requests if r.role == "probe")


@dataclass(frozen=True)
class Workload:
    """A named set of independent groups; ``context_tokens`` is the nominal prompt length."""

    name: str
    context_tokens: int
    groups: tuple[RequestGroup, ...]

    def __post_init__(self) -> None:
        if not self.groups:
            raise ValueError(f"workload {self.name!r} has no group")
        ids = [g.group_id for g in self.groups]
        if len(set(ids)) != len(ids):
            raise ValueError(f"workload {self.name!r} has duplicate group ids")

    def requests(self) -> Iterator[BenchRequest]:
        """Every request, group by group, in sending order."""
        for group in self.groups:
            yield from group.requests


def encode(tokenizer: Any, text: str) -> tuple[int, ...]:
    """Token ids of ``text`` without special tokens.

    Accepts a transformers tokenizer (``encode`` returns a list) or a ``tokenizers.Tokenizer``
    (``encode`` returns an ``Encoding`` with ``.ids``); both give the same ids for SmolLM2.
    """
    out = tokenizer.encode(text, add_special_tokens=False)
    return tuple(int(i) for i in getattr(out, "ids", out))
