"""SGLang's own server conformance kits (``sglang/test/kits``, shipped in the 0.5.23 wheel) run
against the session's shared semblend server (tests/conftest.py ``semblend_server``, default
settings) and, where semblend could change what a kit checks, against the shared vanilla server
(``vanilla_server``) too, each outcome compared.

Run here: ``basic_api_contract_kit`` and ``matched_stop_kit`` (semblend),
``basic_decode_correctness_kit`` (both: SmolLM2-135M fails some of its probes on vanilla SGLang
too, so the test is that every probe ends alike), ``abort_timeout_kit.AbortAllMixin`` (both),
``cache_hit_kit.run_multiturn_cache_hit_test`` (semblend: SGLang's per-round expected
``cached_tokens`` hold with semblend on; its prompts come from a ShareGPT-format file of the
real essays, the kit would otherwise download ShareGPT) and
``radix_cache_server_kit.run_radix_attention_test`` (semblend, on a 60-node tree of the kit's
own generator: the kit's 400 nodes take too long on 2 cores).

Not run here, with the reason: ``abort_timeout_kit``'s waiting and running timeouts (they need
``SGLANG_REQ_WAITING_TIMEOUT`` and ``--max-running-requests 1``, a server of their own);
``basic_scheduler_stress_kit`` (minutes of concurrent decode on 2 cores);
``prefix_cache_branching_kit`` (it expects the chunked cache of hybrid models: with page size 1
the second request is an exact hit); ``streaming_session_kit`` (streaming sessions are never
planned: ``request_info.eligible``); ``unified_radix_cache_kit`` and ``kl_divergence_kit``
(GSM8K and model downloads).
"""

from __future__ import annotations

import json
import unittest
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from semblend_sglang.server import SglangServer
from tests.harness.server import semblend_totals

pytestmark = pytest.mark.e2e


def run_kit(mixin: type, server: SglangServer, **attrs: Any) -> dict[str, str]:
    """Every ``test_*`` method of the kit ``mixin`` run as a unittest case against ``server``
    (``base_url``, ``process`` and ``attrs`` as class attributes, as SGLang's own test classes
    set them): test name -> ``"passed"``, ``"skipped"`` or the last line of its failure."""
    case = type(
        f"Kit{mixin.__name__}",
        (mixin, unittest.TestCase),
        {"base_url": server.url, "process": server.process, **attrs},
    )
    suite = unittest.defaultTestLoader.loadTestsFromTestCase(case)
    outcomes = {test.id().rsplit(".", 1)[-1]: "passed" for test in suite}
    result = unittest.TestResult()
    suite.run(result)  # the suite drops each test once it ran
    for test, trace in (*result.failures, *result.errors):
        outcomes[test.id().rsplit(".", 1)[-1]] = trace.strip().splitlines()[-1]
    for test, _reason in result.skipped:
        outcomes[test.id().rsplit(".", 1)[-1]] = "skipped"
    assert outcomes, f"{mixin.__name__} has no test"
    return outcomes


def _assert_alike(semblend: Mapping[str, str], vanilla: Mapping[str, str]) -> None:
    """Each probe passed on both servers, or failed on both (the model's limit, not ours)."""
    differ = {
        name: (semblend[name], vanilla[name])
        for name in semblend
        if (semblend[name] == "passed") != (vanilla[name] == "passed")
    }
    assert not differ, differ


def test_the_api_contract_kit_passes_with_semblend_on(semblend_server: SglangServer) -> None:
    from sglang.test.kits.basic_api_contract_kit import BasicAPIContractMixin

    outcomes = run_kit(BasicAPIContractMixin, semblend_server)
    assert set(outcomes.values()) == {"passed"}, outcomes


def test_the_decode_correctness_kit_ends_each_probe_as_on_vanilla(
    semblend_server: SglangServer, vanilla_server: SglangServer
) -> None:
    from sglang.test.kits.basic_decode_correctness_kit import BasicDecodeCorrectnessMixin

    semblend = run_kit(BasicDecodeCorrectnessMixin, semblend_server)
    vanilla = run_kit(BasicDecodeCorrectnessMixin, vanilla_server)
    _assert_alike(semblend, vanilla)
    assert "passed" in semblend.values()  # the kit ran: some probes pass on this model


def test_the_matched_stop_kit_passes_with_semblend_on(semblend_server: SglangServer) -> None:
    """Finish reasons and matched stops (length, EOS, stop strings, stop regex): the kit's own
    expectations. (Not on the shared vanilla server: its 1,024-token context refuses the kit's
    longest ``max_tokens``.)"""
    from sglang.test.kits.matched_stop_kit import MatchedStopMixin

    outcomes = run_kit(MatchedStopMixin, semblend_server, model="default")
    assert set(outcomes.values()) == {"passed"}, outcomes


def test_the_abort_all_kit_passes_on_both(
    semblend_server: SglangServer, vanilla_server: SglangServer
) -> None:
    """32 decodes aborted by ``/abort_request`` ``abort_all`` after 2 s each end as aborts and
    the server lives (the kit's 16,000 new tokens exceed SmolLM2's context: 512 here)."""
    from sglang.test.kits.abort_timeout_kit import AbortAllMixin

    for server in (semblend_server, vanilla_server):
        outcomes = run_kit(AbortAllMixin, server, abort_all_max_new_tokens=512)
        assert outcomes == {"test_abort_all": "passed"}, (server.url, outcomes)


@pytest.fixture(scope="module")
def sharegpt_essays(tmp_path_factory: pytest.TempPathFactory, essay_texts: list[str]) -> Path:
    """The real essays as a ShareGPT-format file (two turns each: an essay's first and second
    halves), the dataset SGLang's random-request sampler reads prompts from."""
    rows = [
        {
            "conversations": [
                {"from": "human", "value": text[: len(text) // 2]},
                {"from": "gpt", "value": text[len(text) // 2 :]},
            ]
        }
        for text in essay_texts
    ]
    path = tmp_path_factory.mktemp("sharegpt") / "essays.json"
    path.write_text(json.dumps(rows))
    return path


def test_the_multiturn_cache_hit_kit_sees_sglangs_exact_hits_with_semblend_on(
    semblend_server: SglangServer, smollm2_model_dir: Path, sharegpt_essays: Path
) -> None:
    """SGLang's own expectation per round: round 0 cached 0 after its flush, every later round
    at least the previous round's prompt and output (the kit asserts it); semblend changes no
    client-visible ``cached_tokens``."""
    from sglang.test.kits.cache_hit_kit import run_multiturn_cache_hit_test

    before = semblend_totals(semblend_server.url)
    result = run_multiturn_cache_hit_test(
        semblend_server.url,
        str(smollm2_model_dir),
        num_clients=4,
        num_rounds=3,
        request_length=256,
        output_length=16,
        dataset_path=str(sharegpt_essays),
    )
    assert result["rounds"]["round_0"]["cache_hit_rate"] == 0.0
    assert result["rounds"]["round_2"]["cache_hit_rate"] > 0.5
    after = semblend_totals(semblend_server.url)
    assert after["requests"] - before["requests"] >= 12  # every request went through semblend


def test_the_radix_attention_kit_serves_a_random_radix_tree_with_semblend_on(
    semblend_server: SglangServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One batch of requests along a random radix tree of repeated-token prompts (the kit's
    generator, 60 nodes of up to 64 unique tokens): answered with status 200, and the server
    keeps serving."""
    import random

    from sglang.test.kits import radix_cache_server_kit as kit
    from sglang.test.kits.basic_api_contract_kit import BasicAPIContractMixin

    generate_tree = kit.gen_radix_tree
    monkeypatch.setattr(kit, "gen_radix_tree", lambda: generate_tree(num_nodes=60, chunk_len=64))
    random.seed(0)
    kit.run_radix_attention_test(semblend_server.url)
    assert semblend_server.alive()
    assert run_kit(BasicAPIContractMixin, semblend_server)["test_health_generate"] == "passed"
