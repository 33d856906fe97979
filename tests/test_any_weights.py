"""The any-weights checks' pure parts (semblend_sglang.bench.any_weights) and the essay joining
that lets the e2e job build prompts longer than any one essay, with SmolLM2's real tokenizer."""

from __future__ import annotations

from typing import Any

import pytest

from semblend_sglang.bench.any_weights import (
    DELTA_ZERO,
    PROBE_COUNT,
    RECOMPUTE_ALL,
    ROLE_ENV,
    Answer,
    build_prompts,
    gap,
    probe_ids,
)
from semblend_sglang.bench.essay_pool import EssayPool, EssaysTooShort, joined_essays
from semblend_sglang.config import Config


def test_prompts_put_the_passage_at_another_position_and_at_the_same_one(
    smollm2_tokenizer: Any, essay_texts: list[str]
) -> None:
    prompts = build_prompts(smollm2_tokenizer, essay_texts[3], 400)
    doc = prompts.donor[prompts.head_tokens :]
    assert len(doc) == 400
    at = next(i for i in range(len(prompts.target)) if prompts.target[i : i + 400] == doc)
    assert at != prompts.head_tokens  # the target's spans move (delta != 0)
    same = prompts.same_positions
    assert same[prompts.head_tokens : prompts.head_tokens + 400] == doc  # delta 0
    assert same[0] != prompts.donor[0]  # no exact prefix hit of the donor
    with pytest.raises(ValueError, match="fewer than"):
        build_prompts(smollm2_tokenizer, "a short passage", 400)


def test_probe_ids_are_distinct_and_inside_the_vocabulary() -> None:
    ids = probe_ids(49152)
    assert len(ids) == PROBE_COUNT == len(set(ids)) and max(ids) < 49152
    assert probe_ids(10) == list(range(10))


def test_gap_is_the_largest_first_token_difference() -> None:
    a = Answer([1], [-1.0], [-1.0, -2.0, -3.0], 0)
    b = Answer([2], [-9.0], [-1.0, -2.5, -2.9], 0)
    assert gap(a, b) == pytest.approx(0.5)
    assert gap(a, a) == 0.0


def test_every_role_is_valid_settings() -> None:
    for env in ROLE_ENV.values():
        Config.from_env(env)
    assert Config.from_env(ROLE_ENV["split_view"]).sparse_path == "split_view"
    assert Config.from_env(ROLE_ENV["delta_zero"]).sink_tokens == 0


def test_the_checks_repair_settings_resolve_on_their_shared_server() -> None:
    """recompute_all and delta_zero share the position_mask server: their requests' settings
    (what the request guard and the scheduler resolve) give ratio 1, and heads at ratio 0 over
    the server's sink 0: nothing recomputed."""
    from semblend_sglang.request_settings import resolve

    assert ROLE_ENV["recompute_all"] == ROLE_ENV["delta_zero"] == ROLE_ENV["position_mask"]
    server = Config.from_env(ROLE_ENV["delta_zero"])
    every = resolve(RECOMPUTE_ALL, server)
    none = resolve(DELTA_ZERO, server)
    assert every is not None and none is not None
    assert every.config.recompute_ratio == 1.0 and every.config.sparse_path == "position_mask"
    assert (none.config.recompute_strategy, none.config.recompute_ratio) == ("heads", 0.0)
    assert none.config.sink_tokens == 0 and none.label == "custom"
    with pytest.raises(ValueError):
        Config.from_env({"SEMBLEND_SPARSE_PATH": "dense"})


def test_joined_essays_hold_a_slice_longer_than_any_essay(
    smollm2_tokenizer: Any, essay_texts: list[str]
) -> None:
    import random

    longest = max(len(smollm2_tokenizer.encode(t, add_special_tokens=False)) for t in essay_texts)
    want = longest + 1000
    with pytest.raises(EssaysTooShort):
        EssayPool(smollm2_tokenizer, essay_texts, random.Random(0)).take(want)
    joined = joined_essays(smollm2_tokenizer, essay_texts, want + 64)
    assert "\n\n".join(joined) == "\n\n".join(essay_texts)  # nothing lost, order kept
    piece = EssayPool(smollm2_tokenizer, joined, random.Random(0)).take(want)
    assert len(piece.ids) == want
    with pytest.raises(ValueError, match="fewer than"):
        joined_essays(smollm2_tokenizer, essay_texts[:1], 10**7)
