"""End to end: the recompute budget and the quality gate in the real SGLang 0.5.23 server on CPU
with the real SmolLM2 model.

- A ``deviation`` selection (sparse after the check layer) answers like its dense reference:
  the same request run with every position computed and the unselected reused positions' K/V
  forced to the donor's (``custom_params={"semblend_dense_reference": true}``).
- A sampled check (``recompute_check_share`` below 1, ``recompute_check_span_limit`` positions
  at most per span) answers like its dense reference too: there the copied positions left out
  of the sample are forced to the donor's K/V in every layer, and the budget, a share of every
  copied position, is capped by the sample.
- A second check (``recompute_recheck_depth``) on a plan of several spans keeps the budget of
  what the first kept, and answers like its dense reference too (unselected candidates forced
  to the donor's K/V after the check that dropped them).
- A quality gate that refuses every reuse (threshold below any deviation) recomputes everything:
  the answer equals a cold prefill's, and the request is counted ``declined:quality_gate``.
- A request's own settings override the server's: the ``fast`` preset checks a plan of several
  spans once where the server checks it twice, and the snapshot counts it under ``fast``.

Every test's requests carry their repair settings (``custom_params.semblend_reuse``) to the
session's shared semblend server (tests/conftest.py ``semblend_server``).
"""

from __future__ import annotations

from typing import Any

import pytest

from semblend_sglang.bench.client import flush_cache
from semblend_sglang.server import SglangServer
from tests.harness.server import generate, semblend_totals

pytestmark = pytest.mark.e2e

DONOR_HEAD = "Summarize the following essay in three sentences.\n\n"
TARGET_HEAD = "Read the essay below carefully and list the author's main arguments.\n\n"
LOGPROB_TOLERANCE = 2e-3
"""float32 rounding of the same attention computed by two paths (query-only vs full rows)."""


SETTINGS: dict[str, dict[str, Any]] = {
    "deviation": {
        "recompute_strategy": "deviation",
        "recompute_ratio": 0.3,
        "recompute_min_deviation": 0,
        "recompute_check_share": 1,
    },
    # a minimum deviation no K/V moves by: every request's budget is zero (the default sampled
    # check of a one-span plan)
    "floor": {
        "recompute_strategy": "deviation",
        "recompute_ratio": 0.3,
        "recompute_min_deviation": 1e6,
    },
    # a fifth of a one-span plan's copied positions, at most SPAN_LIMIT of them, computed up to
    # the check layer: fewer than the budget
    "sampled": {
        "recompute_strategy": "deviation",
        "recompute_ratio": 0.3,
        "recompute_min_deviation": 0,
        "recompute_check_share": 0.2,
        "recompute_check_span_limit": 96,
    },
    # plans of several spans checked twice: the check layer keeps 3 x 15%, layer 15 of 30 the
    # 15%; the floor (no K/V moves by it) does not apply to them
    "recheck": {
        "recompute_strategy": "deviation",
        "recompute_ratio": 0.15,
        "recompute_min_deviation": 1e6,
        "recompute_recheck_depth": 0.5,
        "recompute_recheck_width": 3,
    },
    # a quality gate below any deviation: every reuse is refused (and no plan is sampled)
    "gate": {
        "recompute_strategy": "query",
        "recompute_ratio": 0.15,
        "recompute_min_deviation": 0,
        "quality_gate": 1e-12,
    },
}
"""The repair settings each test's requests carry (``custom_params.semblend_reuse``,
semblend_sglang/request_settings.py), by the test's ``settings`` parameter. Each was a server
of its own (the same values as SEMBLEND_* variables) before requests could carry them; all run
on the session's shared server now."""


@pytest.fixture
def settings(request: pytest.FixtureRequest) -> dict[str, Any]:
    """The :data:`SETTINGS` named by the test's parameter."""
    return SETTINGS[request.param]


@pytest.fixture
def url(semblend_server: SglangServer) -> str:
    """The session's shared semblend server (tests/conftest.py, default settings)."""
    return semblend_server.url


@pytest.fixture(scope="module")
def prompts(smollm2_tokenizer: Any, essay_texts: list[str]) -> tuple[list[int], list[int]]:
    """(donor, target): two instructions in front of the same 900-token essay passage."""
    enc = smollm2_tokenizer.encode
    doc = enc(essay_texts[3], add_special_tokens=False)[:900]
    assert len(doc) == 900
    donor = enc(DONOR_HEAD, add_special_tokens=False) + doc
    target = (
        enc(TARGET_HEAD, add_special_tokens=False)
        + doc
        + enc("\n\nArguments:\n1.", add_special_tokens=False)
    )
    return donor, target


def _answer(
    url: str,
    ids: list[int],
    n: int = 12,
    *,
    settings: dict[str, Any] | None = None,
    reference: bool = False,
    salt: str | None = None,
) -> tuple[list[int], list[float]]:
    """(output ids, their logprobs) of a greedy ``/generate`` of ``ids`` (``n`` new tokens);
    ``settings``: its repair settings, ``reference``: the dense reference (``custom_params``);
    ``salt``: its ``cache_salt``."""
    custom: dict[str, Any] = {}
    if settings is not None:
        custom["semblend_reuse"] = settings
    if reference:
        custom["semblend_dense_reference"] = True
    out = generate(url, ids, n, custom_params=custom or None, return_logprob=True, cache_salt=salt)
    logprobs = [float(entry[0]) for entry in out["meta_info"]["output_token_logprobs"]]
    return list(out["output_ids"]), logprobs


def _after_fresh_donor(url: str, donor: list[int]) -> dict[str, Any]:
    """Flush the server's cache, prefill the donor again, return the counters."""
    flush_cache(url)
    _answer(url, donor, 1)
    return semblend_totals(url)


def _assert_same_answer(
    got: tuple[list[int], list[float]], want: tuple[list[int], list[float]]
) -> None:
    assert got[0] == want[0]
    worst = max(abs(a - b) for a, b in zip(got[1], want[1], strict=True))
    assert worst <= LOGPROB_TOLERANCE, (worst, got[1], want[1])


def _assert_dense_reference_answers_alike_and_not_cold(
    url: str,
    donor: list[int],
    prompt: list[int],
    sparse: tuple[list[int], list[float]],
    recomputed: int,
    settings: dict[str, Any],
) -> None:
    """``prompt``'s dense reference with ``settings``, after a fresh ``donor``, recomputes
    ``recomputed`` positions and answers as the ``sparse`` run did, which is not the cold
    answer."""
    before = _after_fresh_donor(url, donor)
    dense = _answer(url, prompt, settings=settings, reference=True)
    after = semblend_totals(url)
    assert after["recomputed_tokens"] - before["recomputed_tokens"] == recomputed
    _assert_same_answer(sparse, dense)
    cold = _answer(url, prompt, salt="recompute-cold")
    assert max(abs(a - b) for a, b in zip(dense[1], cold[1], strict=True)) > 10 * LOGPROB_TOLERANCE


@pytest.mark.parametrize("settings", ["deviation"], indirect=True)
def test_a_deviation_selection_answers_like_its_dense_reference(
    url: str, settings: dict[str, Any], prompts: tuple[list[int], list[int]]
) -> None:
    donor, target = prompts
    before = _after_fresh_donor(url, donor)
    sparse = _answer(url, target, settings=settings)
    after = semblend_totals(url)
    assert after["outcomes"]["materialized"] == before["outcomes"]["materialized"] + 1
    kept = after["reused_tokens"] - before["reused_tokens"]
    recomputed = after["recomputed_tokens"] - before["recomputed_tokens"]
    assert after["recompute_checks"] == before["recompute_checks"] + 1
    assert kept >= 500 and recomputed >= 0.29 * (kept + recomputed), (kept, recomputed)

    before = _after_fresh_donor(url, donor)
    dense = _answer(url, target, settings=settings, reference=True)
    after = semblend_totals(url)
    assert after["recomputed_tokens"] - before["recomputed_tokens"] == recomputed
    _assert_same_answer(sparse, dense)


@pytest.mark.parametrize("settings", ["sampled"], indirect=True)
def test_a_sampled_check_answers_like_its_dense_reference_within_the_sample(
    url: str, settings: dict[str, Any], prompts: tuple[list[int], list[int]]
) -> None:
    """Only a fifth of the copied positions would reach the check layer, and the span limit
    takes 96 of them (a fifth is ~180), so only those can be recomputed: the 30% budget is
    capped at the sample. The sparse run (the others never computed) and its dense reference
    (the others computed with the donor's K/V forced in every layer) give the same answer, which
    is not the cold one."""
    donor, target = prompts
    before = _after_fresh_donor(url, donor)
    sparse = _answer(url, target, settings=settings)
    after = semblend_totals(url)
    assert after["outcomes"]["materialized"] == before["outcomes"]["materialized"] + 1
    assert after["recompute_checks"] == before["recompute_checks"] + 1
    kept = after["reused_tokens"] - before["reused_tokens"]
    recomputed = after["recomputed_tokens"] - before["recomputed_tokens"]
    copied = kept + recomputed
    assert copied >= 800 and recomputed == 96, (kept, recomputed)

    _assert_dense_reference_answers_alike_and_not_cold(
        url, donor, target, sparse, recomputed, settings
    )


def _swapped(prompts: tuple[list[int], list[int]]) -> list[int]:
    """The target with its essay passage's halves swapped: a plan of two spans."""
    donor, target = prompts
    doc = donor[-900:]
    at = next(i for i in range(len(target)) if target[i : i + 900] == doc)
    return target[:at] + doc[450:] + doc[:450] + target[at + 900 :]


@pytest.mark.parametrize("settings", ["sampled"], indirect=True)
def test_a_plan_of_several_spans_is_checked_on_every_reused_position(
    url: str, settings: dict[str, Any], prompts: tuple[list[int], list[int]]
) -> None:
    """The same passage with its halves swapped is a plan of two spans: more than
    ``recompute_check_max_spans`` (1), so its check scores every copied position and the full
    30% budget is spent, not a fifth."""
    donor, _ = prompts
    swapped = _swapped(prompts)
    before = _after_fresh_donor(url, donor)
    _answer(url, swapped, 1, settings=settings)
    after = semblend_totals(url)
    assert after["outcomes"]["materialized"] == before["outcomes"]["materialized"] + 1
    kept = after["reused_tokens"] - before["reused_tokens"]
    recomputed = after["recomputed_tokens"] - before["recomputed_tokens"]
    assert kept + recomputed >= 700 and recomputed >= 0.29 * (kept + recomputed), (kept, recomputed)


@pytest.mark.parametrize("settings", ["recheck"], indirect=True)
def test_a_second_check_keeps_the_budget_and_answers_like_its_dense_reference(
    url: str, settings: dict[str, Any], prompts: tuple[list[int], list[int]]
) -> None:
    """A plan of two spans on a server with ``recompute_recheck_depth`` 0.5: the check layer
    keeps 45% of the copied positions, layer 15 the 15% budget of them, though no position
    reaches the minimum deviation (it does not apply to a rechecked plan). The counters show the
    budget, not the first check's 45%; the sparse run (rows dropped after each check) and its
    dense reference (those rows forced to the donor's K/V after the check that dropped them)
    give the same answer, which is not the cold one."""
    donor, _ = prompts
    swapped = _swapped(prompts)
    before = _after_fresh_donor(url, donor)
    sparse = _answer(url, swapped, settings=settings)
    after = semblend_totals(url)
    assert after["outcomes"]["materialized"] == before["outcomes"]["materialized"] + 1
    assert after["recompute_checks"] == before["recompute_checks"] + 1
    assert after["recompute_rechecks"] == before["recompute_rechecks"] + 1
    kept = after["reused_tokens"] - before["reused_tokens"]
    recomputed = after["recomputed_tokens"] - before["recomputed_tokens"]
    copied = kept + recomputed
    assert copied >= 700 and 0.15 * copied <= recomputed < 0.15 * copied + 1, (kept, recomputed)

    _assert_dense_reference_answers_alike_and_not_cold(
        url, donor, swapped, sparse, recomputed, settings
    )
    assert after["by_settings"]["custom"]["materialized"] > before["by_settings"].get(
        "custom", {}
    ).get("materialized", 0)


def test_a_requests_one_check_preset_overrides_the_servers_second_check(
    url: str, prompts: tuple[list[int], list[int]]
) -> None:
    """The server checks plans of several spans twice (its default, named at start-up); the
    same two-span plan sent with the ``fast`` preset is checked once, counted under ``fast``,
    and keeps the budget of the first check alone."""
    donor, _ = prompts
    swapped = _swapped(prompts)
    before = _after_fresh_donor(url, donor)
    _answer(url, swapped, 1, settings={"preset": "fast"})
    after = semblend_totals(url)
    assert after["outcomes"]["materialized"] == before["outcomes"]["materialized"] + 1
    assert after["recompute_checks"] == before["recompute_checks"] + 1
    assert after["recompute_rechecks"] == before["recompute_rechecks"]
    fast_before = before["by_settings"].get("fast", {})
    fast = after["by_settings"]["fast"]
    assert fast["materialized"] == fast_before.get("materialized", 0) + 1
    assert fast["reused_tokens"] - fast_before.get("reused_tokens", 0) >= 500

    before = _after_fresh_donor(url, donor)
    _answer(url, swapped, 1)  # the server's own settings: checked twice
    after = semblend_totals(url)
    assert after["recompute_rechecks"] == before["recompute_rechecks"] + 1
    assert after["by_settings"]["server"]["materialized"] > before["by_settings"].get(
        "server", {}
    ).get("materialized", 0)


@pytest.mark.parametrize("settings", ["floor"], indirect=True)
def test_a_request_under_the_minimum_deviation_recomputes_nothing_after_the_check(
    url: str, settings: dict[str, Any], prompts: tuple[list[int], list[int]]
) -> None:
    """The per-request budget at its extreme: the check layer runs, no reused position
    qualifies, so the request keeps every copied position and answers as its dense reference
    (the same selection computed over full rows)."""
    donor, target = prompts
    before = _after_fresh_donor(url, donor)
    sparse = _answer(url, target, settings=settings)
    after = semblend_totals(url)
    assert after["outcomes"]["materialized"] == before["outcomes"]["materialized"] + 1
    assert after["recompute_checks"] == before["recompute_checks"] + 1
    assert after["recomputed_tokens"] == before["recomputed_tokens"]
    assert after["reused_tokens"] - before["reused_tokens"] >= 800
    before = _after_fresh_donor(url, donor)
    dense = _answer(url, target, settings=settings, reference=True)
    _assert_same_answer(sparse, dense)


@pytest.mark.parametrize("settings", ["gate"], indirect=True)
def test_a_gate_that_refuses_recomputes_everything_and_answers_like_cold(
    url: str, settings: dict[str, Any], prompts: tuple[list[int], list[int]]
) -> None:
    donor, target = prompts
    before = _after_fresh_donor(url, donor)
    gated = _answer(url, target, settings=settings)
    after = semblend_totals(url)
    assert after["declined"].get("quality_gate", 0) == before["declined"].get("quality_gate", 0) + 1
    assert after["outcomes"]["materialized"] == before["outcomes"]["materialized"]
    assert after["recompute_gated"] == before["recompute_gated"] + 1
    assert after["reused_tokens"] == before["reused_tokens"]
    assert after["recomputed_tokens"] - before["recomputed_tokens"] >= 800
    cold = _answer(url, target, salt="recompute-cold")
    _assert_same_answer(gated, cold)
    # the gated request published nothing from its first copied position on: a repeat is not
    # an exact hit of its KV
    repeat = generate(url, target, 1)
    assert repeat["meta_info"]["cached_tokens"] < 50
    assert semblend_totals(url)["errors"] == before["errors"]
