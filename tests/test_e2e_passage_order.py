"""Passage order on the shared semblend server (custom_params.semblend_passages).

A resident request holds an instruction, three passages and its question; a new request sends
the same passages in another order with another question and declares them. The server puts
them in the resident's order, SGLang's exact prefix cache serves them, the answer is the cold
answer of the prompt the model saw, and ``meta_info`` says which order that was. Without the
declaration nothing moves; a malformed one is a 400 naming the key. Every request carries a
cache salt of its own test.
"""

from __future__ import annotations

import json
import urllib.error
import uuid
from typing import Any

import httpx
import pytest

from semblend_sglang.passages import ORDER_INFO_KEY, PASSAGES_PARAM
from semblend_sglang.server import SglangServer
from tests.harness.server import generate, semblend_totals

pytestmark = pytest.mark.e2e

ANSWER_TOKENS = 16


def _ids(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))


@pytest.fixture(scope="module")
def parts(smollm2_tokenizer: Any, essay_texts: list[str]) -> dict[str, Any]:
    """Token segments: an instruction, three essay passages (each ending in a blank line), two
    questions."""
    tok = smollm2_tokenizer
    passages = []
    for k, essay in enumerate(essay_texts[3:6]):
        words = essay.split()[:160]
        passages.append(_ids(tok, f"Document {chr(65 + k)}: " + " ".join(words) + "\n\n"))
    return {
        "head": _ids(tok, "Answer the question using only the documents below.\n\n"),
        "other_head": _ids(tok, "Read the documents, then say what they share.\n\n"),
        "passages": passages,
        "q1": _ids(tok, "Question: what is the first document about?\nAnswer:"),
        "q2": _ids(tok, "Question: which document mentions money first?\nAnswer:"),
    }


def _prompt(
    parts: dict[str, Any], order: list[int], question: str, head: str = "head"
) -> tuple[list[int], list]:
    """The prompt with the passages in ``order``, and their declared bounds."""
    ids, bounds = list(parts[head]), []
    for i in order:
        bounds.append([len(ids), len(ids) + len(parts["passages"][i])])
        ids += parts["passages"][i]
    return ids + parts[question], bounds


def _send(url: str, ids: list[int], salt: str, **custom: Any) -> dict[str, Any]:
    return generate(
        url,
        ids,
        ANSWER_TOKENS,
        custom_params=custom or None,
        cache_salt=salt,
        sampling={"ignore_eos": True},
    )


def test_declared_passages_take_a_resident_requests_order_and_answer_as_its_cold_run(
    semblend_server: SglangServer, parts: dict[str, Any]
) -> None:
    url = semblend_server.url
    salt = f"passages-{uuid.uuid4().hex}"
    resident, _ = _prompt(parts, [0, 1, 2], "q1")
    _send(url, resident, salt)
    probe, bounds = _prompt(parts, [2, 0, 1], "q2")  # C, A, B
    before = semblend_totals(url)["passage_orders"]
    got = _send(url, probe, salt, **{PASSAGES_PARAM: bounds})
    after = semblend_totals(url)["passage_orders"]
    assert got["meta_info"][ORDER_INFO_KEY] == [1, 2, 0]  # A, B, C: the resident's order
    seen, _ = _prompt(parts, [0, 1, 2], "q2")
    held = len(seen) - len(parts["q2"])
    assert got["meta_info"]["cached_tokens"] >= held  # SGLang's exact prefix cache served it
    assert after["reordered"] - before["reordered"] == 1
    assert after["held_tokens"] - before["held_tokens"] == held - len(parts["head"])
    cold = _send(url, seen, f"cold-{uuid.uuid4().hex}", semblend_reuse=False)
    assert cold["meta_info"]["cached_tokens"] == 0
    assert got["output_ids"] == cold["output_ids"]

    # the same request without the declaration: its own order, only the instruction cached
    plain = _send(url, probe, salt)
    assert ORDER_INFO_KEY not in plain["meta_info"]
    assert plain["meta_info"]["cached_tokens"] < held


def test_passages_a_donor_holds_back_to_back_are_put_in_its_order_and_reused_as_one_span(
    semblend_server: SglangServer, parts: dict[str, Any]
) -> None:
    """No order is an exact prefix (the resident has another instruction), but it holds A then
    B: the request sent as B, C, A is served as C, A, B (A and B where A stood), its A B reused
    as one span where the same request undeclared reuses them as two; the answer keeps a cold
    run's of the prompt the model saw."""
    url = semblend_server.url
    probe, bounds = _prompt(parts, [1, 2, 0], "q2")  # B, C, A
    spans = {}
    for declared in (True, False):
        salt = f"runs-{declared}-{uuid.uuid4().hex}"
        _send(url, _prompt(parts, [0, 1], "q1", head="other_head")[0], salt)
        before = semblend_totals(url)
        custom = {PASSAGES_PARAM: bounds} if declared else {}
        got = _send(url, probe, salt, **custom)
        after = semblend_totals(url)
        assert after["outcomes"]["materialized"] - before["outcomes"]["materialized"] == 1
        spans[declared] = after["reused_spans"] - before["reused_spans"]
        if declared:
            assert got["meta_info"][ORDER_INFO_KEY] == [1, 2, 0]  # C, A, B
            orders = after["passage_orders"]
            assert orders["reordered"] - before["passage_orders"]["reordered"] == 1
            assert orders["joins"] - before["passage_orders"]["joins"] == 1
            assert orders["held_tokens"] == before["passage_orders"]["held_tokens"]
            seen, _ = _prompt(parts, [2, 0, 1], "q2")
            cold = _send(url, seen, f"cold-{uuid.uuid4().hex}", semblend_reuse=False)
            a, b = got["output_ids"], cold["output_ids"]
            agree = next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), 16)
            assert agree >= 4, (a, b)
    assert spans[True] < spans[False], spans


def test_a_streamed_request_gets_the_order_and_input_logprobs_keep_the_passages(
    semblend_server: SglangServer, parts: dict[str, Any]
) -> None:
    url = semblend_server.url
    salt = f"passages-{uuid.uuid4().hex}"
    _send(url, _prompt(parts, [1, 2, 0], "q1")[0], salt)
    probe, bounds = _prompt(parts, [0, 1, 2], "q2")
    body = {
        "input_ids": probe,
        "sampling_params": {
            "max_new_tokens": 4,
            "temperature": 0,
            "custom_params": {PASSAGES_PARAM: bounds},
        },
        "cache_salt": salt,
        "stream": True,
    }
    orders = []
    with httpx.stream("POST", url + "/generate", json=body, timeout=300) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                orders.append(json.loads(line[6:])["meta_info"].get(ORDER_INFO_KEY))
    assert orders and all(order == [1, 2, 0] for order in orders)

    before = semblend_totals(url)["passage_orders"]
    logprobs = generate(
        url,
        probe,
        1,
        custom_params={PASSAGES_PARAM: bounds},
        cache_salt=salt,
        return_logprob=True,
        logprob_start_len=0,
    )
    assert logprobs["meta_info"][ORDER_INFO_KEY] == [0, 1, 2]  # scored as sent
    assert semblend_totals(url)["passage_orders"]["declined"] - before["declined"] == 1


@pytest.mark.parametrize(
    ("bounds", "why"),
    [
        ("all", "a list of 2 to 64 [start, end] pairs"),
        ([[5, 10], [11, 20]], "passage 1 starts at 11, not where passage 0 ends (10)"),
        ([[5, 10], [10, 100000]], "outside the prompt's"),
    ],
)
def test_a_malformed_declaration_is_a_400_naming_the_key(
    semblend_server: SglangServer, parts: dict[str, Any], bounds: Any, why: str
) -> None:
    probe, _ = _prompt(parts, [0, 1, 2], "q1")
    with pytest.raises(urllib.error.HTTPError) as refused:
        _send(semblend_server.url, probe, f"bad-{uuid.uuid4().hex}", **{PASSAGES_PARAM: bounds})
    assert refused.value.code == 400
    message = refused.value.read().decode()
    assert f"custom_params.{PASSAGES_PARAM}" in message and why in message
