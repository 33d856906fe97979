"""End to end: the recompute budget of the one-pass sparse extend on every model shape the
kernels' RopeSpec accepts, in the real SGLang 0.5.23 server on CPU.

Servers, a few at a time (tests/harness/server.py ``ServerBatches``, in the order of the classes
below):

* a tiny random-weight model per shape (tests/harness/random_models.py: Qwen2 with theta 1e6 and
  q/k/v biases, Llama-3 scaling, YaRN, partial rotary), strategy ``deviation`` at ratio 0.3:
  a target that reuses a donor's passage answers like the same target run as a *dense
  reference* (``custom_params={"semblend_dense_reference": true}``: every position computed in
  every layer, the K/V of the reused positions that are not recomputed forced to the donor's
  after the check layer);
* bench any-weights' CPU checks (recompute_all, delta_zero, the position mask) on the
  Llama-3-scaling server, whose settings are those checks' role's (sink tokens 0, the mask);
* a random Olmo2 model (a class the layer hook does not know), same settings: every plan is
  declined as ``unsupported_model`` with one log line, and the answer is the cold one;
* requests at ratio 1.0 to the session's shared SmolLM2 server (their repair settings in
  ``custom_params.semblend_reuse``): a reusing target answers like a cold run of its prompt.

Answers are compared token by token on greedy output ids and top logprobs in float32 (see
:func:`_assert_same_answer`). Cold means the same prompt after ``/flush_cache``, which also makes
semblend forget every donor, so each comparison starts from a known cache state.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from semblend_sglang.bench.client import flush_cache
from semblend_sglang.server import ServerSpec, SglangServer
from tests.harness.random_models import SHAPES, build_random_model
from tests.harness.server import SERVER_BATCH, ServerBatches, generate, semblend_totals

pytestmark = pytest.mark.e2e

DONOR_HEAD = "Summarize the following essay in three sentences.\n\n"
TARGET_HEAD = "Write a title for the essay that follows.\n\n"
PASSAGE_TOKENS = 500
NEW_TOKENS = 8
TOP_LOGPROBS = 5
LOGPROB_TOL = 1e-3
"""float32 tolerance on a logprob: computing the same positions in another order or batch shape
moves a logprob by ~1e-5; a reused position computed wrongly moves it by far more."""

ANY_WEIGHTS_SHAPE = "llama3_scaling"
"""The shape whose server also runs bench any-weights' CPU checks (its model is the one that
command is given in tests/test_e2e_any_weights.py)."""
RECOMPUTE_SHAPES = ("qwen2_theta1e6", "qwen2_yarn", "llama_partial_rotary", ANY_WEIGHTS_SHAPE)
"""In the order the shape class runs them: :data:`ANY_WEIGHTS_SHAPE` last, so its batch still
runs when the any-weights class after it asks for it."""
UNKNOWN_CLASS_SHAPE = "olmo2_unknown_class"
RATIO = 0.3
RECOMPUTE_ENV = {
    "SEMBLEND_ENABLED": "1",
    "SEMBLEND_RECOMPUTE_STRATEGY": "deviation",
    "SEMBLEND_RECOMPUTE_RATIO": str(RATIO),
    "SEMBLEND_RECOMPUTE_CHECK_LAYER": "1",
    "SEMBLEND_RECOMPUTE_MIN_DEVIATION": "0",  # the budget is spent whatever the deviation
    "SEMBLEND_RECOMPUTE_CHECK_SHARE": "1",  # every copied position scored: a dense check
    # what bench any-weights' position_mask role adds (ROLE_ENV): no span's first tokens
    # recomputed unless selected; the mask pinned (torch_native's only sparse path)
    "SEMBLEND_SINK_TOKENS": "0",
    "SEMBLEND_SPARSE_PATH": "position_mask",
}


def _answer(
    url: str, ids: list[int], new_tokens: int = NEW_TOKENS, **custom: Any
) -> dict[str, Any]:
    """Greedy ``/generate`` of ``ids`` (``new_tokens``, EOS ignored, all of them asserted
    generated) with output logprobs and top logprobs; ``custom`` goes to
    ``sampling_params.custom_params`` (left out when empty)."""
    result = generate(
        url,
        ids,
        new_tokens,
        sampling={"ignore_eos": True},
        custom_params=custom or None,
        timeout=300,
        return_logprob=True,
        top_logprobs_num=TOP_LOGPROBS,
    )
    assert result["meta_info"]["completion_tokens"] == new_tokens, result["meta_info"]
    return result


def _top(answer: dict[str, Any], i: int) -> list[tuple[float, int]]:
    """(logprob, token id) of the top logprobs at output position ``i``, best first."""
    return [(float(lp), int(tok)) for lp, tok, *_ in answer["meta_info"]["output_top_logprobs"][i]]


def _top_by_token(answer: dict[str, Any], i: int) -> dict[int, float]:
    """Token id -> logprob of the top logprobs at output position ``i``."""
    return {tok: lp for lp, tok in _top(answer, i)}


def _assert_same_answer(got: dict[str, Any], want: dict[str, Any], what: str) -> None:
    """Greedy outputs agree: at each position the tokens are equal and every token in both top
    lists has the same logprob within LOGPROB_TOL. Tokens may part only where ``want``'s two best
    logprobs are within 2 * LOGPROB_TOL (a float near-tie); the comparison stops there, since
    later positions follow different prefixes."""
    got_ids, want_ids = got["output_ids"], want["output_ids"]
    assert len(got_ids) == len(want_ids) == NEW_TOKENS, (got_ids, want_ids)
    for i, (a, b) in enumerate(zip(got_ids, want_ids, strict=True)):
        got_top, want_top = _top_by_token(got, i), _top_by_token(want, i)
        shared = set(got_top) & set(want_top)
        assert shared, f"{what}: no common top token at output {i}: {got_top} vs {want_top}"
        worst = max(abs(got_top[t] - want_top[t]) for t in shared)
        assert worst <= LOGPROB_TOL, (
            f"{what}: top logprobs differ by {worst:.2e} at output {i}: {got_top} vs {want_top}"
        )
        if a != b:
            ranked = _top(want, i)
            gap = ranked[0][0] - ranked[1][0]
            assert gap <= 2 * LOGPROB_TOL, (
                f"{what}: output {i} is {a} against {b} (no near-tie: gap {gap:.2e}); "
                f"{got_ids} vs {want_ids}"
            )
            return


def _max_first_logprob_gap(a: dict[str, Any], b: dict[str, Any]) -> float:
    """Largest logprob difference over the tokens both answers rank in their first top list."""
    top_a, top_b = _top_by_token(a, 0), _top_by_token(b, 0)
    shared = set(top_a) & set(top_b)
    if not shared:
        return float("inf")
    return max(abs(top_a[t] - top_b[t]) for t in shared)


def _prompts(tokenizer: Any, essay_texts: list[str]) -> tuple[list[int], list[int], int]:
    """(donor prompt, target prompt, passage length): two instructions before one real essay
    passage of PASSAGE_TOKENS tokens."""

    def enc(text: str) -> list[int]:
        ids: list[int] = tokenizer.encode(text, add_special_tokens=False)
        return ids

    passage = enc(essay_texts[0])[:PASSAGE_TOKENS]
    assert len(passage) == PASSAGE_TOKENS
    return enc(DONOR_HEAD) + passage, enc(TARGET_HEAD) + passage, len(passage)


def _delta(after: dict[str, Any], before: dict[str, Any], key: str) -> float:
    return float(after.get(key, 0)) - float(before.get(key, 0))


def _outcome_delta(after: dict[str, Any], before: dict[str, Any], outcome: str) -> int:
    return int(after["outcomes"].get(outcome, 0)) - int(before["outcomes"].get(outcome, 0))


def _reuse_run(url: str, donor: list[int], target: list[int], **custom: Any) -> dict[str, Any]:
    """From an empty cache: the donor, then the target (with ``custom`` params). Returns the
    target's answer with the snapshot deltas of the target alone under ``"semblend"``."""
    flush_cache(url)
    _answer(url, donor, new_tokens=1)  # only its prompt's KV matters
    before = semblend_totals(url)
    answer = _answer(url, target, **custom)
    after = semblend_totals(url)
    answer["semblend"] = {
        "materialized": _outcome_delta(after, before, "materialized"),
        "reused_tokens": _delta(after, before, "reused_tokens"),
        "recomputed_tokens": _delta(after, before, "recomputed_tokens"),
        # reused_tokens counts the positions whose donor KV was kept (docs/bench.md); the
        # positions copied from the donor are those plus the recomputed ones.
        "copied_tokens": _delta(after, before, "reused_tokens")
        + _delta(after, before, "recomputed_tokens"),
        "declined": {k: v - before["declined"].get(k, 0) for k, v in after["declined"].items()},
        "has_recomputed_field": "recomputed_tokens" in after,
    }
    return answer


def _cold_run(url: str, target: list[int]) -> dict[str, Any]:
    """The target from an empty cache and no donor."""
    flush_cache(url)
    return _answer(url, target)


FULL_RATIO = {
    "recompute_strategy": "deviation",
    "recompute_ratio": 1,
    "recompute_min_deviation": 0,
    "recompute_check_share": 1,
}
"""The repair settings (``custom_params.semblend_reuse``) of a request on the real SmolLM2 that
recomputes every reused position: RECOMPUTE_ENV's at ratio 1 (the check layer, 1, is the
server's default)."""


@pytest.fixture(scope="module")
def recompute_servers(
    smollm2_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerBatches]:
    """The module's servers in the order its classes use them (each RoPE shape, the Olmo2
    model), started :data:`SERVER_BATCH` at a time."""
    logs = tmp_path_factory.mktemp("recompute-models")
    specs = {
        name: ServerSpec(
            build_random_model(SHAPES[name], smollm2_model_dir),
            env=RECOMPUTE_ENV,
            log_path=logs / f"{name}.log",
        )
        for name in (*RECOMPUTE_SHAPES, UNKNOWN_CLASS_SHAPE)
    }
    batches = ServerBatches(specs, SERVER_BATCH)
    try:
        yield batches
    finally:
        batches.stop()


@pytest.fixture(scope="class", params=RECOMPUTE_SHAPES)
def shape_server(request: pytest.FixtureRequest, recompute_servers: ServerBatches) -> SglangServer:
    """The real server on the random model of one shape, recompute env set."""
    return recompute_servers.server(request.param)


@pytest.fixture(scope="class")
def unknown_server(recompute_servers: ServerBatches) -> SglangServer:
    """The real server on the random Olmo2 model, recompute env set."""
    return recompute_servers.server(UNKNOWN_CLASS_SHAPE)


class TestRecomputeOnEachRopeShape:
    """Strategy deviation at ratio 0.3 on a random model of each RoPE shape."""

    def test_target_with_another_instruction_reuses_the_shared_passage_kv(
        self, shape_server: SglangServer, smollm2_tokenizer: Any, essay_texts: list[str]
    ) -> None:
        """The target materializes reuse of most of the donor's passage on this model shape
        (copied from the donor, whether recomputed later or kept)."""
        donor, target, passage = _prompts(smollm2_tokenizer, essay_texts)
        got = _reuse_run(shape_server.url, donor, target)["semblend"]
        assert got["materialized"] == 1, got
        assert got["copied_tokens"] > passage // 2 and got["reused_tokens"] > 0, got

    def test_sparse_recompute_answers_like_the_dense_reference(
        self, shape_server: SglangServer, smollm2_tokenizer: Any, essay_texts: list[str]
    ) -> None:
        """With 30% of the reused positions recomputed, the one-pass sparse extend gives the
        dense reference's answer (same recomputed set), and both differ from a cold run (the
        comparison is not between two cold runs)."""
        donor, target, passage = _prompts(smollm2_tokenizer, essay_texts)
        url = shape_server.url
        sparse = _reuse_run(url, donor, target)
        stats = sparse["semblend"]
        assert stats["materialized"] == 1, stats
        assert stats["has_recomputed_field"], "snapshot total has no recomputed_tokens"
        assert stats["copied_tokens"] > passage // 2, stats
        # the budget: RATIO of the copied positions, rounded
        assert abs(stats["recomputed_tokens"] - RATIO * stats["copied_tokens"]) < 1, stats
        reference = _reuse_run(url, donor, target, semblend_dense_reference=True)
        for key in ("materialized", "copied_tokens", "recomputed_tokens"):
            assert reference["semblend"][key] == stats[key], (key, reference["semblend"], stats)
        _assert_same_answer(sparse, reference, "sparse vs dense reference")
        cold = _cold_run(url, target)
        assert _max_first_logprob_gap(reference, cold) > 10 * LOGPROB_TOL, (
            "the dense reference answers like a cold run: no donor K/V was used",
            reference["output_ids"],
            cold["output_ids"],
        )


class TestAnyWeightsChecksOnTheLlama3ScalingServer:
    """bench any-weights' ``recompute_all``, ``delta_zero`` and position-mask checks
    (``semblend_sglang.bench.any_weights.run_checks``, the command's own code) against this
    module's :data:`ANY_WEIGHTS_SHAPE` server, whose settings hold those roles' (``ROLE_ENV``):
    no server of their own. The command starting its servers: tests/test_e2e_any_weights.py."""

    def test_recompute_all_delta_zero_and_the_mask_hold_on_the_cpu_server(
        self, recompute_servers: ServerBatches, smollm2_model_dir: Path
    ) -> None:
        from transformers import AutoTokenizer

        from semblend_sglang.bench.any_weights import ROLE_ENV, build_prompts, run_checks
        from semblend_sglang.data import essay_texts as load_essays

        roles = ("recompute_all", "delta_zero", "position_mask")
        assert all(ROLE_ENV[r].items() <= RECOMPUTE_ENV.items() for r in roles)
        url = recompute_servers.server(ANY_WEIGHTS_SHAPE).url
        model = build_random_model(SHAPES[ANY_WEIGHTS_SHAPE], smollm2_model_dir)
        tokenizer = AutoTokenizer.from_pretrained(model)
        prompts = build_prompts(tokenizer, max(load_essays(), key=len), 900)  # its defaults
        tol = 2e-3
        checks = run_checks({r: url for r in roles}, prompts, len(tokenizer), tol)
        results = {c.name: c for c in checks}
        assert set(results) == {"recompute_all", "delta_zero", "paths"}
        assert all(c.passed for c in checks), [(c.name, c.detail) for c in checks]
        every = results["recompute_all"].detail
        assert every["materialized"] == 1 and every["kept_tokens"] == 0
        assert every["gap_to_cold"] <= tol
        same = results["delta_zero"].detail
        assert same["again_materialized"] == 1 and same["same_ids"] and same["gap_to_first"] <= tol
        mask = results["paths"].detail["position_mask"]
        assert mask["batches_on_path"] >= 1 and mask["gap_to_dense_reference"] <= tol
        assert mask["control_gap_dense_to_cold"] > 10 * tol


class TestUnknownModelClass:
    """A model class the layer hook does not know, with the recompute budget on."""

    def test_unknown_model_class_declines_with_one_log_line_and_answers_cold(
        self, unknown_server: SglangServer, smollm2_tokenizer: Any, essay_texts: list[str]
    ) -> None:
        """Every plan is declined as unsupported_model (no KV reused), the answer is the cold
        one, and the server log names the class in exactly one semblend line after two plans."""
        donor, target, _ = _prompts(smollm2_tokenizer, essay_texts)
        url = unknown_server.url
        architecture = SHAPES[UNKNOWN_CLASS_SHAPE].architecture
        for _ in range(2):
            got = _reuse_run(url, donor, target)
            stats = got["semblend"]
            assert stats["declined"].get("unsupported_model") == 1, stats
            assert stats["materialized"] == 0 and stats["copied_tokens"] == 0, stats
        cold = _cold_run(url, target)
        _assert_same_answer(got, cold, "declined target vs cold")
        assert unknown_server.log_path is not None
        lines = [
            line
            for line in unknown_server.log_path.read_text(errors="replace").splitlines()
            if architecture in line and "semblend" in line.lower()
        ]
        assert len(lines) == 1, lines


class TestFullRecomputeRatio:
    """Requests at recompute ratio 1 (:data:`FULL_RATIO`) to the session's shared SmolLM2
    server (tests/conftest.py ``semblend_server``)."""

    def test_full_recompute_ratio_answers_like_a_cold_run(
        self, semblend_server: SglangServer, smollm2_tokenizer: Any, essay_texts: list[str]
    ) -> None:
        """A target that plans reuse of the donor's passage but recomputes all of it gives the
        cold run's greedy tokens and top logprobs; every copied position is counted recomputed,
        none reused."""
        donor, target, passage = _prompts(smollm2_tokenizer, essay_texts)
        url = semblend_server.url
        got = _reuse_run(url, donor, target, semblend_reuse=FULL_RATIO)
        stats = got["semblend"]
        assert stats["materialized"] == 1, stats
        assert stats["copied_tokens"] > passage // 2, stats
        assert stats["recomputed_tokens"] == stats["copied_tokens"], stats
        cold = _cold_run(url, target)
        _assert_same_answer(got, cold, "full recompute vs cold")
