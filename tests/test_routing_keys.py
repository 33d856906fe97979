"""DonorRoutingKeys (semblend_sglang.routing_keys): the SMG routing key a client sends, chosen
from its own earlier requests, over the built-in workloads' real essay prompts (no server)."""

from __future__ import annotations

from typing import Any

import pytest

from semblend_sglang.bench.builtin_workloads import build_workload
from semblend_sglang.bench.workloads import Workload
from semblend_sglang.data import essay_texts
from semblend_sglang.namespace import Namespace
from semblend_sglang.routing_keys import ROUTING_KEY_HEADER, DonorRoutingKeys

NS = Namespace(model="m")


@pytest.fixture(scope="module")
def workloads(smollm2_tokenizer: Any) -> dict[str, Workload]:
    essays = essay_texts()
    return {
        name: build_workload(name, smollm2_tokenizer, essays, 1024, 3, seed=7)
        for name in ("cross_instruction", "rag", "template", "control")
    }


@pytest.mark.parametrize("name", ["cross_instruction", "rag", "template"])
def test_every_probe_carries_its_donors_key_and_groups_get_distinct_keys(
    workloads: dict[str, Workload], name: str
) -> None:
    keys = DonorRoutingKeys()
    group_keys = []
    for group in workloads[name].groups:
        donor = group.donors[0]
        first = keys.choose(donor.prompt_ids, NS)
        assert not first.donor and first.headers == {ROUTING_KEY_HEADER: first.key}
        keys.record(first, donor.prompt_ids, NS, "http://a")
        group_keys.append(first.key)
        for probe in group.probes:
            choice = keys.choose(probe.prompt_ids, NS)
            assert choice.donor and choice.key == first.key, (name, group.group_id)
            assert choice.shared_tokens >= 256
            keys.record(choice, probe.prompt_ids, NS, "http://a")
    assert len(set(group_keys)) == len(group_keys)


def test_unrelated_requests_and_other_namespaces_get_fresh_keys(
    workloads: dict[str, Workload],
) -> None:
    keys = DonorRoutingKeys()
    donor = workloads["cross_instruction"].groups[0].donors[0]
    probe = workloads["cross_instruction"].groups[0].probes[0]
    first = keys.choose(donor.prompt_ids, NS)
    keys.record(first, donor.prompt_ids, NS, "http://a")
    for control in workloads["control"].groups[0].probes:
        assert not keys.choose(control.prompt_ids, NS).donor
    salted = keys.choose(probe.prompt_ids, Namespace(model="m", cache_salt="tenant-b"))
    assert not salted.donor and salted.key != first.key


def test_a_key_that_moved_to_another_worker_forgets_what_it_held(
    workloads: dict[str, Workload],
) -> None:
    """SMG re-placed a key (its instance died or restarted): the requests recorded under it are
    forgotten (their KV stayed on the old worker); the request SMG served on the new worker is
    the key's donor from then on; other keys keep theirs."""
    keys = DonorRoutingKeys()
    a, b = workloads["cross_instruction"].groups[:2]
    first = keys.choose(a.donors[0].prompt_ids, NS)
    keys.record(first, a.donors[0].prompt_ids, NS, "http://a")
    other = keys.choose(b.donors[0].prompt_ids, NS)
    keys.record(other, b.donors[0].prompt_ids, NS, "http://a")
    assert len(keys.router) == 2
    probe = keys.choose(a.probes[0].prompt_ids, NS)
    assert probe.key == first.key
    keys.record(probe, a.probes[0].prompt_ids, NS, "http://b")  # SMG served it on b
    assert keys.moved_keys == 1
    assert len(keys.router) == 2  # a's donor forgotten, its probe (on b) remembered
    assert keys.choose(a.donors[0].prompt_ids, NS).key == first.key  # through the probe
    assert keys.choose(b.probes[0].prompt_ids, NS).key == other.key


def test_entries_expire_after_the_fleet_was_sent_its_kv_pools_worth(
    workloads: dict[str, Workload],
) -> None:
    group = workloads["cross_instruction"].groups[0]
    donor, probe = group.donors[0], group.probes[0]
    fleet = 3 * len(donor.prompt_ids)
    keys = DonorRoutingKeys(fleet_kv_tokens=fleet)
    first = keys.choose(donor.prompt_ids, NS)
    keys.record(first, donor.prompt_ids, NS, "http://a")
    assert keys.choose(probe.prompt_ids, NS).key == first.key
    for other in workloads["control"].groups[0].probes * 3:  # > 3 prompts' worth sent since
        keys.record(keys.choose(other.prompt_ids, NS), other.prompt_ids, NS, "http://a")
    assert not keys.choose(probe.prompt_ids, NS).donor
