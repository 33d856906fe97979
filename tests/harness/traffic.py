"""Real-text traffic for the cache harness: prompts built from the essays, and the randomized
driver that submits, steps, aborts and retracts while checking every invariant.

Token lists come from the ``passages`` and ``instructions`` fixtures (tests/conftest.py). Nothing
here depends on the sglang version: `drive_random` runs on any `CacheHarness`.
"""

from __future__ import annotations

import random
from typing import Any

from tests.harness.driver import CacheHarness
from tests.harness.invariants import check_invariants

INSTRUCTIONS = [
    "Summarize the essay above in three sentences.",
    "List the main arguments the author makes.",
    "What would a skeptic say about this text?",
    "Rewrite the first paragraph for a ten-year-old.",
    "Which claim in the passage is the weakest, and why?",
    "Give the essay a new title.",
]
"""The instruction sentences of the ``instructions`` fixture."""

NAMESPACES: list[tuple[str | None, str | None]] = [
    (None, None),
    ("adapter-b", None),
    (None, "tenant-c"),
]
"""(extra_key, cache_salt) of the three namespaces randomized traffic uses."""

PASSAGE_WIDTHS = [50, 90, 130, 70, 110]


def essay_passages(tokenizer: Any, essays: list[str]) -> list[list[list[int]]]:
    """Per essay (first 12), consecutive passages of its tokens, 50-130 tokens each; essays
    with fewer than 4 passages are left out. The essays carry no paragraph breaks, so passages
    are fixed token windows."""
    widths = PASSAGE_WIDTHS
    out: list[list[list[int]]] = []
    for text in essays[:12]:
        ids = tokenizer.encode(text, add_special_tokens=False)
        paras, pos, i = [], 0, 0
        while pos + widths[i % len(widths)] <= len(ids) and len(paras) < 12:
            paras.append(ids[pos : pos + widths[i % len(widths)]])
            pos += widths[i % len(widths)]
            i += 1
        if len(paras) >= 4:
            out.append(paras)
    return out


def document(passages: list[list[list[int]]], essay: int, count: int) -> list[int]:
    """The first `count` passages of essay `essay`, concatenated."""
    return [t for p in passages[essay][:count] for t in p]


def semantic_pair(
    h: CacheHarness, passages: list[list[list[int]]], instructions: list[list[int]]
) -> Any:
    """Run a donor (instruction 0 + essay 2's document) to completion, then submit the target
    (instruction 5 + the same document, two new tokens) and return it (not yet stepped)."""
    doc = document(passages, 2, 8)
    h.submit(instructions[0] + doc)
    h.run_until_idle()
    return h.submit(instructions[5] + doc, max_new_tokens=2)


def make_prompt(
    rng: random.Random,
    passages: list[list[list[int]]],
    instructions: list[list[int]],
    history: list[list[int]],
) -> tuple[str, list[int]]:
    """One prompt: shared document + instruction, shifted, reordered, or an exact repeat."""
    kind = rng.choices(["doc_first", "shifted", "reordered", "repeat"], [4, 2, 2, 2])[0]
    if kind == "repeat" and history:
        return kind, list(rng.choice(history[-40:]))
    essay = rng.choice(passages[:8])
    start = rng.randrange(0, len(essay) - 2)
    parts = essay[start : start + rng.randint(2, 4)]
    instr = rng.choice(instructions)
    if kind == "reordered":
        parts = list(parts)
        rng.shuffle(parts)
    doc = [t for p in parts for t in p]
    if kind == "shifted":
        return kind, instr + doc
    return ("doc_first" if kind != "repeat" else "repeat"), doc + instr


def drive_random(
    harness: Any,
    passages: list[list[list[int]]],
    instructions: list[list[int]],
    num_requests: int,
    seed: int,
    *,
    retract: bool = False,
    flow: Any = None,
) -> dict[str, int]:
    """Submit, step and abort at random (and, with ``retract``, retract running requests as
    sglang's TEST_RETRACT does: a harness with ``retract_decode``); check invariants after every
    step, abort and retraction; drain and return the counts of what happened. With ``flow``
    (the adapter's RequestFlow), ``aborted_with_plan`` counts the aborts of requests that held
    reuse state then (planned, or with donor KV copied)."""
    rng = random.Random(seed)
    history: list[list[int]] = []
    counts = {
        "aborted": 0,
        "aborted_with_plan": 0,
        "chunked": 0,
        "steps": 0,
        "decode_steps": 0,
        "retracted": 0,
    }

    def abort(req: Any) -> None:
        if flow is not None and req.rid in flow.requests:
            counts["aborted_with_plan"] += 1
        harness.abort(req)
        counts["aborted"] += 1

    submitted: list[Any] = []
    seen_chunked: set[str] = set()

    def step() -> None:
        report = harness.step()
        check_invariants(harness)
        counts["steps"] += 1
        counts["decode_steps"] += report.kind == "decode"
        if report.chunked is not None:
            seen_chunked.add(report.chunked.rid)

    for _ in range(num_requests):
        _, tokens = make_prompt(rng, passages, instructions, history)
        history.append(tokens)
        extra_key, cache_salt = rng.choices(NAMESPACES, [6, 2, 2])[0]
        req = harness.submit(
            tokens,
            max_new_tokens=rng.choice([1, 1, 2, 4]),
            extra_key=extra_key,
            cache_salt=cache_salt,
        )
        submitted.append(req)
        for _ in range(rng.choice([0, 1, 1, 2])):
            step()
        roll = rng.random()
        if roll < 0.03 and harness.waiting_queue:
            abort(rng.choice(harness.waiting_queue))
        elif roll < 0.06 and harness.chunked_req is not None:
            abort(harness.chunked_req)
        elif roll < 0.09 and not harness.running_batch.is_empty():
            abort(rng.choice(harness.running_batch.reqs))
        elif retract and roll < 0.15 and len(harness.running_batch.reqs) > 1:
            counts["retracted"] += len(harness.retract_decode())
        check_invariants(harness)
    counts["steps"] += harness.run_until_idle()
    check_invariants(harness, full_kv=True)
    counts["chunked"] = len(seen_chunked)
    assert all(r.finished() for r in submitted)
    return counts
