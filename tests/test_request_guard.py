"""The request guard (patches/sglang/engine/request_guard.py) on the real sglang 0.5.23 classes: its
rule, the tokenizer manager's seam (a bad prompt raises ValueError, SGLang's 400, before the
scheduler) and the scheduler's (a bad prompt becomes SGLang's own abort), each shown to fail
without the guard. The real server under bad input, where the plugin installs the guard when
SGLang's HTTP server imports the tokenizer manager: tests/test_e2e_bad_input.py."""

from __future__ import annotations

from array import array
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest

from semblend_sglang.patches.sglang.engine.request_guard import (
    install_request_guard,
    prompt_error,
    remove_request_guard,
    request_error,
    top_logprobs_error,
)
from semblend_sglang.patches.sglang.request_info import REUSE_PARAM, reuse_value_error

VOCAB = 49152
"""SmolLM2's vocabulary (the embedding's rows)."""


def test_prompt_error_accepts_every_id_in_the_vocabulary() -> None:
    assert prompt_error([0], VOCAB) is None
    assert prompt_error([VOCAB - 1, 5, 0], VOCAB) is None
    assert prompt_error(array("q", [1, 2, 3]), VOCAB) is None
    assert prompt_error(None, VOCAB) is None  # input embeddings: no ids to check


@pytest.mark.parametrize(
    ("ids", "needle"),
    [
        ([], "no tokens"),
        ([1, 2, VOCAB], f"Token id {VOCAB} at position 2"),
        ([1, -5, 3], "Token id -5 at position 1"),
        ([10**9], "Token id 1000000000 at position 0"),
    ],
)
def test_prompt_error_names_what_is_wrong(ids: list[int], needle: str) -> None:
    error = prompt_error(ids, VOCAB)
    assert error is not None and needle in error
    if ids:
        assert f"0 to {VOCAB - 1}" in error


def test_prompt_error_without_a_vocabulary_checks_only_emptiness() -> None:
    assert prompt_error([-1, 10**9], None) is None
    assert prompt_error([], None) is not None


def test_top_logprobs_error_refuses_more_than_the_vocabulary_when_logprobs_are_returned() -> None:
    assert top_logprobs_error(True, VOCAB, VOCAB) is None
    assert top_logprobs_error(True, 20, VOCAB) is None
    assert top_logprobs_error(False, 10**7, VOCAB) is None  # not computed without logprobs
    error = top_logprobs_error(True, VOCAB + 1, VOCAB)
    assert error is not None and f"top_logprobs_num {VOCAB + 1}" in error
    assert top_logprobs_error(True, 10**7, None) is None


def test_request_error_reports_the_prompt_first() -> None:
    assert request_error([], VOCAB, True, 10**7) == prompt_error([], VOCAB)
    assert request_error([1], VOCAB, True, 10**7) == top_logprobs_error(True, 10**7, VOCAB)
    assert request_error([1], VOCAB, True, 5) is None


@pytest.mark.parametrize("value", [True, False, "on", "off"])
def test_reuse_value_error_accepts_the_documented_values(value: Any) -> None:
    assert reuse_value_error({REUSE_PARAM: value}) is None


@pytest.mark.parametrize("value", [5, None, "yes", "OFF", 0, 1, [False]])
def test_reuse_value_error_refuses_every_other_value(value: Any) -> None:
    error = reuse_value_error({REUSE_PARAM: value})
    assert error is not None and REUSE_PARAM in error and repr(value)[:20] in error


@pytest.mark.parametrize(
    ("value", "named"),
    [
        ({"x": 1}, "semblend_reuse.x"),
        ({"preset": "fastest"}, "semblend_reuse.preset"),
        ({"recompute_ratio": 2}, "semblend_reuse.recompute_ratio"),
        ({"recompute_strategy": "all"}, "semblend_reuse.recompute_strategy"),
        ({"recompute_check_layer": 3}, "a server setting"),
        ({"max_spans": 3}, "a server setting"),
    ],
)
def test_reuse_value_error_names_the_bad_key_of_an_object(value: Any, named: str) -> None:
    error = reuse_value_error({REUSE_PARAM: value})
    assert error is not None and named in error


@pytest.mark.parametrize(
    "value", [{}, {"preset": "fast"}, {"recompute_ratio": 0.3, "quality_gate": 0.1}]
)
def test_reuse_value_error_accepts_an_object_of_repair_settings(value: Any) -> None:
    assert reuse_value_error({REUSE_PARAM: value}) is None


def test_reuse_value_error_ignores_absent_keys_and_other_params() -> None:
    assert reuse_value_error(None) is None
    assert reuse_value_error({"other": 5}) is None
    assert reuse_value_error("not a dict") is None


@pytest.fixture
def guard(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[Any]]:
    """The guard installed on this process's sglang modules, removed after. SGLang's own
    ``_validate_one_request`` is replaced by a recorder first (it needs a running server's
    configuration): the guard wraps whatever is there, so the recorder shows which requests it
    passed on. Yields the recorder's calls (request, ids)."""
    import sglang.srt.managers.scheduler  # noqa: F401
    from sglang.srt.managers.tokenizer_manager import TokenizerManager

    calls: list[Any] = []

    def sglangs_checks(self: Any, obj: Any, input_ids: Any) -> None:
        calls.append((obj, input_ids))

    remove_request_guard()
    monkeypatch.setattr(TokenizerManager, "_validate_one_request", sglangs_checks)
    assert install_request_guard({})
    yield calls
    remove_request_guard()


def _generate_obj(**fields: Any) -> Any:
    from sglang.srt.managers.io_struct import GenerateReqInput

    fields.setdefault("sampling_params", {"max_new_tokens": 4})
    return GenerateReqInput(**fields)


def _manager() -> Any:
    """An object with what the guard reads of a TokenizerManager: its model's vocabulary."""
    return SimpleNamespace(model_config=SimpleNamespace(vocab_size=VOCAB))


@pytest.mark.parametrize(
    ("fields", "ids", "needle"),
    [
        ({"text": ""}, [], "no tokens"),
        ({"input_ids": [1, VOCAB + 7]}, [1, VOCAB + 7], f"Token id {VOCAB + 7}"),
        ({"input_ids": [-3, 1]}, [-3, 1], "Token id -3"),
        (
            {
                "text": "hi",
                "sampling_params": {"max_new_tokens": 2, "custom_params": {REUSE_PARAM: 5}},
            },
            [1, 2],
            REUSE_PARAM,
        ),
        (
            {"input_ids": [1, 2], "return_logprob": True, "top_logprobs_num": 10**7},
            [1, 2],
            "top_logprobs_num 10000000",
        ),
    ],
)
def test_tokenizer_manager_refuses_a_bad_request_before_sglangs_own_checks(
    guard: list[Any], fields: dict[str, Any], ids: list[int], needle: str
) -> None:
    from sglang.srt.managers.tokenizer_manager import TokenizerManager

    with pytest.raises(ValueError) as caught:
        TokenizerManager._validate_one_request(_manager(), _generate_obj(**fields), ids)
    assert needle in str(caught.value)
    assert guard == []


def test_tokenizer_manager_passes_a_good_request_on_to_sglangs_checks(
    guard: list[Any],
) -> None:
    from sglang.srt.managers.tokenizer_manager import TokenizerManager

    obj = _generate_obj(
        text="hi", sampling_params={"max_new_tokens": 2, "custom_params": {REUSE_PARAM: "off"}}
    )
    TokenizerManager._validate_one_request(_manager(), obj, [0, VOCAB - 1])
    assert guard == [(obj, [0, VOCAB - 1])]


def test_tokenizer_manager_lets_a_session_continue_with_no_new_tokens(
    guard: list[Any],
) -> None:
    """An empty prompt is SGLang's business inside a session: the history supplies it."""
    from sglang.srt.managers.tokenizer_manager import TokenizerManager

    obj = _generate_obj(input_ids=[], session_params={"id": "s1"})
    TokenizerManager._validate_one_request(_manager(), obj, [])
    assert guard == [(obj, [])]


def test_without_the_guard_sglang_accepts_an_empty_prompt_and_foreign_ids() -> None:
    """What the guard is for: SGLang 0.5.23's own checks pass both kinds of prompt that crash
    its scheduler. Run on a real TokenizerManager-shaped object with SGLang's own method."""
    import sglang.srt.managers.scheduler as scheduler_module
    from sglang.srt.managers.tokenizer_manager import TokenizerManager

    remove_request_guard()
    assert not hasattr(TokenizerManager._validate_one_request, "__wrapped__")
    assert not hasattr(scheduler_module.validate_input_length, "__wrapped__")
    for req in (_req([]), _req([1, -5, VOCAB + 1]), _req([1], top_logprobs_num=10**7)):
        assert scheduler_module.validate_input_length(req, 8192, False) is None


def _req(ids: list[int], top_logprobs_num: int = 0) -> Any:
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_new_tokens=4)
    params.normalize(None)
    return Req(
        rid="guard-test",
        origin_input_text="",
        origin_input_ids=array("q", ids),
        sampling_params=params,
        return_logprob=top_logprobs_num > 0,
        top_logprobs_num=top_logprobs_num,
        vocab_size=VOCAB,
    )


@pytest.mark.parametrize(
    ("ids", "needle"), [([], "no tokens"), ([1, VOCAB], f"Token id {VOCAB}"), ([-1], "-1")]
)
def test_scheduler_turns_a_bad_prompt_into_sglangs_abort(
    guard: list[Any], ids: list[int], needle: str
) -> None:
    """The scheduler calls ``validate_input_length`` by its module's name for every request it
    receives (generation and embedding); a message it returns aborts the request with 400."""
    import sglang.srt.managers.scheduler as scheduler_module

    error = scheduler_module.validate_input_length(_req(ids), 8192, False)
    assert error is not None and needle in error


def test_scheduler_turns_too_many_top_logprobs_into_sglangs_abort(guard: list[Any]) -> None:
    import sglang.srt.managers.scheduler as scheduler_module

    error = scheduler_module.validate_input_length(_req([1, 2], 10**7), 8192, False)
    assert error is not None and "top_logprobs_num" in error
    assert scheduler_module.validate_input_length(_req([1, 2], 20), 8192, False) is None


def test_scheduler_keeps_sglangs_own_length_check(guard: list[Any]) -> None:
    import sglang.srt.managers.scheduler as scheduler_module

    assert scheduler_module.validate_input_length(_req([1, 2, 3]), 8192, False) is None
    too_long = scheduler_module.validate_input_length(_req([1] * 20), 10, False)
    assert too_long is not None and "exceeds the maximum allowed length" in too_long


def test_guard_is_off_with_its_switch() -> None:
    from sglang.srt.managers.tokenizer_manager import TokenizerManager

    remove_request_guard()
    assert not install_request_guard({"SEMBLEND_REQUEST_GUARD": "0"})
    assert not hasattr(TokenizerManager._validate_one_request, "__wrapped__")
