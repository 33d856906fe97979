"""Two semblend SGLang servers behind a real SMG gateway (``smg launch``, smg 1.13.0 from PyPI):
donor-aware placement through SMG's routing key keeps the single-instance hit rate where SMG's
round-robin loses it, and a stopped instance fails no request (docs/scale-out.md).

Real servers (SmolLM2 on CPU), real SMG, real essay workloads at 512 tokens; hits are
server-confirmed (semblend's ``materialized`` count on the instance that served the probe);
which instance served a request is SMG's ``x-smg-routed-worker-id`` answer header.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from semblend_sglang.bench.builtin_workloads import build_workload
from semblend_sglang.bench.gateway import (
    GATEWAY_POLICY,
    NAMESPACE,
    flush_all,
    run_placement,
    send,
    sending_order,
)
from semblend_sglang.bench.smg_process import GATEWAY_BIND_FAILURE, GatewayError, start_gateway
from semblend_sglang.bench.workloads import Workload
from semblend_sglang.routing_keys import DonorRoutingKeys

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def instances(semblend_server: Any, semblend_at_the_context: Any) -> list[Any]:
    """The session's two semblend servers at default settings (tests/conftest.py): the shared
    one and the one at a 1,024-token context (the fault test stops it; nothing after this
    module uses it)."""
    assert semblend_at_the_context.alive()
    return [semblend_server, semblend_at_the_context]


@pytest.fixture(scope="module")
def workload(smollm2_tokenizer: Any, essay_texts: list[str]) -> Workload:
    return build_workload("cross_instruction", smollm2_tokenizer, essay_texts, 512, 4, seed=3)


def test_donor_aware_keeps_the_single_instance_hit_rate_behind_smg(
    instances: Any, workload: Workload, tmp_path: Path
) -> None:
    urls = [s.url for s in instances]
    flush_all(urls)
    single = run_placement("single_instance", urls[0], urls, workload, None)
    assert single.probes == 4 and single.hit_rate == 1.0, single
    results = {}
    for placement in ("round_robin", "donor_aware"):
        flush_all(urls)
        gateway = start_gateway(urls, GATEWAY_POLICY[placement], tmp_path / f"{placement}.log")
        try:
            keys = DonorRoutingKeys() if placement == "donor_aware" else None
            results[placement] = run_placement(placement, gateway.url, urls, workload, keys)
        finally:
            gateway.stop()
    donor, rr = results["donor_aware"], results["round_robin"]
    assert donor.failed == rr.failed == 0
    assert donor.hit_rate >= 0.9 * single.hit_rate, donor
    where: dict[str, set[str | None]] = {}
    for group_id, _, worker in donor.served:
        where.setdefault(group_id, set()).add(worker)
    assert all(len(workers) == 1 for workers in where.values()), where  # a group, one instance
    assert sorted(donor.per_instance.values()) == [4, 4]  # new keys placed round-robin


def test_a_taken_gateway_port_starts_smg_again_on_another(
    instances: Any, workload: Workload, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """SMG given a port another socket holds exits naming it; start_gateway starts it again on
    another port, routes through it, and keeps the failed start's output in the log."""
    import semblend_sglang.server as server_module
    from tests.harness.server import taken_port

    urls = [s.url for s in instances]
    real_free_port = server_module.free_port
    with taken_port() as port:
        given = iter([port])
        monkeypatch.setattr(server_module, "free_port", lambda: next(given, 0) or real_free_port())
        log = tmp_path / "taken.log"
        gateway = start_gateway(urls, GATEWAY_POLICY["round_robin"], log)
        try:
            assert not gateway.url.endswith(f":{port}")
            assert gateway.process.poll() is None
            _, request = sending_order(workload)[0]
            sent = send(gateway.url, request, urls)
            assert sent.status == 200 and sent.worker in urls, sent
        finally:
            gateway.stop()
    text = log.read_text(errors="replace")
    assert f"127.0.0.1:{port}: {GATEWAY_BIND_FAILURE}" in text, text[-2000:]


def test_a_failure_other_than_a_taken_port_is_not_retried(tmp_path: Path) -> None:
    """SMG refusing its arguments fails start_gateway at once, started once: only a taken port
    is worth another start."""
    log = tmp_path / "bad.log"
    with pytest.raises(GatewayError, match="did not become ready"):
        start_gateway(["http://127.0.0.1:1"], ("--policy", "no_such_policy"), log, timeout=60)
    text = log.read_text(errors="replace")
    assert text.count("invalid choice: 'no_such_policy'") == 1, text[-2000:]


def test_a_stopped_instance_fails_no_request_and_its_keys_move(
    instances: Any, workload: Workload, tmp_path: Path
) -> None:
    """The last test of the module: it stops instance 1. Donors go through SMG; instance 1 is
    stopped; every probe is still answered (those keyed to instance 1 cold, on instance 0)."""
    urls = [s.url for s in instances]
    flush_all(urls)
    gateway = start_gateway(urls, GATEWAY_POLICY["donor_aware"], tmp_path / "fault.log")
    try:
        keys = DonorRoutingKeys()
        order = [request for _, request in sending_order(workload)]
        donors = [r for r in order if r.role == "donor"]
        probes = [r for r in order if r.role == "probe"]
        served = []
        for request in donors:
            choice = keys.choose(request.prompt_ids, NAMESPACE)
            sent = send(gateway.url, request, urls, choice.headers)
            assert sent.status == 200
            keys.record(choice, request.prompt_ids, NAMESPACE, sent.worker)
            served.append(sent.worker)
        assert set(served) == set(urls)  # both instances hold donors
        instances[1].stop()
        after = []
        for request in probes:
            choice = keys.choose(request.prompt_ids, NAMESPACE)
            sent = send(gateway.url, request, urls[:1], choice.headers)
            assert sent.status == 200, f"a request failed while instance 1 was down: {sent}"
            keys.record(choice, request.prompt_ids, NAMESPACE, sent.worker)
            after.append((sent.worker, sent.hit))
        assert all(worker == urls[0] for worker, _ in after), after
        # probes whose donor was on instance 0 still reuse it; the moved keys went cold
        assert sum(hit for _, hit in after) == served.count(urls[0])
        assert keys.moved_keys == served.count(urls[1])
    finally:
        gateway.stop()
